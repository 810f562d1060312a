"""Growing a draft tree level by level from a draft's distributions (the model draft's and the
feature head's way): each level's node budget goes to the (frontier node, r-th most likely child)
pairs with the highest path probability; how many children a node gets is decided before
anything is sampled, so at temperature > 0 the sampled children (drawn without replacement from q,
the draft's distribution truncated to its `q_support` most likely tokens) keep exactly the q
recorded with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.constraint import allowed_tokens
from services.common.sampling import warp_probs
from services.common.tree import DraftTree
from services.draft.proposer import ProposeItem


@dataclass
class Growth:
    """One request's tree being built in this step."""

    item: ProposeItem
    tree: DraftTree
    width: int  # nodes per level
    frontier: list[tuple[int, float]]  # (node, path probability) of the last level; node -1 = root


def distributions(works: list[Growth], logits: list[torch.Tensor], kept: torch.Tensor | None,
                  vocab_size: int, branch: int, q_support: int) -> list[tuple]:
    """Per work: (sorted q values [rows, K], their target ids [rows, K]) for the frontier rows.
    kept: the slim head's ids (logits column j = target id kept[j]); None = the full head."""
    out = []
    for w, lg in zip(works, logits):
        lg = lg[:, :vocab_size] if kept is None else lg  # [rows, vocab or kept]
        if w.item.seq.constraint is not None:
            lg = _grammar_masked(w, lg, kept, vocab_size)
        p = w.item.seq.params
        probs = lg.float().softmax(-1) if p.greedy else warp_probs(lg, p.temperature, p.top_k, p.top_p)
        k = min(q_support if not p.greedy else branch, probs.shape[-1])
        vals, ids = torch.topk(probs, k, dim=-1)  # [rows, K], sorted descending
        if not p.greedy:
            vals = vals / vals.sum(-1, keepdim=True)  # q: the truncated, renormalized draft
        if kept is not None:
            ids = kept[ids]  # slim columns -> target ids
        out.append((vals, ids))
    return out


def _grammar_masked(w: Growth, logits: torch.Tensor, kept: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A request with a grammar drafts from its masked distribution (the q it records), so its
    nodes are tokens the verifier's masked target can accept. A row whose allowed tokens the
    draft's vocabulary lacks stays as it is (its nodes are pruned later)."""
    masks = w.item.seq.constraint.path_masks(w.tree, [node for node, _ in w.frontier])
    allowed = allowed_tokens(masks, vocab_size)  # [rows, vocab]
    if kept is not None:
        allowed = allowed[:, kept]  # [rows, kept]: the slim head's columns
    allowed |= ~allowed.any(-1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))


def grow(w: Growth, vals: torch.Tensor, ids: torch.Tensor, branch: int, confidence: bool = False) -> list[int]:
    """Add one level of children under w.frontier; returns the new node indices. `confidence`
    (greedy trees, whose tokens are a function of the context): record the draft's probability
    of each node's token as its confidence (P(accepted | parent accepted), for the trim)."""
    budget = min(w.width, w.item.tree_size - len(w.tree))
    qv, qi = vals.tolist(), ids.tolist()  # per frontier row: sorted q values and their ids
    cands = []  # (score, frontier row): children are allocated before any sampling
    for row, (_, score) in enumerate(w.frontier):
        for v in qv[row][:branch]:
            if v <= 0.0:  # never allocate a child that cannot be drawn
                break
            cands.append((score * v, row))
    cands.sort(key=lambda c: -c[0])
    counts = [0] * len(w.frontier)
    for _, row in cands[:budget]:
        counts[row] += 1
    greedy = w.item.seq.params.greedy
    new = []
    for row, ((node, score), b) in enumerate(zip(w.frontier, counts)):
        if b == 0:
            continue
        if greedy:  # deterministic top-b children, each with a point-mass q
            for r in range(b):
                tok = qi[row][r]
                new.append((w.tree.add(tok, node, [tok], [1.0]), score * qv[row][r]))
                if confidence:
                    w.tree.confidence.append(qv[row][r])
            continue
        picks = torch.multinomial(vals[row], b, replacement=False, generator=w.item.seq.generator).tolist()
        q = list(qv[row])
        for j in picks:  # sibling i was drawn from q without the siblings before it
            total = sum(q)
            support = [(t, v / total) for t, v in zip(qi[row], q) if v > 0.0]
            w.tree.add(qi[row][j], node, [t for t, _ in support], [v for _, v in support])
            new.append((len(w.tree) - 1, score * qv[row][j]))
            q[j] = 0.0
    w.frontier = new
    return [n for n, _ in new]
