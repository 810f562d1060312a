"""Translation between domain objects and protobuf messages (servicers and the step stay thin).

`DRAFT` and `VERIFIER` translate one kind of worker's step messages both ways: the scheduler
builds a step message from `WorkItem`s and reads the results back; a worker reads the items and
builds its result. `generate_event` builds the scheduler's events for the gateway.
"""

from __future__ import annotations

from services.common.grammar import Grammar
from services.common.hidden_states import HiddenStates
from services.common.sampling import SamplingParams
from services.common.tree import MAX_TREE_NODES, DraftTree
from services.common.verdict import TokenLogprob, Verdict
from services.common.worker import StepOutput, WorkItem
from specserve.v1 import common_pb2, draft_pb2, scheduler_pb2, verifier_pb2


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                    top_k=p.top_k, stop=list(p.stop), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.grammar is not None:
        msg.grammar.CopyFrom(common_pb2.Grammar(kind=p.grammar.kind, source=p.grammar.source, start=p.grammar.start))
    return msg


def params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming an out-of-range parameter."""
    p = SamplingParams(max_tokens=msg.max_tokens, temperature=float(msg.temperature),
                       top_p=float(msg.top_p) if msg.top_p else 1.0, top_k=msg.top_k,
                       seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                       ignore_eos=msg.ignore_eos, logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                       grammar=(Grammar(msg.grammar.kind, msg.grammar.source, msg.grammar.start)
                                if msg.HasField("grammar") else None))
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


def states_to_pb(hs: HiddenStates) -> common_pb2.HiddenStates:
    return common_pb2.HiddenStates(start=hs.start, rows=hs.rows, width=int(hs.data.shape[1]), data=hs.to_bytes())


def states_from_pb(msg: common_pb2.HiddenStates) -> HiddenStates:
    """ValueError for a size that does not match its shape or a non-finite value."""
    return HiddenStates.from_bytes(msg.start, msg.rows, msg.width, msg.data)


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, top_ids=[i for i, _ in t.top],
                                    top_logprobs=[v for _, v in t.top]) for t in logprobs]


def logprobs_from_pb(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, list(zip(m.top_ids, m.top_logprobs))) for m in msgs]


def verdict_to_pb(request_id: str, v: Verdict) -> verifier_pb2.Verdict:
    msg = verifier_pb2.Verdict(request_id=request_id, accepted_nodes=v.accepted_nodes, tokens=v.tokens,
                               bonus=v.bonus, logprobs=logprobs_to_pb(v.logprobs or []))
    if v.states is not None:
        msg.states.CopyFrom(states_to_pb(v.states))
    return msg


def verdict_from_pb(msg: verifier_pb2.Verdict) -> Verdict:
    states = states_from_pb(msg.states) if msg.HasField("states") else None
    logprobs = logprobs_from_pb(msg.logprobs) if msg.logprobs else None
    return Verdict(list(msg.accepted_nodes), list(msg.tokens), msg.bonus, states, logprobs)


def _common_item(it: WorkItem) -> dict:
    fields = dict(request_id=it.req_id, offset=it.offset, tokens=it.tokens, traceparent=it.traceparent)
    if it.params is not None:
        fields["params"] = params_to_pb(it.params)
    return fields


def _item_fields(pb) -> dict:
    """The fields every kind's item has; ValueError for out-of-range parameters."""
    params = params_from_pb(pb.params) if pb.HasField("params") else None
    return dict(req_id=pb.request_id, offset=pb.offset, tokens=list(pb.tokens), params=params,
                traceparent=pb.traceparent)


def _timing(out: StepOutput) -> common_pb2.StepTiming:
    return common_pb2.StepTiming(compute_ms=out.compute_ms, batch_size=out.batch, tokens=out.tokens)


