"""N-gram (prompt lookup) proposer: no weights; proposes what followed earlier occurrences of the
request's last n tokens (n <= max_ngram), longest match first: a match's length is how far back
the context agrees with the request's end, beyond n (capped at MAX_MATCH_LENGTH), and the most
recent occurrence comes first among equals.

Several distinct continuations are merged into a trie, so one lookup can propose a tree. Each
node's proposal is deterministic, so its q is a point mass on the node's token: exact for the
verifier's rejection sampling, which stays lossless however poor the guess.

Each node also carries a confidence for the scheduler's trimming (services/scheduler/trim.py,
never used by the acceptance math): the support of the matches through it over all the matches
found plus one, each match weighted by its length. One 1-gram match gives 0.5, one match of 3
tokens 0.75, of 20 tokens 0.95; disagreeing matches split it. The length matters: on the draft's
training prompts (not Spec-Bench) the first proposed token was right 14-25% of the time after a
1-token match, 40-83% after 2-9 tokens and 93-98% after 10 or more, where 5-7 of 8 proposed
tokens were accepted on average.

A match needs the last 2 tokens by default (`min_ngram`): what a 1-token match proposes is rarely
right, and every step the scheduler plans and drafts for one costs its Python, so asking only
where 2 tokens recur ran faster (BENCHMARKS.md, "The n-gram's shortest match").
"""

from __future__ import annotations

import numpy as np

from services.common.tree import MAX_TREE_NODES, DraftTree
from services.draft.proposer import ProposeItem, Proposer

MAX_MATCH_LENGTH = 32  # how far back a match's length is counted
DEFAULT_MIN_NGRAM = 2  # the fewest tokens that make a match


class NgramProposer(Proposer):
    name = "ngram"
    runs_model = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = DEFAULT_MIN_NGRAM, max_continuations: int = 8,
                 max_matches: int = 32):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.min_match = min_ngram  # no occurrence of the last min_ngram tokens: no match at all
        self.max_continuations, self.max_matches = max_continuations, max_matches

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        return [self.tree(it.seq.tokens, it.draft_length, it.tree_size) for it in items]

    def matches(self, tokens: list[int], length: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to max_matches (continuation of at most `length` tokens, match length) for the
        earlier occurrences of the last n tokens, longest match and most recent first; a position
        is counted once, at its longest n."""
        arr = np.asarray(tokens, dtype=np.int64)
        found: list[tuple[tuple[int, ...], int]] = []
        taken: set[int] = set()  # continuation starts already matched by a longer n
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            pattern = arr[-n:]
            starts = np.nonzero(arr[: len(arr) - n] == pattern[0])[0]  # candidate match starts
            for j in range(1, n):
                starts = starts[arr[starts + j] == pattern[j]]
            starts = starts[::-1]  # most recent first
            # Only a match of the longest n can extend further back (a shorter one that could would
            # have matched at n + 1); stable sort, so recency breaks ties.
            lengths = self._extend(arr, starts, n) if n == self.max_ngram else np.full(len(starts), n)
            for i in np.argsort(-lengths, kind="stable"):
                s = int(starts[i])
                cont = tuple(arr[s + n : s + n + length].tolist())
                if cont and s + n not in taken:
                    taken.add(s + n)
                    found.append((cont, int(lengths[i])))
                    if len(found) >= self.max_matches:
                        return found
        return found

    @staticmethod
    def _extend(arr: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
        """Match length of each n-gram occurrence starting at `starts`: n plus how many tokens
        before it agree with those before the request's last n (up to MAX_MATCH_LENGTH). One
        [occurrences, offsets] comparison: a numpy call per offset was most of a lookup."""
        end = len(arr) - n  # where the request's last n tokens start
        span = min(MAX_MATCH_LENGTH - n, end)
        if span <= 0 or not len(starts):
            return np.full(len(starts), n)
        j = np.arange(1, span + 1)
        before = starts[:, None] - j[None, :]  # [occurrences, span]: the token j before each occurrence
        same = (before >= 0) & (arr[np.maximum(before, 0)] == arr[end - j][None, :])
        return n + np.cumprod(same, axis=1).sum(axis=1)  # agreeing offsets before the first that is not

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
        support = [0.0] * len(tree)  # matches through each node, weighted by their length
        for cont, length in matches:
            node = -1
            for tok in cont:
                node = child_of.get((node, tok), -2)
                if node < 0:
                    break
                support[node] += length
        total = 1.0 + sum(length for _, length in matches)
        tree.confidence = [s / total for s in support]
        return tree
