"""The feature head and the n-gram lookup behind one draft (`--draft PATH+ngram`).

Per request and step, the n-gram's tree when its best match is long (a verbatim copy the head
would have to predict token by token), else the head's: the n-gram's confidence of its first
token is the length-weighted share of its matches (services/draft/ngram.py), 0.9 from a match of
9 tokens on, where its first proposed token was right 93-98% of the time. The choice depends on
the context alone (never on what the head sampled), so the proposal's q stays exact. The n-gram
decides first: on its steps the head drafts nothing and only holds the target's states, which it
reads in one forward at its next draft (a long verbatim match may plan k = 16, which the head
would otherwise draft level by level for nothing).
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
        grams = self.ngram.propose(items)
        long = [max((c for c, p in zip(g.confidence, g.parents) if p < 0), default=0.0) >= self.long_match
                for g in grams]
        self.head.hold([it for it, use in zip(items, long) if use])
        heads = iter(self.head.propose([it for it, use in zip(items, long) if not use]))
        out = []
        for g, use in zip(grams, long):
            h = None if use else next(heads)
            use_ngram = h is None or not len(h)
            self.chosen["ngram" if use_ngram else "head"] += 1
            out.append(g if use_ngram else h)
        return out
