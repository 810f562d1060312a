"""SchedulerClient: the gateway's side of `SchedulerService`, over one or more replicas.

New requests go to the replicas round-robin. A request whose replica is unavailable or full
(UNAVAILABLE, RESOURCE_EXHAUSTED) before it produced anything is tried on the next one (at most
once per replica); after the first event a failure is final, since output already went to the
client.

`SchedulerClient.stream(request)` opens one `Generate` call as a `SchedulerStream`: an async
iterator of `GenerateEvent`s and an async context manager whose exit cancels the call, which
cancels the request on the scheduler and frees its state on the workers; the call carries the
current W3C trace context as `traceparent` metadata, and the caller's deadline (`timeout`, the
seconds left to the client's own deadline) so the scheduler drops a request nobody waits for.
gRPC failures surface as `ApiError`s with the HTTP status they map to (UNAVAILABLE 503, INVALID_ARGUMENT 400,
RESOURCE_EXHAUSTED 429, DEADLINE_EXCEEDED 504, anything else 500).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.grpc_server import channel, check_serving
from services.common.tracing import inject_metadata
from services.gateway.errors import ApiError
from specserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

# Refusals another scheduler replica may not share: the request is tried there.
RETRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Parameter names a scheduler error message may start with (then the 400 names it).
KNOWN_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prompt",
                "draft_length", "tree_size")


def retry_hint(e: grpc.RpcError, default: float = 1.0) -> float:
    """The `retry-after` trailing metadata of a refusal (seconds), else `default`."""
    try:
        for key, value in e.trailing_metadata() or ():
            if key == "retry-after":
                seconds = float(value)
                if seconds >= 0:
                    return seconds
    except (AttributeError, TypeError, ValueError):  # no metadata, or a value that is not a number
        pass
    return default


def error_from_rpc(e: grpc.RpcError) -> ApiError:
    """Map a scheduler gRPC error to the ApiError a client should see; refusals for overload
    (RESOURCE_EXHAUSTED, UNAVAILABLE) carry the scheduler's retry hint, else 1 s."""
    code, details = e.code(), (e.details() or "").strip()
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the scheduler is unavailable: {details or 'no connection'}",
                        code="scheduler_unavailable", retry_after=retry_hint(e))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = next((p for p in KNOWN_PARAMS if details.startswith(p)), None)
        return ApiError(400, details or "invalid request", param=param, code="invalid_value")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, details or "the scheduler is at capacity; retry later",
                        code="scheduler_overloaded", retry_after=retry_hint(e))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, details or "the scheduler did not answer in time", code="timeout")
    if code == grpc.StatusCode.CANCELLED:
        return ApiError(499, details or "the request was cancelled", code="cancelled")
    return ApiError(500, f"scheduler error ({code.name}): {details}", code="scheduler_error")


class SchedulerStream:
    """One `Generate` call: iterate for events. Leaving the `async with` block ends the call:
    cancelled if the request is unfinished (or the block raised), closed normally otherwise."""

    def __init__(self, client: "SchedulerClient", request: scheduler_pb2.GenerateRequest,
                 timeout: float | None = None):
        self._client = client
        self._request = request
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._call = None
        self._tried = 0
        self._received = False
        self._finished = False
        self._final = False  # an event with a finish_reason arrived

    async def __aenter__(self) -> "SchedulerStream":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()

    def __aiter__(self) -> "SchedulerStream":
        return self

    async def __anext__(self) -> scheduler_pb2.GenerateEvent:
        while True:
            if self._finished:
                raise StopAsyncIteration
            if self._call is None:
                self._tried += 1
                # The current trace context (the HTTP request's span) rides along as `traceparent`.
                timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                self._call = self._client.pick().Generate(self._request, metadata=inject_metadata() or None,
                                                          timeout=timeout)
            try:
                event = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if (e.code() in RETRY_ELSEWHERE and not self._received
                        and self._tried < self._client.replicas):
                    log.warning("scheduler %s (%s), retrying request %s on the next replica",
                                e.code().name, e.details(), self._request.request_id)
                    self._call = None
                    continue
                self._finished = True
                raise error_from_rpc(e) from None
            if event is grpc.aio.EOF:
                self._finished = True
                raise StopAsyncIteration
            self._received = True
            self._final = self._final or bool(event.finish_reason)
            return event

    async def close(self, timeout: float = 2.0) -> None:
        """End the call: after the final event, let the scheduler end it (its status follows the
        final event at once), so a finished request is not reported as cancelled; else cancel."""
        try:
            if self._final and self._call is not None and not self._call.done():
                await asyncio.wait_for(self._call.code(), timeout)
        except (asyncio.TimeoutError, grpc.RpcError):
            pass
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the call (a no-op once it ended)."""
        self._finished = True
        if self._call is not None and not self._call.done():
            self._call.cancel()


class SchedulerClient:
    """Channels to every scheduler replica; new requests go round-robin."""

    def __init__(self, addrs: list[str], credentials: grpc.ChannelCredentials | None = None):
        if not addrs:
            raise ValueError("at least one scheduler address is needed")
        self.addrs = list(addrs)
        self._channels = [channel(a, credentials) for a in self.addrs]
        self._stubs = [scheduler_pb2_grpc.SchedulerServiceStub(c) for c in self._channels]
        self._next = 0

    @property
    def replicas(self) -> int:
        return len(self._stubs)

    def pick(self) -> scheduler_pb2_grpc.SchedulerServiceStub:
        """The next replica's stub, round-robin."""
        stub = self._stubs[self._next % len(self._stubs)]
        self._next = (self._next + 1) % len(self._stubs)
        return stub

    def stream(self, request: scheduler_pb2.GenerateRequest, timeout: float | None = None) -> SchedulerStream:
        """Open a Generate call (lazily: the RPC starts on the first read), ending within
        `timeout` seconds when given (DEADLINE_EXCEEDED, a 504)."""
        return SchedulerStream(self, request, timeout)

    async def info(self, timeout: float = 5.0) -> common_pb2.InfoResponse | None:
        """The first replica's Info that answers, or None when none does."""
        for stub, addr in zip(self._stubs, self.addrs):
            try:
                return await stub.Info(common_pb2.InfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                log.debug("scheduler %s Info failed: %s", addr, e.code().name)
        return None

    async def healthy(self, timeout: float = 2.0) -> bool:
        """True when at least one replica answers the grpc.health.v1 check with SERVING."""
        return any((await self.health(timeout)).values())

    async def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """Each replica's address and whether it answers its health check with SERVING."""
        results = await asyncio.gather(*(check_serving(c, timeout) for c in self._channels))
        return dict(zip(self.addrs, results))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
