"""The proposer interface: whatever proposes draft trees (a draft model, an n-gram lookup)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.common.constraint import Constraints
from services.common.hidden_states import HiddenStates
from services.common.sequence import Sequence
from services.common.tree import DraftTree
from services.common.worker import StepWork, WorkItem


@dataclass
class ProposeItem:
    seq: Sequence  # the request: committed tokens, parameters, random stream, the draft's KV cache
    draft_length: int  # maximum tree depth k; 0 = no speculation this step
    tree_size: int  # node budget; equal to draft_length = a chain
    states: list[HiddenStates] = field(default_factory=list)  # the target's states sent since the last step


class Proposer(ABC):
    """Proposes one draft tree per request per step. What it keeps per request lives in the
    request's sequence (its cache, `scratch`), rebuilt from the committed tokens when missing or
    stale, and freed with it."""

    name = "proposer"
    max_positions: int | None = None  # the draft's context, when it has one
    feature_layers: tuple[int, ...] = ()  # a feature-level draft: the target layers whose states it reads
    runs_model = True  # False: no torch work (a draft service then steps it on its event loop)
    # A lookup draft proposes nothing unless a request's last this many tokens occurred earlier in
    # it (the scheduler then skips the call); 0: it may propose after any tokens.
    min_match = 0

    @abstractmethod
    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        """One tree per item (empty when item.draft_length == 0)."""

    def prefill(self, seqs: list[Sequence], others: list[Sequence]) -> None:
        """Take in a chunk of each sequence's prompt (chunked prefill; the sequence holds the
        prompt so far); `others`: every sequence of the step (a new one may copy the prefix one
        of them holds). A proposer without a cache to fill has nothing to do."""


class ProposeWork(StepWork):
    """A draft worker's step: one tree per item from its proposer (none asked: an empty tree).
    With `constraints`, a request with a grammar has its matcher in `seq.constraint` (a model
    draft draws from its grammar-masked distribution: tree_growth.py), its tree loses the nodes
    the verifier would reject for the grammar alone, and its first path goes on with the tokens
    the grammar forces, down to the step's depth (services/common/constraint.py)."""

    def __init__(self, proposer: Proposer, constraints: Constraints | None = None):
        self.proposer = proposer
        self.constraints = constraints
        self.runs_model = proposer.runs_model

    def run(self, work: list[tuple[Sequence, WorkItem]]) -> list[DraftTree]:
        chunks = [seq for seq, it in work if it.prefill]
        if chunks:
            self.proposer.prefill(chunks, [seq for seq, _ in work])
        if self.constraints is not None:  # a grammar's matcher at the committed tokens, for the proposer too
            for seq, it in work:
                if it.draft_length > 0 and seq.params.grammar is not None:
                    self.constraints.of(seq)
        asked = [ProposeItem(seq, it.draft_length, it.tree_size, it.states) for seq, it in work if it.draft_length > 0]
        trees = iter(self.proposer.propose(asked) if asked else [])
        return [self._constrained(seq, next(trees), it.draft_length) if it.draft_length > 0 else DraftTree()
                for seq, it in work]

    def _constrained(self, seq: Sequence, tree: DraftTree, depth: int) -> DraftTree:
        if self.constraints is None or seq.params.grammar is None:
            return tree
        return seq.constraint.extend_forced(seq.constraint.prune(tree, seq.params.greedy), depth)

    def tokens(self, work, results) -> int:
        return sum(len(t) for t in results if t is not None)

    def span_attributes(self, item: WorkItem, result: DraftTree | None) -> dict:
        return {"specserve.draft_length": item.draft_length, "specserve.tree_size": item.tree_size,
                "specserve.tree_nodes": len(result) if result is not None else 0}
