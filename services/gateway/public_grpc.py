"""The public gRPC API (`specserve.v1.Generation`), the HTTP API's twin.

The servicer only translates: a `TextRequest` becomes the same `ApiRequest` the HTTP API builds
(same validation, same API keys, read from the `authorization: Bearer KEY` metadata), the
scheduler's events become `TextChunk`s, and an `ApiError` becomes a gRPC status (401
UNAUTHENTICATED, 400 INVALID_ARGUMENT, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE).
A client that cancels its call cancels the scheduler call with it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.gateway.core import Gateway, event_error, incomplete_stream
from services.gateway.errors import ApiError, invalid
from services.gateway.openai_api import ApiRequest
from services.gateway.tokenization import check_messages
from services.gateway.validation import parse_sampling
from specserve.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def api_request(request: gateway_pb2.TextRequest) -> ApiRequest:
    """Validate a TextRequest into an ApiRequest. Proto3 zeros mean "unset" where zero is not a
    valid value: max_tokens 0 = the gateway default, top_p 0 = 1; temperature 0 = greedy."""
    p = request.params
    sampling = parse_sampling({
        "max_tokens": p.max_tokens or None,
        "temperature": p.temperature,
        "top_p": p.top_p or None,
        "top_k": p.top_k,
        "seed": p.seed if p.HasField("seed") else None,
        "stop": list(p.stop) or None,
        "ignore_eos": p.ignore_eos,
    }, default_temperature=0.0)
    if request.messages:
        messages = check_messages([{"role": m.role, "content": m.content} for m in request.messages])
        return ApiRequest(kind="chat", sampling=sampling, model=request.model or None,
                          messages=messages, prompt_param="messages")
    if not request.prompt:
        raise invalid("prompt", "prompt (or messages) is required", "missing_required_parameter")
    return ApiRequest(kind="completion", sampling=sampling, model=request.model or None,
                      prompt=request.prompt)


def _bearer(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value
    return None


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.active = 0  # calls in flight (graceful shutdown waits for them)
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no call is in flight."""
        await self._idle.wait()

    def _prepare(self, request: gateway_pb2.TextRequest,
                 context: grpc.aio.ServicerContext) -> scheduler_pb2.GenerateRequest:
        self.gateway.keys.check_authorization(_bearer(context))
        return self.gateway.build(api_request(request), self.gateway.new_request_id("gen"))

    async def Generate(self, request: gateway_pb2.TextRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TextResponse:
        self._enter()
        try:
            scheduler_request = self._prepare(request, context)
            done = await self.gateway.collect(scheduler_request)
            return gateway_pb2.TextResponse(id=scheduler_request.request_id, text=done.text,
                                            token_ids=done.token_ids, finish_reason=done.finish_reason,
                                            usage=done.usage)
        except ApiError as e:
            await context.abort(e.grpc_code, e.grpc_message)
        finally:
            self._leave()

    async def GenerateStream(self, request: gateway_pb2.TextRequest, context: grpc.aio.ServicerContext):
        self._enter()
        try:
            scheduler_request = self._prepare(request, context)
            rid = scheduler_request.request_id
            async with self.gateway.stream(scheduler_request) as events:
                async for event in events:
                    if event.finish_reason == "error":
                        raise event_error(event)
                    if event.text or event.token_ids or event.finish_reason:
                        chunk = gateway_pb2.TextChunk(id=rid, text=event.text, token_ids=event.token_ids,
                                                      finish_reason=event.finish_reason)
                        if event.finish_reason:
                            chunk.usage.CopyFrom(event.usage)
                        yield chunk
                    if event.finish_reason:
                        return
                raise incomplete_stream()
        except ApiError as e:
            await context.abort(e.grpc_code, e.grpc_message)
        finally:
            self._leave()


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    gateway_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
