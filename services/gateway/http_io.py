"""What the HTTP routes share: reading a JSON body, racing work against the client's disconnect,
in-flight slots, and SSE responses.

A client that disconnects cancels its scheduler call at once: while waiting for a whole response
or for a stream's first event, the handler races the work against the `http.disconnect` message;
once streaming, Starlette cancels the body iterator, whose exit cancels the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.gateway.core import Gateway, Slot, event_error, incomplete_stream
from services.gateway.errors import ApiError
from services.gateway.openai_api import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, OpenAIFormatter, sse, total_usage
from services.gateway.scheduler_client import SchedulerStream
from services.gateway.validation import check_json_depth, too_deep

log = logging.getLogger("services.gateway.app")  # the HTTP API's logger name, as before the split

DISCONNECTED = object()  # what until_disconnect returns when the client went away first
CLIENT_CLOSED = 499  # nginx's "client closed request"; never actually reaches the client


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: 413 beyond `limit` bytes, 400 when it is not JSON or nests deeper
    than MAX_JSON_DEPTH (json's own recursion limit, near 1000 levels, is caught on the way)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset "
                       f"{e.start}", code="invalid_utf8") from None
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return check_json_depth(json.loads(raw))
    except RecursionError:
        raise too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` (after the body was read), or cancel it when the client disconnects first;
    returns its result, or DISCONNECTED."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return DISCONNECTED if task.cancelled() else task.result()


class EventStreamResponse(StreamingResponse):
    """An SSE response that cancels its scheduler call and frees its in-flight slot however the
    response ends."""

    def __init__(self, body: AsyncIterator[bytes], stream: SchedulerStream, slot: Slot | None = None):
        super().__init__(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
        self.stream = stream
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()
            if self.slot is not None:
                self.slot.release()


async def capped(gateway: Gateway, respond: Callable[[Slot], Awaitable[Response]]) -> Response:
    """`respond` in one of the gateway's in-flight slots (--max-concurrent-requests: 503 with
    Retry-After when none is free); the slot is freed when the response is ready, or an SSE
    response's stream ends."""
    slot = gateway.inflight.slot().acquire()
    try:
        response = await respond(slot)
    except BaseException:
        slot.release()
        raise
    if not (isinstance(response, EventStreamResponse) and response.slot is slot):
        slot.release()
    return response


async def sse_body(first, stream: SchedulerStream, fmt: OpenAIFormatter) -> AsyncIterator[bytes]:
    """The SSE frames of one request: chunks as events arrive, an optional usage chunk, and
    `data: [DONE]`. A failure after the stream started is sent as an error object, then [DONE]."""
    started = time.perf_counter()
    usages = {}  # sample index -> its usage, once finished
    try:
        async with stream:
            for chunk in fmt.start_chunks():
                yield sse(chunk)
            event = first
            while True:
                if event.finish_reason == "error":
                    yield sse(event_error(event).body())
                    break
                for chunk in fmt.event_chunks(event):
                    yield sse(chunk)
                if event.finish_reason:
                    usages[event.index] = event.usage
                if len(usages) == fmt.n:
                    usage = total_usage([usages[i] for i in range(fmt.n)])
                    if fmt.include_usage:
                        yield sse(fmt.usage_chunk(usage))
                    log_done(fmt.request_id, event.finish_reason, usage, started)
                    break
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    yield sse(incomplete_stream().body())
                    break
                except ApiError as e:
                    yield sse(e.body())
                    break
            yield SSE_DONE
    except asyncio.CancelledError:
        log.info("client disconnected; request cancelled", extra={"fields": {"request_id": fmt.request_id}})
        raise


def log_done(request_id: str, finish_reason: str, usage, started: float) -> None:
    log.info("request finished", extra={"fields": {
        "request_id": request_id, "finish_reason": finish_reason,
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "mean_accepted_length": round(float(usage.mean_accepted_length), 3),
        "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)}})
