"""Feature-head proposer: the EAGLE-style head (services/draft/feature_head.py) drafts a tree
from the target's hidden states, which the verifier returns for every position it commits.

Per request (its draft sequence): a one-layer KV cache whose first `slots` slots hold the
committed positions read from the target's states, in position order (a position whose states
never arrived, after a lost replica, simply has no slot: the head drafts from what it has); the
step's tree nodes follow, fed from the head's own output states, and are dropped at the next step,
whose committed positions come back as target states (rolling back to the accepted path costs a
truncate). The head drafts only when it has the states of every position up to the one before
the last committed token; otherwise it proposes nothing that step (a replica that lost a request
regains it as states arrive).

Tree shape and sampling: services/draft/tree_growth.py, on the head's reduced vocabulary (its
`d2t` map gives each column's target id; q is zero outside it, which rejection sampling allows).
Chains on the CPU kernels, the common case there, take one head.cpp call for the whole draft
(`head_chain`: greedy ones the same tokens and stops, sampled ones draws from the same q, without
a Python round trip per level).
Greedy trees carry the head's probability of each node's token as its confidence (EAGLE-2's
estimate of its acceptance given its parent's), which the scheduler's trim calibrates and uses,
and stop a level early when the last level's path probabilities are too small to pay for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from services.common.kv_cache import KVCache
from services.common.llama import NO_MASK
from services.common.tree import MAX_TREE_NODES, DraftTree
from services.draft.feature_head import FeatureHead
from services.draft.proposer import ProposeItem, Proposer
from services.draft.tree_growth import Growth, distributions, grow

CACHE_HEADROOM = 64
# A greedy tree stops growing once its last level's path probabilities sum below this: the next
# level could add no more expected tokens than that, and drafting a level costs a few percent of
# a target step (EAGLE-2's confidence-bounded trees).
MIN_LEVEL_MASS = 0.05


@dataclass
class _HeadState:
    slots: int = 0  # cache slots holding committed positions
    last: int = -1  # the last committed position fed
    out: torch.Tensor | None = None  # [hidden]: the head's output state at `last`
    logits: torch.Tensor | None = None  # [1, draft vocab]: its draft logits (the tree's first level)
    tree_fed: int = 0  # this step's tree nodes with a slot (after the committed ones)
    node_out: list = field(default_factory=list)  # output state [hidden] of each fed tree node
    held: list = field(default_factory=list)  # HiddenStates of steps it did not draft (hold), fed next time


@dataclass
class _Part:
    """One request's rows in one head forward."""

    cache: KVCache
    # [n, hidden]: each row's input state, its parent's output; a committed part holds the target's
    # states [n, layers * hidden] instead, which _forward fuses
    state: torch.Tensor
    ids: list[int]  # [n]: the token each row reads
    positions: list[int]  # [n]
    tree_start: int  # the slots before it see every row; after it, `visible` says
    visible: torch.Tensor  # [n, slots from tree_start] bool, or NO_MASK: causal (attention.cpp's plan)

    def mask(self) -> torch.Tensor:
        """[n, tree_start + slots after it] bool: what each row attends to (torch's SDPA)."""
        n = len(self.ids)
        seen = torch.ones(n, n, dtype=torch.bool).tril() if self.visible is NO_MASK else self.visible
        return torch.cat([torch.ones(n, self.tree_start, dtype=torch.bool), seen], 1)


@dataclass
class _Chains:
    """What head_chain drafts after the committed rows, per request: its depth, its sampling (a
    temperature of 0: greedy) and the uniforms [requests, max depth] a sampled chain's draws use."""

    depths: list[int]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    uniforms: torch.Tensor