class DraftCodec:
    kind = "draft"

    @staticmethod
    def step(step_id: int, items: list[WorkItem], release: list[str]) -> draft_pb2.ProposeStep:
        return draft_pb2.ProposeStep(step_id=step_id, release=release, items=[
            draft_pb2.ProposeItem(draft_length=it.draft_length, tree_size=it.tree_size, prefill=it.prefill,
                                  states=[states_to_pb(hs) for hs in it.states], **_common_item(it))
            for it in items])

    @staticmethod
    def results(msg: draft_pb2.ProposeResult) -> list[DraftTree | None]:
        return [None if p.need_resync else tree_from_pb(p.tree) for p in msg.proposals]

    @staticmethod
    def items(msg: draft_pb2.ProposeStep) -> list[WorkItem]:
        return [WorkItem(draft_length=pb.draft_length, tree_size=pb.tree_size, prefill=pb.prefill,
                         states=[states_from_pb(hs) for hs in pb.states], **_item_fields(pb)) for pb in msg.items]

    @staticmethod
    def result(step_id: int, items: list[WorkItem], out: StepOutput) -> draft_pb2.ProposeResult:
        proposals = [draft_pb2.Proposal(request_id=it.req_id, need_resync=True) if tree is None else
                     draft_pb2.Proposal(request_id=it.req_id, tree=tree_to_pb(tree))
                     for it, tree in zip(items, out.results)]
        return draft_pb2.ProposeResult(step_id=step_id, proposals=proposals, timing=_timing(out))


class VerifierCodec:
    kind = "verifier"

    @staticmethod
    def step(step_id: int, items: list[WorkItem], release: list[str]) -> verifier_pb2.VerifyStep:
        return verifier_pb2.VerifyStep(step_id=step_id, release=release, items=[
            verifier_pb2.VerifyItem(tree=tree_to_pb(it.tree or DraftTree()), state_layers=it.state_layers,
                                    prefill=it.prefill, **_common_item(it)) for it in items])

    @staticmethod
    def results(msg: verifier_pb2.VerifyResult) -> list[Verdict | None]:
        return [None if v.need_resync else verdict_from_pb(v) for v in msg.verdicts]

    @staticmethod
    def items(msg: verifier_pb2.VerifyStep) -> list[WorkItem]:
        return [WorkItem(tree=tree_from_pb(pb.tree, MAX_TREE_NODES), state_layers=tuple(pb.state_layers),
                         prefill=pb.prefill, **_item_fields(pb)) for pb in msg.items]

    @staticmethod
    def result(step_id: int, items: list[WorkItem], out: StepOutput) -> verifier_pb2.VerifyResult:
        verdicts = [verifier_pb2.Verdict(request_id=it.req_id, need_resync=True) if v is None else
                    verdict_to_pb(it.req_id, v) for it, v in zip(items, out.results)]
        return verifier_pb2.VerifyResult(step_id=step_id, verdicts=verdicts, timing=_timing(out))


DRAFT, VERIFIER = DraftCodec(), VerifierCodec()


def generate_event(tokens: list[int], text: str, finish_reason: str = "", error: str = "",
                   summary: dict | None = None, logprobs: list[TokenLogprob] | None = None, index: int = 0
                   ) -> scheduler_pb2.GenerateEvent:
    """One event of a Generate stream (of sample `index`); a sample's last carries its finish
    reason and usage."""
    event = scheduler_pb2.GenerateEvent(token_ids=tokens, text=text, finish_reason=finish_reason, error=error,
                                        logprobs=logprobs_to_pb(logprobs or []), index=index)
    if summary is not None:
        s = summary
        event.usage.CopyFrom(scheduler_pb2.Usage(
            prompt_tokens=s["prompt_tokens"], completion_tokens=s["completion_tokens"], steps=s["steps"],
            drafted_tokens=s["drafted_tokens"], accepted_tokens=s["accepted_tokens"],
            mean_accepted_length=s["mean_accepted_length"], acceptance_rate=s["acceptance_rate"]))
    return event
