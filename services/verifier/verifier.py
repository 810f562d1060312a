"""The verifier: verifies a batch of draft trees in one target forward and keeps only the accepted
path's KV in each request's sequence (services/common/sequence.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.constraint import Constraints
from services.common.hidden_states import HiddenStates
from services.common.llama import Chunk, LlamaModel
from services.common.sampling import warp_probs
from services.common.sequence import Sequence
from services.common.tree import DraftTree, forest_parents
from services.common.verdict import Verdict
from services.common.worker import StepWork, WorkItem
from services.verifier.logprobs import token_logprobs
from services.verifier.rejection import accept_greedy, accept_sampling

CACHE_HEADROOM = 64  # slots allocated beyond a new request's tokens and tree (the cache grows)


@dataclass
class VerifyItem:
    seq: Sequence  # the request: committed tokens, parameters, random stream, KV cache
    tree: DraftTree
    state_layers: tuple[int, ...] = ()  # return the states of these layers for the committed positions
    prefill: bool = False  # a prompt chunk short of its end: cache it, verify nothing


class Verifier:
    def __init__(self, model: LlamaModel, constraints: Constraints | None = None):
        """`constraints`: the grammar engine for requests with structured output (none: such
        requests are refused)."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.constraints = constraints

    def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        """One target forward over the pending tokens and tree nodes of every item."""
        for it in items:
            it.tree.validate(self.vocab_size)
            if it.prefill and len(it.tree):
                raise ValueError(f"request {it.seq.req_id!r}: a prefill chunk carries no draft tree")
            bad = [n for n in it.state_layers if not 0 <= n < self.model.config.num_layers]
            if bad:
                raise ValueError(f"state_layers {bad} outside the target's {self.model.config.num_layers} layers")
            if it.seq.params.grammar is not None and self.constraints is None:
                raise ValueError(f"request {it.seq.req_id!r} has a grammar; this verifier serves none")
        chunks = []
        for it in items:
            seq = it.seq
            if seq.cache is None:
                room = len(seq.tokens) + len(it.tree) + CACHE_HEADROOM
                if not seq.share_prefix((other.seq for other in items), room):
                    seq.cache = self.model.new_cache(room)
            seq.sync()  # a request rebuilt from its committed tokens recomputes from the common prefix
            pending = seq.tokens[len(seq.cached):]  # at least the last committed token (the root)
            # A prompt chunk short of its end (chunked prefill) needs no logits: nothing is verified.
            chunks.append(Chunk(seq.cache, pending + it.tree.tokens, forest_parents(len(pending), it.tree),
                                logits_from=len(pending) if it.prefill else len(pending) - 1))
        layers = next((it.state_layers for it in items if it.state_layers), ())
        all_logits, all_states = self.model.forward_states(chunks, layers)  # logits [len(tree) + 1, vocab]
        verdicts = []
        for i, (it, logits) in enumerate(zip(items, all_logits)):
            p = it.seq.params
            constraint = self.constraints.of(it.seq) if p.grammar is not None and not it.prefill else None
            if constraint is not None:  # the grammar-masked target: what plain constrained decoding samples
                logits = constraint.mask(logits, it.tree)
            if it.prefill:
                verdict = Verdict([], [], False)
            elif p.greedy:
                verdict = accept_greedy(it.tree, logits)
            else:
                verdict = accept_sampling(it.tree, warp_probs(logits, p.temperature, p.top_k, p.top_p),
                                          it.seq.generator)
            if p.logprobs is not None and not it.prefill:
                verdict.logprobs = token_logprobs(logits, verdict, p)
            start = len(it.seq.cached)
            it.seq.cached = list(it.seq.tokens)  # the forward cached every pending token
            if it.state_layers:
                verdict.states = _committed_states(all_states[i], len(it.seq.tokens) - start,
                                                   verdict.accepted_nodes, start)
            it.seq.keep_path(verdict.accepted_nodes, [it.tree.tokens[n] for n in verdict.accepted_nodes])
            verdicts.append(verdict)
        return verdicts


def _committed_states(states: torch.Tensor, pending: int, accepted: list[int], start: int) -> HiddenStates:
    """The rows of the positions a step committed: the pending tokens, then the accepted nodes
    (tree node i is row pending + i). float16, saturated at its range (never infinite)."""
    rows = torch.cat([states[:pending], states[[pending + n for n in accepted]]])
    return HiddenStates(start, rows.float().clamp(-65504.0, 65504.0).to(torch.float16))


class VerifyWork(StepWork):
    """A verifier worker's step: every item's tree in one forward."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    def run(self, work: list[tuple[Sequence, WorkItem]]) -> list[Verdict]:
        return self.verifier.verify([VerifyItem(seq, it.tree if it.tree is not None else DraftTree(),
                                                it.state_layers, it.prefill) for seq, it in work])

    def tokens(self, work, results) -> int:
        return sum(len(it.tree or ()) + 1 for _, it in work)

    def span_attributes(self, item: WorkItem, result: Verdict | None) -> dict:
        attributes = {"specserve.tree_nodes": len(item.tree or ())}
        if result is not None:
            attributes.update({"specserve.accepted_tokens": len(result.accepted_nodes),
                               "specserve.output_tokens": len(result.tokens), "specserve.bonus": result.bonus})
        return attributes
