"""The workers as the step sees them: one interface for the draft and the verifier, in this
process (`LocalWorkers`: the worker's `StepWorker` called directly) or over gRPC
(services/scheduler/replicas.py: `RemoteWorkers`, the step streams to replicas).

Either way a request's first item to a worker carries all its committed tokens and its sampling
parameters (offset 0), later items only the tokens committed since; a worker that answers
`need_resync` (None) is sent everything again at the next step.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.common.hidden_states import HiddenStates
from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.common.worker import StepWorker, WorkItem

log = logging.getLogger(__name__)


@dataclass
class Work:
    """One request's part of a step, for one kind of worker."""

    req_id: str
    tokens: list[int]  # every committed token of the request
    params: SamplingParams
    draft_length: int = 0  # the draft's depth and node budget this step
    tree_size: int = 0
    tree: DraftTree | None = None  # the tree to verify
    state_layers: tuple[int, ...] = ()  # verifier: return the states of these layers
    states: list[HiddenStates] = field(default_factory=list)  # draft: the target's states since last sent
    prefill: bool = False  # `tokens` is a prompt's prefix, to cache without verifying or proposing
    near: str = ""  # a request whose replica this one joins when it has none yet (it shares its prompt)


@dataclass
class Reply:
    """What one kind of worker answered for a step's work."""

    results: dict[str, object] = field(default_factory=dict)  # request id -> DraftTree or Verdict
    fresh: set[str] = field(default_factory=set)  # requests sent from their first token (a prefill)
    unplaced: list[str] = field(default_factory=list)  # requests no live worker could take
    compute_ms: float = 0.0  # the slowest worker's own time for the step


class Workers(ABC):
    kind: str  # "draft" or "verifier"
    max_positions: int | None = None  # a draft's context, when it has one: it stops drafting there
    feature_layers: tuple[int, ...] = ()  # a feature-level draft: the target layers it reads
    min_match: int = 0  # a lookup draft: it proposes only where a request's last this many tokens recur

    @abstractmethod
    async def step(self, step_id: int, works: list[Work]) -> Reply:
        """Send every request's work; a request missing from the reply got no result this step
        (its worker failed or needs a resync)."""

    @abstractmethod
    def release(self, req_id: str) -> None:
        """Forget a finished request (remote workers free it with their next message)."""

    async def flush(self) -> None:
        """Deliver the releases still pending (when no step is coming to carry them)."""

    async def serving(self) -> bool:
        """Whether a worker can take steps (readiness)."""
        return True

    async def close(self) -> None:
        pass


def work_item(w: Work, offset: int, traceparent: str = "") -> WorkItem:
    """The item for a worker that has the first `offset` committed tokens of the request."""
    return WorkItem(w.req_id, offset, w.tokens[offset:], w.params if offset == 0 else None,
                    w.draft_length, w.tree_size, w.tree, traceparent, w.state_layers, w.states, w.prefill)


def collect(reply: Reply, sent: dict[str, int], works: list[Work], items: list[WorkItem], results: list) -> None:
    """Add one worker's results to the reply and remember what it now has (None: a resync)."""
    for w, it, res in zip(works, items, results):
        if it.offset == 0:
            reply.fresh.add(w.req_id)
        if res is None:
            sent[w.req_id] = 0
        else:
            sent[w.req_id] = len(w.tokens)
            reply.results[w.req_id] = res


class LocalWorkers(Workers):
    """A worker in this process, stepped on the caller's thread. `contain_errors`: a failed step is
    logged and costs its results (and the worker's state), as a broken stream would (the scheduler's
    own n-gram draft and target); otherwise it raises (the in-process engine)."""

    def __init__(self, kind: str, worker: StepWorker, max_positions: int | None = None,
                 contain_errors: bool = False, feature_layers: tuple[int, ...] = (), min_match: int = 0):
        self.kind, self.worker, self.max_positions = kind, worker, max_positions
        self.feature_layers, self.min_match = tuple(feature_layers), min_match
        self.contain_errors = contain_errors
        self.sent: dict[str, int] = {}  # request id -> committed tokens the worker has

    async def step(self, step_id: int, works: list[Work]) -> Reply:
        items = [work_item(w, self.sent.get(w.req_id, 0)) for w in works]
        reply = Reply()
        try:
            out = self.worker.step(step_id, [], items)
        except Exception:
            if not self.contain_errors:
                raise
            log.exception("in-process %s step %d failed", self.kind, step_id)
            self.worker.release_all(self.worker.sequences.ids())
            self.sent.clear()
            return reply
        collect(reply, self.sent, works, items, out.results)
        reply.compute_ms = out.compute_ms
        return reply

    def release(self, req_id: str) -> None:
        self.sent.pop(req_id, None)
        self.worker.release(req_id)
