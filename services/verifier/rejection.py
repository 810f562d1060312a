"""Acceptance of a draft tree against the target: greedy and lossless speculative sampling.

Rows of the target distribution: row 0 belongs to the root (the last committed token) and row
i + 1 to tree node i; row r is the target's next-token distribution after that node's path.

Walking down from the root, the children of the current node are tried in order:

- accepted tokens: a child x drawn from q is accepted with probability min(1, p(x) / q(x));
  after a rejection p becomes norm(max(0, p - q)) and the next sibling is tried against it
  (recursive rejection sampling; exact for any q per sibling, as long as each sibling was
  drawn from the q recorded with it);
- recovered token: when every child is rejected, one token is sampled from the residual p;
- bonus token: when the walk reaches a leaf, one token is sampled from that leaf's p.

At temperature 0 the walk follows the child equal to the target's argmax, and the recovered or
bonus token is the argmax itself. Output tokens = accepted tokens + one recovered or bonus token.
"""

from __future__ import annotations

import torch

from services.common import cpu_kernels
from services.common.sampling import sample
from services.common.tree import DraftTree
from services.common.verdict import Verdict


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of ties (torch.argmax's answer): on the CPU kernels where this
    process runs them, at memory speed."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and logits.shape[-1] > 0 and cpu_kernels.loaded():
        return torch.ops.specserve_q.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """logits: [len(tree) + 1, vocab]."""
    best = argmax_rows(logits)
    kids = tree.children()
    node, path = -1, []
    while True:
        want = best[node + 1]
        child = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        if child is None:
            tokens = [tree.tokens[c] for c in path] + [want]
            return Verdict(path, tokens, bonus=not kids[node + 1])
        path.append(child)
        node = child


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """probs: [len(tree) + 1, vocab] target distributions (already warped), float32."""
    kids = tree.children()
    node, path = -1, []
    while True:
        p = probs[node + 1]
        children = kids[node + 1]
        if not children:
            return Verdict(path, [tree.tokens[c] for c in path] + [sample(p, generator)], bonus=True)
        accepted = None
        for c in children:
            x = tree.tokens[c]
            ids = torch.tensor(tree.q_ids[c], dtype=torch.long)
            q = torch.tensor(tree.q_probs[c], dtype=p.dtype)
            qx = float(q[ids == x].sum())
            if qx <= 0.0:
                raise ValueError(f"draft node {c}: token {x} has q = 0, it cannot have been drawn from q")
            if float(torch.rand((), generator=generator)) * qx < float(p[x]):
                accepted = c
                break
            residual = p.clone()
            residual[ids] = (p[ids] - q).clamp_(min=0.0)
            mass = float(residual.sum())
            if mass > 0.0:  # mass 0 only when p == q up to rounding, where rejection is rare
                p = residual / mass
        if accepted is None:
            return Verdict(path, [tree.tokens[c] for c in path] + [sample(p, generator)], bonus=False)
        path.append(accepted)
        node = accepted
