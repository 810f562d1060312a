"""The feature head and the n-gram lookup behind one draft (`--draft PATH+ngram`).

Per request and step, the n-gram's tree when its best match is long (a verbatim copy the head
would have to predict token by token), else the head's: the n-gram's confidence of its first
token is the length-weighted share of its matches (services/draft/ngram.py), 0.9 from a match of
9 tokens on, where its first proposed token was right 93-98% of the time. The choice depends on
the context alone (never on what the head sampled), so the proposal's q stays exact. The head
runs every step either way: it must read the target's states as they arrive.
"""

from __future__ import annotations

from services.common.tree import DraftTree
from services.draft.head_proposer import HeadProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import ProposeItem, Proposer

LONG_MATCH = 0.9  # the n-gram's first-token confidence from which its tree is used


class HybridProposer(Proposer):
    name = "head+ngram"

    def __init__(self, head: HeadProposer, ngram: NgramProposer | None = None, long_match: float = LONG_MATCH):
        self.head, self.ngram = head, ngram or NgramProposer()
        self.long_match = long_match
        self.feature_layers, self.max_positions = head.feature_layers, head.max_positions
        self.chosen = {"head": 0, "ngram": 0}  # trees proposed by each, for tests and logs

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        heads, grams = self.head.propose(items), self.ngram.propose(items)
        out = []
        for h, g in zip(heads, grams):
            first = max((c for c, p in zip(g.confidence, g.parents) if p < 0), default=0.0)
            use_ngram = first >= self.long_match or not len(h)
            self.chosen["ngram" if use_ngram else "head"] += 1
            out.append(g if use_ngram else h)
        return out
