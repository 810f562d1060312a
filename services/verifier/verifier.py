"""The verifier: holds the target and one KV cache per request; verifies a batch of draft trees in
one target forward and keeps only the accepted path's KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.kv_cache import KVCache
from services.common.llama import Chunk, LlamaModel
from services.common.sampling import SamplingParams, warp_probs
from services.common.tree import DraftTree, forest_parents
from services.verifier.rejection import Verdict, accept_greedy, accept_sampling


@dataclass
class VerifyItem:
    req_id: str
    tokens: list[int]  # every committed token of the request (prompt + output so far)
    tree: DraftTree
    params: SamplingParams
    generator: torch.Generator | None  # the request's verifier random stream (T > 0)


@dataclass
class _State:
    cache: KVCache
    cached: list[int]  # the committed tokens whose KV is in cache slots 0 .. len(cached) - 1


class Verifier:
    def __init__(self, model: LlamaModel):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self._states: dict[str, _State] = {}

    def active_requests(self) -> list[str]:
        return list(self._states)

    def release(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def cache_bytes(self) -> int:
        return sum(st.cache.nbytes() for st in self._states.values())

    def _state_for(self, item: VerifyItem) -> _State:
        st = self._states.get(item.req_id)
        if st is None:
            st = _State(self.model.new_cache(len(item.tokens) + len(item.tree) + 64), [])
            self._states[item.req_id] = st
        # The committed tokens must extend what is cached; otherwise roll back to the common
        # prefix (e.g. a request rebuilt from its committed tokens) and recompute from there.
        n = len(st.cached)
        if n >= len(item.tokens) or item.tokens[:n] != st.cached:
            common = 0
            limit = min(n, len(item.tokens) - 1)
            while common < limit and st.cached[common] == item.tokens[common]:
                common += 1
            st.cached = st.cached[:common]
            st.cache.truncate(common)
        return st

    def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        """One target forward over the pending tokens and tree nodes of every item."""
        for it in items:
            it.tree.validate(self.vocab_size)
        states = [self._state_for(it) for it in items]
        chunks = []
        for it, st in zip(items, states):
            pending = it.tokens[len(st.cached) :]  # at least the last committed token (the root)
            chunks.append(Chunk(st.cache, pending + it.tree.tokens,
                                forest_parents(len(pending), it.tree), logits_from=len(pending) - 1))
        all_logits = self.model.forward(chunks)  # per item [len(tree) + 1, vocab]
        verdicts = []
        for it, st, logits in zip(items, states, all_logits):
            if it.params.greedy:
                verdict = accept_greedy(it.tree, logits)
            else:
                p = it.params
                probs = warp_probs(logits, p.temperature, p.top_k, p.top_p)
                verdict = accept_sampling(it.tree, probs, it.generator)
            # Keep the pending tokens and the accepted path; drop the rest of the tree.
            base = len(it.tokens)
            st.cache.keep(base, [base + i for i in verdict.accepted_nodes])
            st.cached = it.tokens + [it.tree.tokens[i] for i in verdict.accepted_nodes]
            verdicts.append(verdict)
        return verdicts
