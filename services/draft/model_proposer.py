"""Draft-model proposer: a small causal LM sharing the target's tokenizer proposes a chain or a
tree, level by level, one batched draft forward per level for every request.

Tree shape: depth at most k (draft_length), at most tree_size nodes, at most
ceil(tree_size / k) nodes per level, grown as services/draft/tree_growth.py describes.

Draft KV cache per request (its sequence's): slots [0, len(cached)) hold committed tokens, the tree nodes fed to
the draft follow in node order. On the next step the accepted path is found by walking the new
committed tokens down the previous tree, and `KVCache.keep` moves its KV next to the prefix.

SlimSpec (services/draft/slim.py): with a slim head, a step's forwards score only the kept ids and
q is the softmax over them (zero elsewhere), mapped back to target ids. The quality guard
(services/draft/slim_guard.py) picks the head per step and is told each tree's accepted length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


from services.common.llama import Chunk, LlamaModel
from services.common.sequence import Sequence
from services.common.tree import MAX_TREE_NODES, DraftTree
from services.draft.proposer import ProposeItem, Proposer
from services.draft.slim import SlimHead
from services.draft.tree_growth import Growth, distributions, grow
from services.draft.slim_guard import SlimGuard


@dataclass
class _Drafted:
    """The tree a request's last step drafted, kept in its sequence's `scratch`."""

    tree: DraftTree
    slim: bool  # whether the slim head drafted it
    fed: int = 0  # nodes 0..fed-1 of the tree have KV in slots len(seq.cached)..


class ModelProposer(Proposer):
    name = "model"

    def __init__(self, model: LlamaModel, vocab_size: int, branch: int = 4, q_support: int = 32,
                 slim: SlimHead | None = None, guard: SlimGuard | None = None):
        self.model = model
        self.slim = slim  # None = the full head always
        self.guard = guard if slim is not None else None  # None = the slim head always (when set)
        self.max_positions = model.config.max_positions
        self.vocab_size = vocab_size  # the target's; draft logits beyond it are masked
        self.branch = branch
        self.q_support = q_support

    def slim_state(self) -> dict | None:
        """SlimSpec's state (mode, calibrated and rolling rates, fallbacks); None without SlimSpec."""
        if self.slim is None:
            return None
        state = self.guard.state() if self.guard is not None else {"mode": "slim", "fallbacks": 0}
        return {**state, "kept": int(self.slim.kept.numel())}

    def _new_cache(self, seq: Sequence, others: list[Sequence], room: int) -> None:
        """A new request's cache: a copy of the prefix another request of the step holds, if any."""
        if not seq.share_prefix(others, room):
            seq.cache = self.model.new_cache(room)

    def _sync(self, item: ProposeItem, others: list[Sequence]) -> list[int]:
        """Bring the request's cache up to its committed tokens: keep the KV of the previous
        tree's path that the new committed tokens walk down. Returns the tokens to feed."""
        seq = item.seq
        if seq.cache is None:
            self._new_cache(seq, others, len(seq.tokens) + 2 * item.tree_size + 64)
        last, seq.scratch = seq.scratch, None
        if seq.sync():  # stale (or nothing new): the tree's KV went with the rollback
            last = None
        if last is not None:
            new = seq.tokens[len(seq.cached):]
            if self.guard is not None:
                self.guard.observe(len(last.tree), len(_walk(last.tree, new, len(last.tree))), last.slim)
            path = _walk(last.tree, new, last.fed)
            seq.keep_path(path, new[: len(path)])
            seq.sync()  # the root must be fed to get its distribution
        return seq.tokens[len(seq.cached):]

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        # The node budget is capped as the scheduler caps it (it also sizes each request's cache).
        items = [it if it.tree_size <= MAX_TREE_NODES else replace(it, tree_size=MAX_TREE_NODES) for it in items]
        trees = [DraftTree() for _ in items]
        use_slim = self.slim is not None and (self.guard is None or self.guard.use_slim())
        model = self.slim.model if use_slim else self.model  # same layers and caches; head differs
        kept = self.slim.kept if use_slim else None
        works, chunks = [], []
        for i, it in enumerate(items):
            if it.draft_length <= 0 or it.tree_size <= 0:
                continue
            pending = self._sync(it, [x.seq for x in items])
            it.seq.scratch = _Drafted(trees[i], use_slim)
            works.append(Growth(it, trees[i], max(1, math.ceil(it.tree_size / it.draft_length)), [(-1, 1.0)]))
            chunks.append(Chunk(it.seq.cache, pending, list(range(-1, len(pending) - 1)),
                                logits_from=len(pending) - 1))
        if not works:
            return trees
        logits = model.forward(chunks)  # level 0: the root's distribution, [1, vocab or kept] each
        for w in works:
            w.item.seq.cached = list(w.item.seq.tokens)
        depth = 1
        while works:
            dists = distributions(works, logits, kept, self.vocab_size, self.branch, self.q_support)
            grown = [(w, grow(w, *d, self.branch)) for w, d in zip(works, dists)]
            depth += 1
            works, chunks = [], []
            for w, new in grown:
                if new and depth <= w.item.draft_length and len(w.tree) < w.item.tree_size:
                    seq, drafted = w.item.seq, w.item.seq.scratch
                    chunks.append(Chunk(seq.cache, [w.tree.tokens[n] for n in new],
                                        w.tree.parents[: drafted.fed + len(new)], logits_from=0,
                                        tree_start=len(seq.cached)))
                    drafted.fed += len(new)
                    works.append(w)
            if works:
                logits = model.forward(chunks)  # [len(new), vocab or kept] each
        return trees

    def prefill(self, seqs: list[Sequence], others: list[Sequence]) -> None:
        """Cache every token of each prompt chunk (no logits: nothing is drafted from it)."""
        chunks = []
        for seq in seqs:
            if seq.cache is None:
                self._new_cache(seq, others, len(seq.tokens) + 64)
            seq.scratch = None
            seq.sync()
            pending = seq.tokens[len(seq.cached):]
            chunks.append(Chunk(seq.cache, pending, list(range(-1, len(pending) - 1)), logits_from=len(pending)))
            seq.cached = list(seq.tokens)
        self.model.forward(chunks)


def _walk(tree: DraftTree, committed: list[int], fed: int) -> list[int]:
    """The nodes (among the first `fed`, which have KV) that `committed` walks down from the root."""
    kids = tree.children()
    node, path = -1, []
    for tok in committed:
        node = next((c for c in kids[node + 1] if c < fed and tree.tokens[c] == tok), None)
        if node is None:
            break
        path.append(node)
    return path
