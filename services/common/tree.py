"""Draft trees and the tree math shared by draft and verifier.

A draft tree holds the proposed tokens of one request in one step. Node i has a token, a parent
index (-1 = the last committed token, the root) and the exact proposal distribution q it was drawn
from, stored sparsely as (ids, probs). Nodes are stored parents-first, and siblings carry distinct
tokens. A chain is a tree with one child per node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_TREE_NODES = 256  # draft nodes per request per step on the wire (the scheduler's cap)
Q_SUM_TOLERANCE = 1e-3  # a node's q must sum to 1 within this (float32 rounding on the wire)


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # q of node i: probs q_probs[i] on ids q_ids[i] (exact; mass outside the ids is zero).
    q_ids: list[list[int]] = field(default_factory=list)
    q_probs: list[list[float]] = field(default_factory=list)
    # Optional, one per node: the proposer's confidence (from the context only) that the node is
    # accepted, for the scheduler's trimming (services/scheduler/trim.py); never used to verify.
    confidence: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, q_ids: list[int], q_probs: list[float]) -> int:
        assert parent < len(self.tokens), "parents must come before their children"
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.q_ids.append(q_ids)
        self.q_probs.append(q_probs)
        return len(self.tokens) - 1

    def children(self) -> list[list[int]]:
        """children()[p + 1] lists the children of node p (index 0 is the root) in order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def subtree(self, keep: list[int]) -> DraftTree:
        """The tree of the nodes `keep` (closed under parents), in their original order."""
        keep = sorted(keep)
        index = {old: new for new, old in enumerate(keep)}
        out = DraftTree()
        for old in keep:
            parent = self.parents[old]
            out.add(self.tokens[old], index[parent] if parent >= 0 else -1, self.q_ids[old], self.q_probs[old])
        if len(self.confidence) == len(self.tokens):
            out.confidence = [self.confidence[i] for i in keep]
        return out

    def first_path(self) -> list[int]:
        """The nodes of the tree's first chain (each level's first child), root downwards: the
        proposer's most likely path."""
        path, node = [], -1
        for i, parent in enumerate(self.parents):
            if parent == node:
                path.append(i)
                node = i
        return path

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError when the tree breaks an invariant the verifier relies on."""
        n = len(self.tokens)
        if not (len(self.parents) == len(self.q_ids) == len(self.q_probs) == n):
            raise ValueError("draft tree fields have different lengths")
        seen: set[tuple[int, int]] = set()
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be in [-1, {i})")
            if not 0 <= tok < vocab_size:
                raise ValueError(f"node {i}: token {tok} outside the vocabulary")
            if (p, tok) in seen:
                raise ValueError(f"node {i}: duplicate sibling token {tok}")
            seen.add((p, tok))
            _validate_q(i, self.q_ids[i], self.q_probs[i], vocab_size)


def _validate_q(node: int, ids: list[int], probs: list[float], vocab_size: int) -> None:
    """A node's q: distinct ids inside the vocabulary, finite probabilities in [0, 1] summing to
    1 (the verifier indexes its distributions with the ids and divides by the probabilities)."""
    if len(ids) != len(probs):
        raise ValueError(f"node {node}: q ids and probs differ in length")
    if not ids:
        raise ValueError(f"node {node}: q is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(f"node {node}: q ids repeat")
    if not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"node {node}: q ids outside the vocabulary")
    if not all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"node {node}: q probabilities must be finite and in [0, 1]")
    if abs(math.fsum(probs) - 1.0) > Q_SUM_TOLERANCE:
        raise ValueError(f"node {node}: q probabilities sum to {math.fsum(probs):g}, not 1")


def forest_parents(n_pending: int, tree: DraftTree) -> list[int]:
    """Parents over one step's new tokens: the pending committed tokens (a chain; the last one is
    the root) followed by the tree nodes. -1 means "attends to the cached prefix only"."""
    parents = list(range(-1, n_pending - 1))
    root = n_pending - 1
    parents.extend(root if p < 0 else n_pending + p for p in tree.parents)
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when j is i or an ancestor of i (parents-first order)."""
    n = len(parents)
    if all(p == i - 1 for i, p in enumerate(parents)):
        return torch.ones(n, n, dtype=torch.bool).tril_()
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return torch.from_numpy(anc)


def forest_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a forest; nodes with parent -1 have depth 0."""
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node indices from the first level down to `node` (empty for the root, node = -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
