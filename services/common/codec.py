"""Translation between domain objects and protobuf messages (servicers stay thin)."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.verifier.rejection import Verdict
from specserve.v1 import common_pb2, verifier_pb2


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                    top_k=p.top_k, stop=list(p.stop), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming an out-of-range parameter."""
    p = SamplingParams(max_tokens=msg.max_tokens, temperature=float(msg.temperature),
                       top_p=float(msg.top_p) if msg.top_p else 1.0, top_k=msg.top_k,
                       seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                       ignore_eos=msg.ignore_eos)
    p.validate()
    return p


def tree_to_pb(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(
        tokens=tree.tokens, parents=tree.parents,
        q=[common_pb2.QDistribution(ids=ids, probs=probs) for ids, probs in zip(tree.q_ids, tree.q_probs)],
        confidence=tree.confidence)


def tree_from_pb(msg: common_pb2.DraftTree, max_nodes: int | None = None) -> DraftTree:
    """The tree of a message; with `max_nodes`, ValueError for a larger one (before copying it:
    the verifier's attention mask is [nodes, nodes])."""
    n = max(len(msg.tokens), len(msg.parents), len(msg.q))
    if max_nodes is not None and n > max_nodes:
        raise ValueError(f"draft tree has {n} nodes, more than {max_nodes}")
    return DraftTree(list(msg.tokens), list(msg.parents), [list(q.ids) for q in msg.q],
                     [list(q.probs) for q in msg.q], list(msg.confidence))


def verdict_to_pb(request_id: str, v: Verdict) -> verifier_pb2.Verdict:
    return verifier_pb2.Verdict(request_id=request_id, accepted_nodes=v.accepted_nodes, tokens=v.tokens,
                                bonus=v.bonus)


def verdict_from_pb(msg: verifier_pb2.Verdict) -> Verdict:
    return Verdict(list(msg.accepted_nodes), list(msg.tokens), msg.bonus)
