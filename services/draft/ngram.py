"""N-gram (prompt lookup) proposer: no weights; proposes what followed earlier occurrences of the
request's last n tokens, longest n and most recent occurrence first.

Several distinct continuations are merged into a trie, so one lookup can propose a tree. Each
node's proposal is deterministic, so its q is a point mass on the node's token: exact for the
verifier's rejection sampling, which stays lossless however poor the guess.
"""

from __future__ import annotations

import numpy as np

from services.common.tree import DraftTree
from services.draft.proposer import ProposeItem, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_continuations: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_continuations = max_continuations

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        return [self.tree(it.tokens, it.draft_length, it.tree_size) for it in items]

    def continuations(self, tokens: list[int], length: int) -> list[list[int]]:
        """Up to max_continuations token lists of at most `length` tokens, best first."""
        arr = np.asarray(tokens, dtype=np.int64)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            pattern = arr[-n:]
            starts = np.nonzero(arr[: len(arr) - n] == pattern[0])[0]  # candidate match starts
            for j in range(1, n):
                starts = starts[arr[starts + j] == pattern[j]]
            for s in starts[::-1]:  # most recent first
                cont = tuple(arr[s + n : s + n + length].tolist())
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(list(cont))
                    if len(found) >= self.max_continuations:
                        return found
        return found

    def tree(self, tokens: list[int], draft_length: int, tree_size: int) -> DraftTree:
        tree = DraftTree()
        budget = min(tree_size, 256)
        if draft_length <= 0 or budget <= 0 or len(tokens) < 2:
            return tree
        child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for cont in self.continuations(tokens, draft_length):
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
        return tree
