"""SchedulerService: translates Generate calls into loop requests and loop events into a stream."""

from __future__ import annotations

import grpc

from services.common import codec
from services.scheduler.loop import SchedulerLoop
from specserve.v1 import common_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, loop: SchedulerLoop, info: common_pb2.InfoResponse):
        self.loop = loop
        self.info = info

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            params = codec.params_from_pb(request.params)
            live = self.loop.submit(
                request.request_id, list(request.prompt_ids), params,
                request.draft_length if request.HasField("draft_length") else None,
                request.tree_size if request.HasField("tree_size") else None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            while True:
                event = await live.events.get()
                yield event
                if event.finish_reason:
                    return
        finally:  # finished, or the client went away: free the request everywhere
            self.loop.cancel(request.request_id)

    async def Info(self, request, context):
        return self.info

    async def State(self, request, context):
        return common_pb2.StateResponse(request_ids=list(self.loop.by_id), steps=self.loop.steps,
                                        max_batch_seen=self.loop.max_batch_seen)
