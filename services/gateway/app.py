"""The HTTP API: an OpenAI-compatible FastAPI app over a `Gateway`.

Routes: POST /v1/completions, POST /v1/chat/completions (whole responses, or SSE streams with
`stream: true`), GET /v1/models, GET /v1/models/{id}, POST /infer (the original API), GET /health
(open unless --auth-metrics; AuthMiddleware checks credentials and the IP allowlist, and the
Gateway's rate limits run once a request is validated). Every error, FastAPI's own 404/405 included, is returned in
the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.

Generation routes run in one of the gateway's in-flight slots (`capped`, --max-concurrent-requests:
503 with Retry-After when none is free), freed when the response is ready or its SSE stream ends.
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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.metrics import CONTENT_TYPE, GatewayMetrics, HttpMetricsMiddleware, Registry
from services.common.tracing import fastapi_telemetry
from services.gateway import openai_api
from services.gateway.core import Gateway, Slot, event_error, incomplete_stream
from services.gateway.errors import ApiError
from services.gateway.http_auth import AuthMiddleware, principal_of
from services.gateway.openai_api import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, OpenAIFormatter, sse
from services.gateway.scheduler_client import SchedulerStream
from services.gateway.validation import check_json_depth, too_deep

log = logging.getLogger(__name__)

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


async def _first_event(stream: SchedulerStream):
    """The stream's first event, or None when it ended without any."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


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


async def sse_body(first, stream: SchedulerStream, fmt: OpenAIFormatter) -> AsyncIterator[bytes]:
    """The SSE frames of one request: chunks as events arrive, an optional usage chunk, and
    `data: [DONE]`. A failure after the stream started is sent as an error object, then [DONE]."""
    started = time.perf_counter()
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
                    if fmt.include_usage:
                        yield sse(fmt.usage_chunk(event.usage))
                    _log_done(fmt.request_id, event.finish_reason, event.usage, started)
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


def _log_done(request_id: str, finish_reason: str, usage, started: float) -> None:
    log.info("request finished", extra={"fields": {
        "request_id": request_id, "finish_reason": finish_reason,
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "mean_accepted_length": round(float(usage.mean_accepted_length), 3),
        "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)}})


def _error_response(e: ApiError) -> JSONResponse:
    headers = e.headers()
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def gateway_metrics(gateway: Gateway) -> GatewayMetrics:
    """The gateway's metrics; auth and rate-limit refusals are read from the objects counting them."""
    return GatewayMetrics(Registry("gateway"), auth_failures=lambda: gateway.auth.failures,
                          rate_limit_rejections=lambda: gateway.limiter.rejections if gateway.limiter else {},
                          rate_limit_unchecked=lambda: gateway.limiter.unchecked if gateway.limiter else 0,
                          rejections=lambda: gateway.rejections)


def create_app(gateway: Gateway, metrics: GatewayMetrics | None = None) -> FastAPI:
    """The FastAPI app serving `gateway` (and GET /metrics from `metrics`)."""
    app = FastAPI(title="SpecServe", description="Lossless speculative decoding, OpenAI-compatible",
                  docs_url=None, redoc_url=None, telemetry=fastapi_telemetry())  # a span per request
    app.state.gateway = gateway
    limit = gateway.config.max_body_bytes

    app.add_middleware(AuthMiddleware, auth=gateway.auth)  # every route but /health and /metrics
    # Outside auth, so refusals are counted too (the last added runs first).
    metrics = metrics or gateway_metrics(gateway)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics, routes=app.router.routes)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        gateway.count_refusal(e)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            return _error_response(ApiError(404, f"no route {request.method} {request.url.path}",
                                            code="not_found"))
        if e.status_code == 405:
            return _error_response(ApiError(405, f"method {request.method} is not allowed on "
                                            f"{request.url.path}", code="method_not_allowed"))
        return _error_response(ApiError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error_response(ApiError(400, first.get("msg", "invalid request"), param=param,
                                        code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(ApiError(500, "internal server error", code="internal_error"))

    async def capped(respond: Callable[[Slot], Awaitable[Response]]) -> Response:
        """`respond` in one of the gateway's in-flight slots (503 when none is free); the slot is
        freed when the response is ready, or an SSE response's stream ends."""
        slot = gateway.inflight.slot().acquire()
        try:
            response = await respond(slot)
        except BaseException:
            slot.release()
            raise
        if not (isinstance(response, EventStreamResponse) and response.slot is slot):
            slot.release()
        return response

    async def generate(request: Request, parse: Callable[[Any], openai_api.ApiRequest],
                       prefix: str, slot: Slot) -> Response:
        req = parse(await read_json(request, limit))
        request_id = gateway.new_request_id(prefix)
        scheduler_request = await gateway.prepare(req, request_id, principal_of(request))
        fmt = OpenAIFormatter(req.kind, request_id, gateway.model_name,
                              include_usage=req.include_usage, return_token_ids=req.return_token_ids)
        if not req.stream:
            started = time.perf_counter()
            done = await until_disconnect(request, gateway.collect(scheduler_request))
            if done is DISCONNECTED:
                return Response(status_code=CLIENT_CLOSED)
            _log_done(request_id, done.finish_reason, done.usage, started)
            return JSONResponse(fmt.response(done.text, done.token_ids, done.finish_reason, done.usage))
        # Wait for the first event before answering, so that a scheduler failure is still an
        # HTTP error status rather than an error inside a 200 stream.
        stream = gateway.stream(scheduler_request)
        try:
            first = await until_disconnect(request, _first_event(stream))
        except BaseException:
            stream.cancel()
            raise
        if first is DISCONNECTED or first is None or first.finish_reason == "error":
            stream.cancel()
            if first is DISCONNECTED:
                return Response(status_code=CLIENT_CLOSED)
            raise incomplete_stream() if first is None else event_error(first)
        return EventStreamResponse(sse_body(first, stream, fmt), stream, slot)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await capped(lambda slot: generate(request, openai_api.parse_completion, "cmpl", slot))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await capped(lambda slot: generate(request, openai_api.parse_chat, "chatcmpl", slot))

    @app.get("/v1/models")
    async def models() -> dict:
        return openai_api.models_response(gateway.model_name, gateway.config.target,
                                          gateway.context_length, gateway.created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        gateway.check_model(model_id)
        return openai_api.model_card(gateway.model_name, gateway.config.target,
                                     gateway.context_length, gateway.created)

    @app.post("/infer")
    async def infer(request: Request) -> Response:
        return await capped(lambda slot: infer_once(request))

    async def infer_once(request: Request) -> Response:
        req = openai_api.parse_infer(await read_json(request, limit))
        scheduler_request = await gateway.prepare(req, gateway.new_request_id("infer"), principal_of(request))
        started = time.perf_counter()
        done = await until_disconnect(request, gateway.collect(scheduler_request))
        if done is DISCONNECTED:
            return Response(status_code=CLIENT_CLOSED)
        latency_ms = (time.perf_counter() - started) * 1000
        _log_done(scheduler_request.request_id, done.finish_reason, done.usage, started)
        return JSONResponse(openai_api.infer_response(done.text, latency_ms, done.usage))

    @app.get("/health")
    async def health() -> JSONResponse:
        if await gateway.healthy():
            return JSONResponse({"status": "ok"})
        e = ApiError(503, "no scheduler answers its health check", code="scheduler_unavailable")
        return JSONResponse({"status": "unavailable", **e.body()}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.registry.exposition(), media_type=CONTENT_TYPE)

    return app