class HeadProposer(Proposer):
    name = "head"

    def __init__(self, head: FeatureHead, embed: torch.Tensor, vocab_size: int, branch: int = 4,
                 q_support: int = 32, min_level_mass: float = MIN_LEVEL_MASS):
        self.head = head.eval().requires_grad_(False)
        self.head.prepare_serving()
        self.embed = embed.float()  # [target vocab, hidden]: the target's token embedding
        self.vocab_size = vocab_size
        self.branch, self.q_support, self.min_level_mass = branch, q_support, min_level_mass
        self.feature_layers = tuple(head.config.target_layers)
        self.max_positions = head.config.max_positions
        self.width = head.config.state_size

    @torch.inference_mode()
    def _forward(self, parts: list[_Part], committed: bool = False, chains: _Chains | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list | None]:
        """Feed every part's rows into its cache; returns each part's output states [n, hidden] and
        draft logits [n, draft vocab]. `committed`: the parts hold the target's states (fused
        first), and only each one's last row's logits are wanted ([1, draft vocab]). `chains`
        (committed parts, native kernels): each part's greedy chain depth, drafted in the same
        call; then also each part's (target ids, confidences), else None."""
        h, sizes = self.head, [len(p.ids) for p in parts]
        state, emb = torch.cat([p.state for p in parts]), self.embed[[i for p in parts for i in p.ids]]
        positions = torch.tensor([t for p in parts for t in p.positions])
        offsets = [0, *itertools.accumulate(sizes)]  # each part's first row, then the total
        # the rows whose logits are wanted
        rows = torch.tensor(offsets[1:]) - 1 if committed else torch.arange(offsets[-1])
        cos, sin = h.rope_at(positions)  # [N, d]
        drafted = None
        if h.native is not None:
            out, logits, drafted = self._native_forward(parts, state, emb, cos, sin, offsets[:-1], rows, committed,
                                                        chains)
        else:
            state = h.fuse_states(state) if committed else state
            out = self._torch_layer(parts, h.layer_input(state, emb), cos, sin)
            logits = h.logits(out[rows])
        return list(out.split(sizes)), list(logits.split([1] * len(parts) if committed else sizes)), drafted

    def _native_forward(self, parts: list[_Part], state, emb, cos, sin, offsets: list[int], rows, committed: bool,
                        chains: _Chains | None = None) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """The head in one head.cpp call (the target's own CPU kernels): output states [N, hidden]
        and the logits of `rows` [R, draft vocab]; with `chains`, head_chain also drafts each part's
        chain after its rows (a level a row in the kernel, not a Python round trip: on a CPU a pause
        between two target forwards slows the next one too, BENCHMARKS.md) and returns (target ids,
        confidences, a sampled chain's q per level or None) per part. The chain's rows are dropped
        at the next step."""
        h, c = self.head, self.head.config
        for p, depth in zip(parts, chains.depths if chains else [0] * len(parts)):
            p.cache.reserve(p.cache.length + len(p.ids) + depth)
        args = (state.float().contiguous(), emb.contiguous(), cos, sin, *h.native, [p.cache.k for p in parts],
                [p.cache.v for p in parts], offsets, [len(p.ids) for p in parts], [p.cache.length for p in parts],
                [p.tree_start for p in parts], [p.visible for p in parts], c.num_heads, c.num_kv_heads,
                c.rms_norm_eps, rows)
        drafted = None
        if chains is None:
            out, logits = torch.ops.specserve_q.head_forward(*args, committed)
        else:
            lasts = [p.positions[-1] for p in parts]
            out, logits, tokens, confs, q_ids, q_probs = torch.ops.specserve_q.head_chain(
                *args, self.embed, h.d2t, *h.rope_table(max(lasts) + max(chains.depths) + 1), chains.depths,
                lasts, self.min_level_mass, c.draft_vocab, chains.temperatures, chains.top_ks, chains.top_ps,
                chains.uniforms, self.q_support)
            drafted = [(tok, conf, (q_ids[i].tolist(), q_probs[i].tolist()) if t > 0 else None)
                       for i, (tok, conf, t) in enumerate(zip(tokens.tolist(), confs.tolist(), chains.temperatures))]
        for p in parts:
            p.cache.length += len(p.ids)
        return out, logits[:, : c.draft_vocab], drafted  # the LM head's tiles pad its outputs to 16

    def _torch_layer(self, parts: list[_Part], u, cos, sin) -> torch.Tensor:
        h = self.head
        q, k, v = h.qkv(u, cos, sin)  # [heads, N, d], [kv_heads, N, d] x 2
        attn, off = [], 0
        for p in parts:
            n, start = len(p.ids), p.cache.length
            p.cache.reserve(start + n)
            p.cache.k[0][:, start : start + n] = k[:, off : off + n]
            p.cache.v[0][:, start : start + n] = v[:, off : off + n]
            p.cache.length = start + n
            o = F.scaled_dot_product_attention(q[None, :, off : off + n], p.cache.k[0][None, :, : start + n],
                                               p.cache.v[0][None, :, : start + n], attn_mask=p.mask(),
                                               enable_gqa=True)[0]  # [heads, n, d]
            attn.append(o.transpose(0, 1).flatten(1))
            off += n
        return h.finish(u, torch.cat(attn))

    def _state(self, seq) -> _HeadState:
        st = seq.scratch if isinstance(seq.scratch, _HeadState) else None
        if st is None or st.last >= len(seq.tokens) - 1:  # new, or tokens it never saw: start over
            c = self.head.config
            seq.cache = KVCache(1, c.num_kv_heads, c.head_dim, len(seq.tokens) + CACHE_HEADROOM,
                                torch.float32, torch.device("cpu"))
            st = seq.scratch = _HeadState()
        seq.cache.truncate(st.slots)  # the last step's tree
        st.tree_fed, st.node_out = 0, []
        return st

    def _committed_part(self, it: ProposeItem, st: _HeadState) -> _Part | None:
        """The rows of the positions whose states arrived (and are new), or None."""
        seq, rows, positions = it.seq, [], []
        held, st.held = st.held + list(it.states), []
        for hs in held:
            hs.check(self.width)
            first = max(hs.start, st.last + 1, len(positions) and positions[-1] + 1)
            # position t reads the token after it, so it must be committed: t <= len(tokens) - 2
            end = min(hs.start + hs.rows, len(seq.tokens) - 1)
            if end > first:
                rows.append(hs.data[first - hs.start : end - hs.start])
                positions.extend(range(first, end))
        if not positions:
            return None
        # the target's states [n, layers * hidden]: _forward fuses them
        return _Part(seq.cache, torch.cat(rows), [seq.tokens[t + 1] for t in positions], positions, st.slots,
                     NO_MASK)

    def hold(self, items: list[ProposeItem]) -> None:
        """Keep these items' states for each request's next draft without drafting now (the
        hybrid took the n-gram's tree): one forward then feeds every held position at once."""
        for it in items:
            if it.states:
                self._state(it.seq).held.extend(it.states)

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        items = [it if it.tree_size <= MAX_TREE_NODES else replace(it, tree_size=MAX_TREE_NODES) for it in items]
        trees = [DraftTree() for _ in items]
        live = [(i, it, self._state(it.seq)) for i, it in enumerate(items) if it.draft_length > 0 and it.tree_size > 0]
        fed = [(i, it, st, part) for i, it, st in live if (part := self._committed_part(it, st)) is not None]
        if fed:
            chains = self._chains(live, fed)
            outs, logits, drafted = self._forward([p for *_, p in fed], committed=True, chains=chains)
            for (_, it, st, part), out, lg in zip(fed, outs, logits):
                st.slots, st.last, st.out, st.logits = st.slots + len(part.ids), part.positions[-1], out[-1], lg
            if drafted is not None:  # chains, drafted in that call
                for (i, *_), (tokens, confs, q) in zip(fed, drafted):
                    _add_chain(trees[i], tokens, confs, q)
                return trees
        # the head drafts from the output at the position before the last committed token
        works = [Growth(it, trees[i], max(1, -(-it.tree_size // it.draft_length)), [(-1, 1.0)])
                 for i, it, st in live if st.out is not None and st.last == len(it.seq.tokens) - 2]
        if works:
            self._grow(works)
        return trees

    def _chains(self, live: list, fed: list) -> _Chains | None:
        """The chains to draft when every drafting request wants a chain (one node a level, no
        grammar) from the rows fed now, on the native kernels: then the committed rows' head.cpp
        call drafts them all (head_chain). Otherwise None (level by level: _grow)."""
        if self.head.native is None or len(fed) != len(live) or not all(
                it.seq.constraint is None and it.tree_size <= it.draft_length
                and part.positions[-1] == len(it.seq.tokens) - 2 for _, it, _, part in fed):
            return None
        depths = [min(it.draft_length, it.tree_size) for _, it, _, _ in fed]
        params = [it.seq.params for _, it, _, _ in fed]
        uniforms = torch.zeros(len(fed), max(depths), dtype=torch.float64)
        for row, (_, it, _, _), depth in zip(uniforms, fed, depths):
            if not it.seq.params.greedy:
                row[:depth] = torch.rand(depth, dtype=torch.float64, generator=it.seq.generator)
        return _Chains(depths, [p.temperature for p in params], [p.top_k for p in params],
                       [p.top_p for p in params], uniforms)

    @torch.inference_mode()
    def _grow(self, works: list[Growth]) -> None:
        logits = [w.item.seq.scratch.logits for w in works]  # [1, draft vocab] each
        depth = 1
        while works:
            dists = distributions(works, logits, self.head.d2t, self.vocab_size, self.branch, self.q_support)
            grown = [(w, grow(w, *d, self.branch, confidence=True)) for w, d in zip(works, dists)]
            depth += 1
            works = [(w, new) for w, new in grown
                     if new and depth <= w.item.draft_length and len(w.tree) < w.item.tree_size
                     and (not w.item.seq.params.greedy or sum(v for _, v in w.frontier) >= self.min_level_mass)]
            if not works:
                return
            outs, logits, _ = self._forward([self._tree_part(w, new) for w, new in works])  # [new, ...] each
            for (w, _), out in zip(works, outs):
                w.item.seq.scratch.node_out.extend(out)
            works = [w for w, _ in works]

    def _tree_part(self, w: Growth, new: list[int]) -> _Part:
        """The new level's nodes: each reads its parent's output state and its own token."""
        seq, st, tree = w.item.seq, w.item.seq.scratch, w.tree
        parents = [tree.parents[n] for n in new]
        state = torch.stack([st.out if p < 0 else st.node_out[p] for p in parents])
        depth = tree.depths()
        positions = [st.last + depth[n] for n in new]
        # after the prefix slots, the tree's fed nodes (node i in slot st.slots + i) on the node's path
        fed = st.tree_fed + len(new)
        visible = [[False] * fed for _ in new]
        for row, n in zip(visible, new):
            while n >= 0:
                row[n] = True
                n = tree.parents[n]
        st.tree_fed = fed
        return _Part(seq.cache, state, [tree.tokens[n] for n in new], positions, st.slots,
                     torch.tensor(visible, dtype=torch.bool))


def _add_chain(tree: DraftTree, tokens: list[int], confs: list[float], q: tuple[list, list] | None) -> None:
    """A chain into `tree`: each token under the last; -1 ends a chain that stopped early. Greedy (q
    None): a point-mass q and the head's probability of the token as its confidence. Sampled: the q
    it was drawn from, per level its target ids (-1 past the support) and probabilities."""
    node = -1
    for d, (tok, conf) in enumerate(zip(tokens, confs)):
        if tok < 0:
            return
        if q is None:
            node = tree.add(tok, node, [tok], [1.0])
            tree.confidence.append(conf)
        else:
            ids, probs = q[0][d], q[1][d]
            kept = ids.index(-1) if -1 in ids else len(ids)
            node = tree.add(tok, node, ids[:kept], probs[:kept])
