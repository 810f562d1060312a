"""The public gRPC API (`specserve.v1.Generation`), the HTTP API's twin.

The servicer only translates: a `TextRequest` becomes the same `ApiRequest` the HTTP API builds
(same validation and size limit, same authentication: the `authorization: Bearer KEY-or-JWT`
metadata and the peer's address; same rate limits), the scheduler's events become `TextChunk`s,
and an `ApiError` becomes a gRPC status (401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 400/413
INVALID_ARGUMENT, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED with `retry-after` trailing metadata,
503 UNAVAILABLE, also with `retry-after` when overloaded). Each call holds one of the gateway's
in-flight slots (--max-concurrent-requests) until it ends. A client that cancels its call
cancels the scheduler call with it; a client's deadline becomes the scheduler call's deadline
(DEADLINE_EXCEEDED when it passes).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError

from services.gateway.core import Gateway, event_error, incomplete_stream
from services.gateway.errors import ApiError, invalid
from services.gateway.openai_api import ApiRequest
from services.gateway.structured import check_grammar
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
        "logprobs": p.logprobs if p.HasField("logprobs") else None,
    }, default_temperature=0.0)
    if p.HasField("grammar"):
        sampling = replace(sampling, grammar=check_grammar(p.grammar.kind, p.grammar.source, "params.grammar"))
    if request.messages:
        messages = check_messages([{"role": m.role, "content": m.content} for m in request.messages])
        return ApiRequest(kind="chat", sampling=sampling, model=request.model or None,
                          messages=messages, prompt_param="messages")
    if not request.prompt:
        raise invalid("prompt", "prompt (or messages) is required", "missing_required_parameter")
    return ApiRequest(kind="completion", sampling=sampling, model=request.model or None,
                      prompt=request.prompt)


def peer_host(peer: str | None) -> str | None:
    """The client address of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"); None for
    other transports (unix sockets), which an IP allowlist then refuses."""
    m = re.fullmatch(r"ipv4:([\d.]+):\d+|ipv6:\[([0-9A-Fa-f:.%\w]+)\]:\d+", peer or "")
    return (m.group(1) or m.group(2)) if m else None


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

    async def _prepare(self, request: gateway_pb2.TextRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.GenerateRequest:
        principal = self.gateway.auth.authenticate(_bearer(context), peer_host(context.peer()))
        return await self.gateway.prepare(api_request(request), self.gateway.new_request_id("gen"), principal)

    async def Generate(self, request: gateway_pb2.TextRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TextResponse:
        self._enter()
        slot = self.gateway.inflight.slot()
        try:
            slot.acquire()
            scheduler_request = await self._prepare(request, context)
            done = (await self.gateway.collect(scheduler_request, context.time_remaining()))[0]  # n = 1 here
            return gateway_pb2.TextResponse(id=scheduler_request.request_id, text=done.text,
                                            token_ids=done.token_ids, finish_reason=done.finish_reason,
                                            usage=done.usage, logprobs=done.logprobs or [])
        except ApiError as e:
            self.gateway.count_refusal(e)
            await context.abort(e.grpc_code, e.grpc_message, e.grpc_metadata())
        finally:
            slot.release()
            self._leave()

    async def GenerateStream(self, request: gateway_pb2.TextRequest, context: grpc.aio.ServicerContext):
        self._enter()
        slot = self.gateway.inflight.slot()
        try:
            slot.acquire()
            scheduler_request = await self._prepare(request, context)
            rid = scheduler_request.request_id
            async with self.gateway.stream(scheduler_request, context.time_remaining()) as events:
                async for event in events:
                    if event.finish_reason == "error":
                        raise event_error(event)
                    if event.text or event.token_ids or event.finish_reason:
                        chunk = gateway_pb2.TextChunk(id=rid, text=event.text, token_ids=event.token_ids,
                                                      finish_reason=event.finish_reason, logprobs=event.logprobs)
                        if event.finish_reason:
                            chunk.usage.CopyFrom(event.usage)
                        yield chunk
                    if event.finish_reason:
                        return
                raise incomplete_stream()
        except ApiError as e:
            self.gateway.count_refusal(e)
            await context.abort(e.grpc_code, e.grpc_message, e.grpc_metadata())
        finally:
            slot.release()
            self._leave()


    async def _parse(self, raw: bytes, context: grpc.aio.ServicerContext) -> gateway_pb2.TextRequest:
        """The request bytes as a TextRequest: INVALID_ARGUMENT beyond the size limit or when they
        do not parse (invalid UTF-8 in a string field), where gRPC itself would say UNKNOWN."""
        limit = self.gateway.config.max_body_bytes
        if len(raw) > limit:
            e = ApiError(413, f"the request message is larger than {limit} bytes", code="body_too_large")
            await context.abort(e.grpc_code, e.grpc_message)
        try:
            return gateway_pb2.TextRequest.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid TextRequest: {e}")

    async def generate_bytes(self, raw: bytes, context: grpc.aio.ServicerContext) -> gateway_pb2.TextResponse:
        return await self.Generate(await self._parse(raw, context), context)

    async def generate_stream_bytes(self, raw: bytes, context: grpc.aio.ServicerContext):
        async for chunk in self.GenerateStream(await self._parse(raw, context), context):
            yield chunk


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer` as specserve.v1.Generation, parsing requests itself (see `_parse`)."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.generate_bytes, response_serializer=gateway_pb2.TextResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.generate_stream_bytes, response_serializer=gateway_pb2.TextChunk.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
