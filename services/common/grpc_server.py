"""gRPC server bootstrap shared by every role: grpc.aio server, the standard grpc.health.v1
health service, server reflection, and graceful shutdown on SIGTERM/SIGINT.

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


class GrpcServer:
    def __init__(self, host: str, port: int, service_names: list[str], keepalive_ms: int = KEEPALIVE_MS):
        self.server = grpc.aio.server(options=server_options(keepalive_ms))
        self.address = f"{host}:{port}"
        self.bound_port = self.server.add_insecure_port(self.address)
        if self.bound_port == 0:
            raise RuntimeError(f"cannot listen on {self.address}")
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    async def run(self, grace_s: float, on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then drain and stop."""
        await self.server.start()
        await self.set_serving(True)
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
