"""What the draft and verifier servicers share: the per-request token ledger and random streams,
one model thread, the long-lived step stream from each scheduler, and the worker's metrics and
per-request trace spans (opened from an item's `traceparent`, ended on release)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from services.common.ledger import TokenLedger
from services.common.metrics import Registry, WorkerMetrics
from services.common.sampling import SamplingParams, make_generator
from services.common.tracing import RequestSpans
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)


class StepWorker:
    def __init__(self, info: common_pb2.InfoResponse, random_stream: int,
                 release_state: Callable[[str], None], cache_bytes: Callable[[], int],
                 metrics: WorkerMetrics | None = None):
        self.info = info
        self.random_stream = random_stream  # 0: draft, 1: verifier (as in the in-process engine)
        self.ledger = TokenLedger()
        self.generators: dict[str, torch.Generator] = {}
        self._release_state = release_state
        self._cache_bytes = cache_bytes
        # The model runs on one thread: steps from several schedulers queue here, and the event
        # loop stays free for health checks and new streams.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=info.role)
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
                seen.update(item.request_id for item in step.items)
                seen.difference_update(step.release)
                try:
                    result = await loop.run_in_executor(self.executor, step_fn, step)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                yield result
        finally:
            if seen:
                log.info("scheduler stream closed: freeing %d requests", len(seen))
            for rid in seen:
                await loop.run_in_executor(self.executor, self.release, rid)
            if seen:
                await loop.run_in_executor(self.executor, self.record_state)

    def record_state(self) -> None:
        """Update the state gauges (on the model thread, which owns the caches)."""
        self.metrics.record_state(len(self.ledger.ids()), self._cache_bytes())

    def state(self) -> common_pb2.StateResponse:
        return common_pb2.StateResponse(request_ids=self.ledger.ids(), steps=self.steps,
                                        max_batch_seen=self.max_batch, kv_cache_bytes=self._cache_bytes())
