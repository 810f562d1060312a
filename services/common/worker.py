"""What the draft and verifier servicers share: the per-request token ledger and random streams,
one model thread, the long-lived step stream from each scheduler, and the worker's metrics and
per-request trace spans (opened from an item's `traceparent`, ended on release).

All of a worker's torch work runs on its one model thread, loading included (`model_thread`,
`on_model_thread`). Each thread that runs torch's OpenMP-parallel ops gets a thread team of its
own, and once a process has more OpenMP threads than cores, libgomp throttles their spin-wait, so
each of a forward's few hundred parallel regions wakes sleeping threads: a model loaded (and its
matmul routes timed) on the main thread and run on another verified a 5-token chain of the
default model in 22.5 ms instead of 17.7 ms on a 2-core machine.

Bad input on a step stream (unknown shapes, token ids outside the vocabulary, duplicate request
ids in one step, trees that break their invariants) raises ValueError in the step function, which
the stream answers with INVALID_ARGUMENT; anything else that escapes a step is logged and answered
with INTERNAL; bytes that do not parse as a step message (invalid UTF-8 in a string field) with
INVALID_ARGUMENT too. Either way the stream ends and the requests it carried are freed."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from google.protobuf.message import DecodeError

from services.common.ledger import TokenLedger
from services.common.metrics import Registry, WorkerMetrics
from services.common.sampling import SamplingParams, make_generator
from services.common.tracing import RequestSpans
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)


def model_thread(role: str) -> ThreadPoolExecutor:
    """The one thread a worker runs its model on (load, steps, releases)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=role)


async def on_model_thread(executor: ThreadPoolExecutor, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on the model thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))


class StepWorker:
    def __init__(self, info: common_pb2.InfoResponse, random_stream: int,
                 release_state: Callable[[str], None], cache_bytes: Callable[[], int],
                 metrics: WorkerMetrics | None = None, executor: ThreadPoolExecutor | None = None,
                 inline: bool = False):
        self.info = info
        self.random_stream = random_stream  # 0: draft, 1: verifier (as in the in-process engine)
        self.ledger = TokenLedger(info.vocab_size, info.max_positions)
        self.generators: dict[str, torch.Generator] = {}
        self._release_state = release_state
        self._cache_bytes = cache_bytes
        # The model runs on one thread (the one it was loaded on, see above): steps from several
        # schedulers queue here, and the event loop stays free for health checks and new streams.
        self.executor = executor or model_thread(info.role)
        # inline: steps run on the event loop itself, for a worker with no model (the n-gram
        # draft): its lookup takes ~0.1 ms, less than handing each step to the model thread and
        # back (the single stream through the services ran 2-3% faster inline on 2 cores).
        self.inline = inline
        self.steps = 0
        self.max_batch = 0
        self.metrics = metrics or WorkerMetrics(Registry(info.role))
        self.spans = RequestSpans(f"specserve.{info.role}")

    def generator(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = self.generators.get(req_id)
        if gen is None:
            gen = self.generators[req_id] = make_generator(params.seed, self.random_stream)
        return gen

    def release(self, req_id: str) -> None:
        self.ledger.release(req_id)
        self.generators.pop(req_id, None)
        self._release_state(req_id)
        self.spans.end(req_id)

    def trace(self, req_id: str, traceparent: str) -> None:
        """Open the request's span under the scheduler's (the first time it comes with one)."""
        self.spans.start_remote(req_id, f"{self.info.role}.request", traceparent)

    def count_step(self, batch: int, started: float | None = None,
                   step_attributes: dict[str, dict] | None = None) -> None:
        """Account one step message that began at `started` (perf_counter): metrics, and a step
        span under each traced request's span with its `step_attributes[request id]`."""
        ended = time.perf_counter()
        self.steps += 1
        self.max_batch = max(self.max_batch, batch)
        if started is not None:
            self.metrics.record_step(ended - started, batch)
        self.record_state()
        if self.spans.spans and started is not None:
            for rid, attributes in (step_attributes or {}).items():
                self.spans.step(rid, f"{self.info.role}.step", started, ended, attributes)

    async def serve_stream(self, request_iterator, context: grpc.aio.ServicerContext, step_fn):
        """Answer each step message in order; free every request of a stream that ends."""
        loop = asyncio.get_running_loop()
        seen: set[str] = set()
        try:
            async for step in request_iterator:
                items = {item.request_id for item in step.items}
                seen.update(items)
                try:
                    if self.inline:
                        result = _checked_step(step_fn, step)
                    else:
                        result = await loop.run_in_executor(self.executor, _checked_step, step_fn, step)
                except ValueError as e:  # the stream ends: `seen` (this step's releases too) is freed
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception:
                    log.exception("%s step %d failed", self.info.role, step.step_id)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{self.info.role} step failed")
                # The step freed its releases before it ran its items: an id in both stays held.
                seen.difference_update(set(step.release) - items)
                yield result
        except DecodeError as e:  # raised by the request iterator: bytes that are no step message
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a step message does not parse: {e}")
        finally:
            if seen:
                # Queued on the model thread, after any step still running, and not awaited: an
                # awaited job could itself be cancelled (the handler may be cancelled again while
                # it waits), and a cancelled job that has not started never frees anything.
                # An inline worker frees them here, on the loop that runs its steps.
                log.info("scheduler stream closed: freeing %d requests", len(seen))
                if self.inline:
                    self._release_all(sorted(seen))
                else:
                    self.executor.submit(self._release_all, sorted(seen))

    def _release_all(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.release(rid)
        self.record_state()

    def record_state(self) -> None:
        """Update the state gauges (on the model thread, which owns the caches)."""
        self.metrics.record_state(len(self.ledger.ids()), self._cache_bytes())

    def state(self) -> common_pb2.StateResponse:
        return common_pb2.StateResponse(request_ids=self.ledger.ids(), steps=self.steps,
                                        max_batch_seen=self.max_batch, kv_cache_bytes=self._cache_bytes())


def check_step(step) -> None:
    """Raise ValueError when a step message (ProposeStep or VerifyStep) names a request twice:
    its items would share one cache and ledger entry within one forward."""
    seen: set[str] = set()
    for item in step.items:
        if item.request_id in seen:
            raise ValueError(f"request id {item.request_id!r} appears more than once in step {step.step_id}")
        seen.add(item.request_id)


def _checked_step(step_fn, step):
    check_step(step)
    return step_fn(step)
