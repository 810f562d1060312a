"""The feature head and the n-gram lookup behind one draft (`--draft PATH+ngram`).

Per request and step:
- the n-gram's tree alone when its matches agree (a copy the head would have to predict token by
  token): its first-token confidence is the length-weighted share of its matches
  (services/draft/ngram.py), at least 0.67 for one match of the 2 tokens it needs, lower only
  where matches disagree. The head then drafts nothing and only holds the target's states, which
  it reads in one forward at its next draft. Taking the n-gram alone only from 0.9 (a match of 9
  tokens) on ran 2-4% slower: the head's draft and its rows cost more than the tokens it adds
  beside a match (BENCHMARKS.md, "The hybrid on an AMD EPYC");
- else, for a greedy request, one tree holding both (`union`): the nodes of either whose path
  confidence is highest, within the step's node budget, so matches that disagree still draft
  and the trim prices every node the same way;
- else (sampling) the head's tree, or the n-gram's where the head has none: a sampled node's q
  must be the distribution it was drawn from, which a second source's sibling would break.
Every choice depends on the context alone (never on what the head sampled), so q stays exact.
"""

from __future__ import annotations

from services.common.tree import DraftTree
from services.draft.head_proposer import HeadProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import ProposeItem, Proposer

LONG_MATCH = 0.6  # the n-gram's first-token confidence from which its tree is used alone


def union(a: DraftTree, b: DraftTree, budget: int) -> DraftTree:
    """Greedy trees a and b (point-mass q, a confidence per node) as one tree of at most `budget`
    nodes: a node both propose gets the chance that either is right, 1 - (1 - c_a)(1 - c_b) (two
    drafts that agree pass more often than either alone says), and the nodes kept are those of the
    largest path confidence (the product along the path: the tokens they are expected to add;
    a parent's is never below its child's, so the kept set is closed under parents), siblings in
    descending order of it (the order the trim keeps them in)."""
    conf, kids = {}, {(): []}  # per path (tuple of tokens): confidence; children's paths
    for tree in (a, b):
        paths: list[tuple[int, ...]] = []
        for tok, parent, c in zip(tree.tokens, tree.parents, tree.confidence):
            path = (paths[parent] if parent >= 0 else ()) + (tok,)
            paths.append(path)
            if path not in conf:
                kids[path[:-1]].append(path)
                kids[path] = []
            conf[path] = 1.0 - (1.0 - conf.get(path, 0.0)) * (1.0 - float(c))
    value = {(): 1.0}
    for path in conf:  # added parents first (each tree's are, and b's nodes under a's follow a's)
        value[path] = value[path[:-1]] * conf[path]
    kept = set(sorted(conf, key=lambda p: (-value[p], len(p)))[:budget])
    out, index, level = DraftTree(), {(): -1}, [()]
    while level:  # breadth first: parents before children
        nxt = []
        for parent in level:
            for path in sorted((p for p in kids[parent] if p in kept), key=lambda p: -value[p]):
                index[path] = out.add(path[-1], index[parent], [path[-1]], [1.0])
                out.confidence.append(conf[path])
                nxt.append(path)
        level = nxt
    return out


class HybridProposer(Proposer):
    name = "head+ngram"

    def __init__(self, head: HeadProposer, ngram: NgramProposer | None = None, long_match: float = LONG_MATCH):
        self.head, self.ngram = head, ngram or NgramProposer()
        self.long_match = long_match
        self.feature_layers, self.max_positions = head.feature_layers, head.max_positions
        self.chosen = {"head": 0, "ngram": 0, "both": 0}  # trees proposed by each, for tests and logs

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        grams = self.ngram.propose(items)
        long = [max((c for c, p in zip(g.confidence, g.parents) if p < 0), default=0.0) >= self.long_match
                for g in grams]
        self.head.hold([it for it, use in zip(items, long) if use])
        heads = iter(self.head.propose([it for it, use in zip(items, long) if not use]))
        out = []
        for it, g, use in zip(items, grams, long):
            h = None if use else next(heads)
            if h is None or not len(h):
                choice, tree = "ngram", g
            elif len(g) and it.seq.params.greedy:  # both carry a confidence per node
                choice, tree = "both", union(h, g, it.tree_size)
            else:
                choice, tree = "head", h
            self.chosen[choice] += 1
            out.append(tree)
        return out
