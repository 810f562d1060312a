"""gRPC server bootstrap shared by every role: grpc.aio server, the standard grpc.health.v1
health service, server reflection, and graceful shutdown on SIGTERM/SIGINT.

Readiness: `start()` listens at once with health NOT_SERVING (service "" and the role's own), and
the role's own RPCs are refused with UNAVAILABLE until `ready()`: a probe sees the process load its
model instead of a refused connection. Health service "liveness" is SERVING while the process runs
(Kubernetes liveness probes ask for it: a role waiting for its peers is alive, only not ready).
`watch(probe)` keeps the readiness following what the role depends on (a verifier for the
scheduler, a scheduler for the gateway).

Shutdown: health turns NOT_SERVING at once (load balancers stop sending work), `on_drain` lets
the role stop taking new work and finish what it has, then the server stops with a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_MS = 20_000


def channel_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Options of every channel between our processes: large messages, a keepalive ping every
    `keepalive_ms` (a dead peer is noticed while a stream idles), and a short reconnect backoff."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms // 2),
            ("grpc.keepalive_permit_without_calls", 1),
            # Keep pinging on a silent stream (by default a client stops after 2 pings until data
            # flows, and resumes only after a throttle of tens of seconds).
            ("grpc.http2.max_pings_without_data", 0),
            # A restarted peer is found again within about a second: gRPC's default reconnect
            # backoff grows to 120 s, which would keep a replica that came back out of use.
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000)]


def server_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Options of every server: those of a channel, plus a ping policy that accepts the clients'
    keepalive. A server's default allows one ping per 5 minutes while it sends no data, and after
    two early pings it closes the connection (GOAWAY "too_many_pings"), failing the calls on it."""
    return channel_options(keepalive_ms) + [
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2)]


CHANNEL_OPTIONS = channel_options()


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """An internal client channel: TLS with `credentials` (services/common/tls.py), else plain."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


LIVENESS = "liveness"  # the health service a liveness probe asks for
ALWAYS_OPEN = ("/grpc.health.v1.", "/grpc.reflection.")  # answered before the role is ready


async def check_serving(channel: grpc.aio.Channel, timeout: float = 2.0) -> bool:
    """Whether the server behind `channel` answers grpc.health.v1 Check("") with SERVING."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind and serializers as `handler` that refuses the call (not ready)."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready: still loading or waiting for its peers",
                            (("retry-after", "1"),))

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[(handler.request_streaming, handler.response_streaming)](
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class _Gate(grpc.aio.ServerInterceptor):
    """Refuses the role's own RPCs until it is ready (health and reflection always pass)."""

    def __init__(self):
        self.open = False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if self.open or handler is None or details.method.startswith(ALWAYS_OPEN):
            return handler
        return _refusal(handler)


class GrpcServer:
    def __init__(self, host: str, port: int, service_names: list[str], keepalive_ms: int = KEEPALIVE_MS,
                 credentials: grpc.ServerCredentials | None = None):
        self.gate = _Gate()
        self.server = grpc.aio.server(options=server_options(keepalive_ms), interceptors=[self.gate])
        self.address = f"{host}:{port}"
        self.bound_port = (self.server.add_insecure_port(self.address) if credentials is None
                           else self.server.add_secure_port(self.address, credentials))
        if self.bound_port == 0:
            raise RuntimeError(f"cannot listen on {self.address}")
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.stopping = asyncio.Event()
        self.started = False
        self.is_serving = False

    async def __aenter__(self) -> GrpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        """However the role ends (stopped, or failed before it served: a bad flag, a model that
        will not load), nothing is left listening."""
        await self.server.stop(None)

    async def start(self) -> None:
        """Listen: alive, not ready (the role's RPCs are refused until `ready()`)."""
        await self.server.start()
        self.started = True
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.set_serving(False)
        log.info("listening on %s (not ready yet)", self.address)

    async def ready(self, serving: bool = True) -> None:
        """The role can serve: its RPCs pass, and health turns SERVING (or stays NOT_SERVING while
        what it depends on is missing: `watch` turns it)."""
        self.gate.open = True
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        if serving and (self.stopping.is_set() or not self.gate.open):
            return  # draining, or not ready: stays NOT_SERVING
        self.is_serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    def watch(self, probe: Callable[[], Awaitable[bool]], what: str, interval_s: float = 1.0) -> asyncio.Task:
        """Keep health SERVING while `probe()` (what the role depends on) is true, NOT_SERVING while not."""
        async def follow() -> None:
            while not self.stopping.is_set():
                ok = await probe()
                if ok != self.is_serving and self.gate.open and not self.stopping.is_set():
                    log.warning("%s: %s; health %s", what, "yes" if ok else "no", "SERVING" if ok else "NOT_SERVING")
                await self.set_serving(ok)
                await asyncio.sleep(interval_s)

        return asyncio.create_task(follow(), name=f"readiness: {what}")

    async def run(self, grace_s: float, on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then drain and stop. A server not started yet starts ready."""
        if not self.started:
            await self.start()
            await self.ready()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        log.info("serving on %s", self.address)
        await self.stopping.wait()
        log.info("shutting down: health NOT_SERVING, draining in-flight work (grace %.0f s)", grace_s)
        await self.set_serving(False)
        if on_drain is not None:
            try:
                await asyncio.wait_for(on_drain(), timeout=grace_s)
            except asyncio.TimeoutError:
                log.warning("in-flight work did not finish within %.0f s", grace_s)
        await self.server.stop(grace=min(grace_s, 5.0))
        log.info("stopped")
