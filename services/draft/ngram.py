"""N-gram (prompt lookup) proposer: no weights; proposes what followed earlier occurrences of the
request's last n tokens, longest n and most recent occurrence first.

Several distinct continuations are merged into a trie, so one lookup can propose a tree. Each
node's proposal is deterministic, so its q is a point mass on the node's token: exact for the
verifier's rejection sampling, which stays lossless however poor the guess.

Each node also carries a confidence for the scheduler's trimming (services/scheduler/trim.py,
never used by the acceptance math): the support of the matches through it over all the matches
found plus one, each match weighted by its length n. One 1-gram match gives 0.5, one 3-gram match
0.75, two agreeing 3-gram matches 0.86; disagreeing matches split it.
"""

from __future__ import annotations

import numpy as np

from services.common.tree import MAX_TREE_NODES, DraftTree
from services.draft.proposer import ProposeItem, Proposer


class NgramProposer(Proposer):
    name = "ngram"
    runs_model = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_continuations: int = 8,
                 max_matches: int = 32):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_continuations, self.max_matches = max_continuations, max_matches

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        return [self.tree(it.tokens, it.draft_length, it.tree_size) for it in items]

    def matches(self, tokens: list[int], length: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to max_matches (continuation of at most `length` tokens, n) for the earlier
        occurrences of the last n tokens, longest n and most recent first; a position is counted
        once, at its longest match."""
        arr = np.asarray(tokens, dtype=np.int64)
        found: list[tuple[tuple[int, ...], int]] = []
        taken: set[int] = set()  # continuation starts already matched by a longer n
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            pattern = arr[-n:]
            starts = np.nonzero(arr[: len(arr) - n] == pattern[0])[0]  # candidate match starts
            for j in range(1, n):
                starts = starts[arr[starts + j] == pattern[j]]
            for s in starts[::-1]:  # most recent first
                cont = tuple(arr[s + n : s + n + length].tolist())
                if cont and s + n not in taken:
                    taken.add(s + n)
                    found.append((cont, n))
                    if len(found) >= self.max_matches:
                        return found
        return found

    def continuations(self, tokens: list[int], length: int) -> list[list[int]]:
        """Up to max_continuations distinct token lists of at most `length` tokens, best first."""
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for cont, _ in self.matches(tokens, length):
            if cont not in seen:
                seen.add(cont)
                found.append(list(cont))
                if len(found) >= self.max_continuations:
                    break
        return found

    def tree(self, tokens: list[int], draft_length: int, tree_size: int) -> DraftTree:
        tree = DraftTree()
        budget = min(tree_size, MAX_TREE_NODES)
        if draft_length <= 0 or budget <= 0 or len(tokens) < 2:
            return tree
        matches = self.matches(tokens, draft_length)
        child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        distinct = 0
        for cont in dict.fromkeys(c for c, _ in matches):  # distinct continuations, best first
            if distinct >= self.max_continuations:
                break
            distinct += 1
            node = -1
            for tok in cont:
                nxt = child_of.get((node, tok))
                if nxt is None:
                    if len(tree) >= budget:
                        break
                    nxt = tree.add(tok, node, [tok], [1.0])
                    child_of[(node, tok)] = nxt
                node = nxt
            if len(tree) >= budget:
                break
        support = [0.0] * len(tree)  # length-weighted matches through each node
        for cont, n in matches:
            node = -1
            for tok in cont:
                node = child_of.get((node, tok), -2)
                if node < 0:
                    break
                support[node] += n
        total = 1.0 + sum(n for _, n in matches)
        tree.confidence = [s / total for s in support]
        return tree
