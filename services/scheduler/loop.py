"""The scheduler service's driver of the step (core.py): steps while requests run, streams each
request's committed tokens to its Generate call as events, drains on shutdown.

The draft and verifier are remote replicas (replicas.py) or this process (workers.py:
LocalWorkers, the n-gram draft and the target with `local`); either way the step is the
in-process engine's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

from services.common import codec
from services.common.metrics import SchedulerMetrics
from services.common.sampling import SamplingParams
from services.common.tracing import RequestSpans
from services.scheduler.core import StepCore
from services.scheduler.request import Request

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.1  # the pause between steps while every running request waits for a verifier
MAX_N = 16  # samples of one prompt a request may ask for


@dataclass
class Live:
    """A request plus what its client has been sent; the n samples of one call share `events`
    (each event names its sample's `index`)."""

    req: Request
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    emitted_chars: int = 0
    index: int = 0


class SchedulerLoop:
    def __init__(self, core: StepCore, metrics: SchedulerMetrics, spans: RequestSpans):
        """`metrics` and `spans` are the ones the core's observers and workers were given; the
        servicer times and traces each request with them."""
        self.core, self.metrics, self.spans = core, metrics, spans
        self.lives: dict[str, Live] = {}
        self.wake = asyncio.Event()
        self.accepting = True

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams, draft_length: int | None = None,
               tree_size: int | None = None, request_class: str = "default", n: int = 1) -> list[Live]:
        """Queue a request's n samples (n > 1: ids `req_id#i`, seeds seed + i, the later ones
        following the first: core.submit); raises ValueError for bad input, Overloaded when the
        queue is full, RuntimeError when shutting down (and queues none of them)."""
        if not self.accepting:
            self.core.admission.rejections["shutting_down"] += 1
            raise RuntimeError("scheduler is shutting down")
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
        ids = [req_id] if n == 1 else [f"{req_id}#{i}" for i in range(n)]
        events: asyncio.Queue = asyncio.Queue()
        lives: list[Live] = []
        try:
            for i, rid in enumerate(ids):
                p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
                req = self.core.submit(rid, prompt_ids, p, draft_length, tree_size, request_class,
                                       follows=ids[0] if i else None)
                lives.append(Live(req, events, index=i))
        except BaseException:
            for live in lives:
                self.core.cancel(live.req.req_id)
            raise
        self.lives.update((live.req.req_id, live) for live in lives)
        self.wake.set()
        return lives

    def cancel(self, req_id: str) -> None:
        self.core.cancel(req_id)
        self.lives.pop(req_id, None)
        self.wake.set()

    def _emit(self, live: Live, tokens: list[int]) -> None:
        req = live.req
        text = req.detok.text if req.finished else req.detok.stable_text()
        finish = ("error" if req.error else req.finish_reason) if req.finished else ""
        live.events.put_nowait(codec.generate_event(tokens, text[live.emitted_chars:], finish or "", req.error,
                                                    req.summary() if req.finished else None,
                                                    req.last_logprobs(len(tokens)), live.index))
        live.emitted_chars = len(text)
        if req.finished:
            self.lives.pop(req.req_id, None)

    async def run(self) -> None:
        while True:
            # Clear before looking: a request submitted while this task awaits below sets it again.
            self.wake.clear()
            if not self.core.has_work():
                await self._flush()
                if not self.core.has_work():
                    await self.wake.wait()
                continue
            try:
                for req, tokens in await self.core.step():
                    live = self.lives.get(req.req_id)
                    if live is not None:
                        self._emit(live, tokens)
                if self.core.all_held():
                    await asyncio.sleep(HOLD_POLL_S)  # no verifier: do not spin until one returns
                else:  # in-process workers never suspend a step: let the streams write its tokens
                    await asyncio.sleep(0)
            except Exception:  # never let one bad step kill the loop
                log.exception("step failed")
                await asyncio.sleep(0.05)

    async def _flush(self) -> None:
        for workers in (self.core.drafts, self.core.verifiers):
            if workers is not None:
                await workers.flush()

    async def drain(self) -> None:
        """Stop accepting requests; return when every running one has finished."""
        self.accepting = False
        while self.core.has_work():
            await asyncio.sleep(0.05)
        await self._flush()
