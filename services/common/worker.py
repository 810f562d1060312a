"""A worker's side of the step protocol, without protobuf: the draft and the verifier alike.

A `StepWorker` holds the worker's sequences (services/common/sequence.py), runs one step (free the
released requests, bring each item's sequence up to date, one call of its `StepWork` for every
item: the draft proposes, the verifier verifies), and keeps the worker's metrics and per-request
trace spans (opened from an item's `traceparent`, ended on release). The gRPC servicer
(services/common/step_servicer.py) and the scheduler's in-process workers
(services/scheduler/workers.py) both call `StepWorker.step`, so a request meets the same state,
random streams and checks in-process and across the services.

All of a worker's torch work runs on its one model thread, loading included (`model_thread`,
`on_model_thread`). Each thread that runs torch's OpenMP-parallel ops gets a thread team of its
own, and once a process has more OpenMP threads than cores, libgomp throttles their spin-wait, so
each of a forward's few hundred parallel regions wakes sleeping threads: a model loaded (and its
matmul routes timed) on the main thread and run on another verified a 5-token chain of the
default model in 22.5 ms instead of 17.7 ms on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.common.hidden_states import HiddenStates
from services.common.metrics import Registry, WorkerMetrics
from services.common.sampling import SamplingParams
from services.common.sequence import Sequence, Sequences
from services.common.tracing import RequestSpans
from services.common.tree import DraftTree
from specserve.v1 import common_pb2


def model_thread(role: str) -> ThreadPoolExecutor:
    """The one thread a worker runs its model on (load, steps, releases)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=role)


async def on_model_thread(executor: ThreadPoolExecutor, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on the model thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))


@dataclass
class WorkItem:
    """One request's part of a step message to a worker."""

    req_id: str
    offset: int  # committed tokens the worker already has
    tokens: list[int]  # the committed tokens from `offset` on
    params: SamplingParams | None = None  # sent with the request's first item to a worker (offset 0)
    draft_length: int = 0  # the draft's depth k and node budget this step
    tree_size: int = 0
    tree: DraftTree | None = None  # the verifier's tree to verify
    traceparent: str = ""  # the scheduler's span of the request, with its first item to a worker
    state_layers: tuple[int, ...] = ()  # verifier: return the states of these target layers
    states: list[HiddenStates] = field(default_factory=list)  # draft: the target's states since the last item
    prefill: bool = False  # a prompt chunk short of its end: cache it; verify or propose nothing


@dataclass
class StepOutput:
    results: list  # per item: its DraftTree or Verdict, None when the worker needs a resync
    compute_ms: float
    batch: int  # items computed
    tokens: int  # tokens the model worked on (tree nodes proposed, rows verified)


class StepWork(ABC):
    """What a worker does with one step's up-to-date items: propose trees or verify them."""

    runs_model = True  # False: no torch work (the n-gram), so a service steps it on its event loop

    @abstractmethod
    def run(self, work: list[tuple[Sequence, WorkItem]]) -> list:
        """One result per item, in order."""

    @abstractmethod
    def tokens(self, work: list[tuple[Sequence, WorkItem]], results: list) -> int:
        """Tokens the model worked on, for the step's timing."""

    @abstractmethod
    def span_attributes(self, item: WorkItem, result) -> dict:
        """A traced request's step span attributes (result None: a resync)."""


class StepWorker:
    def __init__(self, info: common_pb2.InfoResponse, random_stream: int, work: StepWork,
                 metrics: WorkerMetrics | None = None, executor: ThreadPoolExecutor | None = None):
        self.info = info
        self.work = work
        self.sequences = Sequences(random_stream, info.vocab_size, info.max_positions)
        # The model runs on one thread (the one it was loaded on, see above): steps from several
        # schedulers queue here, and the event loop stays free for health checks and new streams.
        self.executor = executor or model_thread(info.role)
        self.steps = 0
        self.max_batch = 0
        self.metrics = metrics or WorkerMetrics(Registry(info.role))
        self.spans = RequestSpans(f"specserve.{info.role}")

    def step(self, step_id: int, release: list[str], items: list[WorkItem]) -> StepOutput:
        """Free `release` (before the items: an id in both starts afresh), then run the items.
        Raises ValueError, changing nothing of the items, when one cannot be taken."""
        started = time.perf_counter()
        check_items(step_id, items)
        for rid in release:
            self.release(rid)
        for it in items:  # a traced request's span opens under the scheduler's, the first time
            self.spans.start_remote(it.req_id, f"{self.info.role}.request", it.traceparent)
        seqs = [self.sequences.update(it.req_id, it.offset, it.tokens, it.params) for it in items]
        work = [(seq, it) for seq, it in zip(seqs, items) if seq is not None]
        computed = iter(self.work.run(work) if work else [])
        results = [next(computed) if seq is not None else None for seq in seqs]
        ended = time.perf_counter()
        self._account(step_id, items, results, started, ended)
        return StepOutput(results, (ended - started) * 1e3, len(work), self.work.tokens(work, results))

    def _account(self, step_id: int, items: list[WorkItem], results: list, started: float, ended: float) -> None:
        """Metrics, and a step span under each traced request's span."""
        self.steps += 1
        batch = sum(r is not None for r in results)
        self.max_batch = max(self.max_batch, batch)
        self.metrics.record_step(ended - started, batch)
        self.record_state()
        for it, res in zip(items, results):
            if it.req_id in self.spans.spans:
                attributes = {"specserve.step_id": step_id, "specserve.batch_size": batch,
                              "specserve.need_resync": res is None, **self.work.span_attributes(it, res)}
                self.spans.step(it.req_id, f"{self.info.role}.step", started, ended, attributes)

    def release(self, req_id: str) -> None:
        self.sequences.release(req_id)
        self.spans.end(req_id)

    def release_all(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.release(rid)
        self.record_state()

    def record_state(self) -> None:
        """Update the state gauges (on the model thread, which owns the caches)."""
        self.metrics.record_state(len(self.sequences.ids()), self.sequences.nbytes())

    def state(self) -> common_pb2.StateResponse:
        return common_pb2.StateResponse(request_ids=self.sequences.ids(), steps=self.steps,
                                        max_batch_seen=self.max_batch, kv_cache_bytes=self.sequences.nbytes())


def check_items(step_id: int, items: list[WorkItem]) -> None:
    """Raise ValueError when a step names a request twice: its items would share one sequence
    within one forward."""
    seen: set[str] = set()
    for it in items:
        if it.req_id in seen:
            raise ValueError(f"request id {it.req_id!r} appears more than once in step {step_id}")
        seen.add(it.req_id)
