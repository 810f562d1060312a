"""The one gRPC servicer of both workers (DraftService and VerifierService): it translates a
step stream's protobuf to a `StepWorker` and back through the kind's codec, and nothing else.

One long-lived bidirectional stream per scheduler; each step message is answered in order.
Bad input on a step (unknown shapes, token ids outside the vocabulary, duplicate request ids in
one step, trees that break their invariants) raises ValueError, which the stream answers with
INVALID_ARGUMENT; anything else that escapes a step is logged and answered with INTERNAL; bytes
that do not parse as a step message (invalid UTF-8 in a string field) with INVALID_ARGUMENT too.
Either way the stream ends and the requests it carried are freed.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from services.common.worker import StepWorker

log = logging.getLogger(__name__)


class StepServicer:
    """Registered before the model loads (GrpcServer refuses its RPCs until ready); `bind` gives it
    the worker."""

    def __init__(self, worker: StepWorker | None, codec):
        self.codec = codec  # services/common/codec.py: DRAFT or VERIFIER
        if worker is not None:
            self.bind(worker)

    def bind(self, worker: StepWorker) -> None:
        self.worker = worker
        # A worker with no model (the n-gram draft) steps on the event loop: its lookup takes less
        # than handing each step to the model thread and back.
        self.inline = not worker.work.runs_model

    def step(self, msg):
        """One step message in, its result out (on the model thread, or inline)."""
        items = self.codec.items(msg)
        return self.codec.result(msg.step_id, items, self.worker.step(msg.step_id, list(msg.release), items))

    async def stream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Answer each step message in order; free every request of a stream that ends."""
        loop = asyncio.get_running_loop()
        seen: set[str] = set()
        try:
            async for msg in request_iterator:
                items = {item.request_id for item in msg.items}
                seen.update(items)
                try:
                    if self.inline:
                        result = self.step(msg)
                    else:
                        result = await loop.run_in_executor(self.worker.executor, self.step, msg)
                except ValueError as e:  # the stream ends: `seen` (this step's releases too) is freed
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception:
                    log.exception("%s step %d failed", self.worker.info.role, msg.step_id)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{self.worker.info.role} step failed")
                # The step freed its releases before it ran its items: an id in both stays held.
                seen.difference_update(set(msg.release) - items)
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
                    self.worker.release_all(sorted(seen))
                else:
                    self.worker.executor.submit(self.worker.release_all, sorted(seen))

    # The RPCs of DraftService and VerifierService: a server registers the servicer for one.
    Propose = Verify = stream

    async def Info(self, request, context):
        return self.worker.info

    async def State(self, request, context):
        return self.worker.state()
