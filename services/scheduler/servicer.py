"""SchedulerService: translates Generate calls into loop requests and loop events into a stream."""

from __future__ import annotations

import grpc

from services.common import codec
from services.common.metrics import RequestTimer
from services.common.tracing import extract_metadata
from services.scheduler.loop import SchedulerLoop
from specserve.v1 import common_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, loop: SchedulerLoop, info: common_pb2.InfoResponse):
        self.loop = loop
        self.info = info

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        parent = extract_metadata(context.invocation_metadata())  # the gateway's span, if traced
        try:
            params = codec.params_from_pb(request.params)
            live = self.loop.submit(
                request.request_id, list(request.prompt_ids), params,
                request.draft_length if request.HasField("draft_length") else None,
                request.tree_size if request.HasField("tree_size") else None,
                request_class=request.request_class or "default")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        rid, spans = request.request_id, self.loop.spans
        spans.start(rid, "scheduler.request", parent, attributes={
            "specserve.prompt_tokens": len(request.prompt_ids), "specserve.max_tokens": request.params.max_tokens})
        timer = RequestTimer(self.loop.metrics, len(request.prompt_ids))
        try:
            while True:
                event = await live.events.get()
                timer.event(len(event.token_ids), event.finish_reason)
                yield event
                if event.finish_reason:
                    return
        finally:  # finished, or the client went away: free the request everywhere
            self.loop.cancel(rid)
            timer.end()
            if rid in spans.spans:
                s = live.req.stats
                spans.end(rid, error="generation failed" if timer.finish_reason == "error" else "", attributes={
                    "specserve.finish_reason": timer.finish_reason, "specserve.steps": s.steps,
                    "specserve.completion_tokens": len(live.req.output_ids),
                    "specserve.drafted_tokens": s.drafted, "specserve.accepted_tokens": s.accepted})

    async def Info(self, request, context):
        return self.info

    async def State(self, request, context):
        return common_pb2.StateResponse(request_ids=list(self.loop.by_id), steps=self.loop.steps,
                                        max_batch_seen=self.loop.max_batch_seen)
