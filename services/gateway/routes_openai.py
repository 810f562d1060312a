"""The OpenAI-compatible routes: POST /v1/completions and /v1/chat/completions (whole responses,
or SSE streams with `stream: true`), GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway import openai_api
from services.gateway.core import Gateway, Slot, event_error, incomplete_stream
from services.gateway.http_auth import principal_of
from services.gateway.http_io import (CLIENT_CLOSED, DISCONNECTED, EventStreamResponse, capped, log_done,
                                      read_json, sse_body, until_disconnect)
from services.gateway.openai_api import OpenAIFormatter, total_usage
from services.gateway.scheduler_client import SchedulerStream


async def _first_event(stream: SchedulerStream):
    """The stream's first event, or None when it ended without any."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def generate(gateway: Gateway, request: Request, limit: int,
                   parse: Callable[[Any], openai_api.ApiRequest], prefix: str, slot: Slot) -> Response:
    """One completion or chat completion: a whole JSON response, or an SSE stream holding `slot`."""
    req = parse(await read_json(request, limit))
    request_id = gateway.new_request_id(prefix)
    scheduler_request = await gateway.prepare(req, request_id, principal_of(request))
    fmt = OpenAIFormatter(req.kind, request_id, gateway.model_name, include_usage=req.include_usage,
                          return_token_ids=req.return_token_ids, token_text=gateway.tokenizer.token_text, n=req.n)
    if not req.stream:
        started = time.perf_counter()
        done = await until_disconnect(request, gateway.collect(scheduler_request))
        if done is DISCONNECTED:
            return Response(status_code=CLIENT_CLOSED)
        log_done(request_id, done[-1].finish_reason, total_usage([c.usage for c in done]), started)
        return JSONResponse(fmt.response(done))
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


def add_openai_routes(app: FastAPI, gateway: Gateway) -> None:
    """Register the OpenAI-compatible routes over `gateway` on `app`."""
    limit = gateway.config.max_body_bytes

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await capped(gateway, lambda slot: generate(gateway, request, limit,
                                                           openai_api.parse_completion, "cmpl", slot))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await capped(gateway, lambda slot: generate(gateway, request, limit, openai_api.parse_chat,
                                                           "chatcmpl", slot))

    @app.get("/v1/models")
    async def models() -> dict:
        return openai_api.models_response(gateway.model_name, gateway.config.target,
                                          gateway.context_length, gateway.created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        gateway.check_model(model_id)
        return openai_api.model_card(gateway.model_name, gateway.config.target,
                                     gateway.context_length, gateway.created)

