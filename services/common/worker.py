"""What the draft and verifier servicers share: the per-request token ledger and random streams,
one model thread, and the long-lived step stream from each scheduler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from services.common.ledger import TokenLedger
from services.common.sampling import SamplingParams, make_generator
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)


class StepWorker:
    def __init__(self, info: common_pb2.InfoResponse, random_stream: int,
                 release_state: Callable[[str], None], cache_bytes: Callable[[], int]):
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

    def count_step(self, batch: int) -> None:
        self.steps += 1
        self.max_batch = max(self.max_batch, batch)

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

    def state(self) -> common_pb2.StateResponse:
        return common_pb2.StateResponse(request_ids=self.ledger.ids(), steps=self.steps,
                                        max_batch_seen=self.max_batch, kv_cache_bytes=self._cache_bytes())
