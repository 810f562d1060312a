"""SchedulerService: translates Generate calls into loop requests and loop events into a stream.

Refusals: bad input INVALID_ARGUMENT; a full queue RESOURCE_EXHAUSTED with `retry-after` trailing
metadata (whole seconds); shutting down UNAVAILABLE with `retry-after: 1`."""

from __future__ import annotations

import math

import grpc

from services.common import codec
from services.common.metrics import RequestTimer
from services.common.tracing import extract_metadata
from services.scheduler.admission import Overloaded
from services.scheduler.loop import SchedulerLoop
from specserve.v1 import common_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Registered before the scheduler is ready (GrpcServer refuses its RPCs until then); `bind`
    gives it the loop and the Info it answers."""

    def __init__(self, loop: SchedulerLoop | None = None, info: common_pb2.InfoResponse | None = None):
        self.loop, self.info = loop, info

    def bind(self, loop: SchedulerLoop, info: common_pb2.InfoResponse) -> None:
        self.loop, self.info = loop, info

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        parent = extract_metadata(context.invocation_metadata())  # the gateway's span, if traced
        try:
            params = codec.params_from_pb(request.params)
            lives = self.loop.submit(
                request.request_id, list(request.prompt_ids), params,
                request.draft_length if request.HasField("draft_length") else None,
                request.tree_size if request.HasField("tree_size") else None,
                request_class=request.request_class or "default", n=request.n or 1)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                (("retry-after", str(max(1, math.ceil(e.retry_after_s)))),))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), (("retry-after", "1"),))
        spans = self.loop.spans
        for live in lives:
            spans.start(live.req.req_id, "scheduler.request", parent, attributes={
                "specserve.prompt_tokens": len(request.prompt_ids), "specserve.max_tokens": request.params.max_tokens})
        timer = RequestTimer(self.loop.metrics, len(request.prompt_ids))
        try:
            sent, running = False, len(lives)
            while running:
                event = await lives[0].events.get()
                if lives[event.index].req.unavailable and not sent:  # nothing streamed yet: the caller may retry
                    timer.event(0, "error")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.error, (("retry-after", "1"),))
                running -= bool(event.finish_reason)
                timer.event(len(event.token_ids), event.finish_reason if not running else "")
                yield event
                sent = True
        finally:  # finished, or the client went away: free the requests everywhere
            for live in lives:
                self.loop.cancel(live.req.req_id)
            timer.end()
            for live in lives:
                self._end_span(live.req, timer.finish_reason)

    def _end_span(self, req, finish_reason: str) -> None:
        spans = self.loop.spans
        if req.req_id in spans.spans:
            s = req.stats
            spans.end(req.req_id, error="generation failed" if finish_reason == "error" else "", attributes={
                "specserve.finish_reason": finish_reason, "specserve.steps": s.steps,
                "specserve.completion_tokens": len(req.output_ids),
                "specserve.drafted_tokens": s.drafted, "specserve.accepted_tokens": s.accepted})

    async def Info(self, request, context):
        return self.info

    async def State(self, request, context):
        core = self.loop.core
        return common_pb2.StateResponse(request_ids=list(core.by_id), steps=core.steps,
                                        max_batch_seen=core.max_batch_seen)
