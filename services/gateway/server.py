"""serve_gateway: the gateway process, HTTP (uvicorn) and public gRPC in one asyncio event loop.

`GrpcServer` owns SIGTERM/SIGINT. On a signal its health turns NOT_SERVING, then the drain step
stops uvicorn (no new connections; responses and SSE streams in flight may finish) and waits for
in-flight gRPC calls, both within the grace period; then the gRPC server stops. uvicorn is kept
from installing signal handlers of its own, which would replace GrpcServer's and re-raise the
signal after its shutdown. If the HTTP server dies on its own, the gRPC server is stopped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import uvicorn

from services.common.grpc_server import GrpcServer
from services.common.logs import setup_logging
from services.common.settings import split_addrs
from services.common.tls import Tls
from services.gateway.app import create_app
from services.gateway.auth import Authenticator
from services.gateway.core import Gateway, GatewayConfig, input_limits, served_model_name
from services.gateway.public_grpc import SERVICE_NAME, GenerationServicer, add_to_server
from services.gateway.ratelimit import RateLimiter
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.tokenization import PromptTokenizer

log = logging.getLogger(__name__)

# Idle HTTP connections are kept longer than clients keep them (httpx and the openai client: 5 s,
# uvicorn's own default too): when both sides time out together, a client may send a request on
# the connection the server is closing and lose it (a ReadError seen once in the overload test).
KEEP_ALIVE_S = 75


class EmbeddedUvicorn(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the caller (uvicorn 0.29+ uses
    `capture_signals`, older versions `install_signal_handlers`)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


def bind_http_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port now, so that a taken port fails at startup with a clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise RuntimeError(f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}") from None


async def _serve_http(server: EmbeddedUvicorn, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as e:  # uvicorn exits the process on startup failures
        raise RuntimeError(f"the HTTP server failed to start (exit {e.code})") from None


async def _adopt_scheduler_context(gateway: Gateway) -> None:
    """Once a scheduler answers Info, keep prompts within its context if it is shorter."""
    info = await gateway.scheduler.info(timeout=10.0)
    if info is None:
        log.warning("no scheduler answered Info yet (%s); using the target's context of %d tokens",
                    ",".join(gateway.scheduler.addrs), gateway.context_length)
        return
    if 0 < info.max_positions < gateway.context_length:
        log.warning("the scheduler's context (%d) is shorter than the target config's (%d); using it",
                    info.max_positions, gateway.context_length)
        gateway.tokenizer.context_length = info.max_positions


def build_gateway(args, tls: Tls | None = None) -> Gateway:
    """The Gateway for the parsed gateway options (loads the target's tokenizer)."""
    name = served_model_name(args.target, getattr(args, "served_model_name", None)
                             or os.environ.get("SPECSERVE_SERVED_MODEL_NAME"))
    addrs = split_addrs(args.scheduler_addrs)
    if not addrs:
        raise ValueError("--scheduler-addrs is empty: the gateway needs at least one scheduler")
    config = GatewayConfig(model_name=name, target=args.target,
                           default_max_tokens=int(args.default_max_tokens), **input_limits(args))
    if config.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {config.default_max_tokens}")
    auth, limiter = Authenticator.from_args(args), RateLimiter.from_args(args)  # config errors first
    tls = Tls.from_args(args, "gateway") if tls is None else tls
    return Gateway(config, PromptTokenizer.load(args.target), SchedulerClient(addrs, tls.channel_credentials()),
                   auth, limiter)


async def serve_gateway(args) -> None:
    """Run the gateway until SIGTERM/SIGINT. `args` holds the gateway options of
    services.common.settings (host, port, http_port, target, scheduler_addrs, api_keys,
    default_max_tokens, log_level, log_format, grace_period, redis_url)."""
    setup_logging("gateway", args.log_level, args.log_format)
    grace = float(args.grace_period)
    tls = Tls.from_args(args, "gateway")
    gateway = build_gateway(args, tls)
    log.info("authentication: %s; rate limits: %s", gateway.auth.describe(),
             gateway.limiter.describe() if gateway.limiter else "none")

    grpc_server = GrpcServer(args.host, int(args.port), [SERVICE_NAME], credentials=tls.server_credentials())
    tls.watch_sighup()
    servicer = GenerationServicer(gateway)
    add_to_server(servicer, grpc_server.server)
    sock = bind_http_socket(args.host, int(args.http_port))
    http = EmbeddedUvicorn(uvicorn.Config(create_app(gateway), log_level="warning", log_config=None,
                                          access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
                                          timeout_graceful_shutdown=max(1, int(grace)), **tls.uvicorn_options()))
    http_task = asyncio.create_task(_serve_http(http, sock), name="gateway-http")

    async def drain() -> None:
        http.should_exit = True
        idle = asyncio.ensure_future(servicer.wait_idle())
        try:
            await asyncio.wait({http_task, idle})  # asyncio.wait never cancels what it waits for
        finally:
            idle.cancel()

    # gRPC health follows the schedulers (as GET /health does): SERVING while one of them serves.
    await grpc_server.start()
    await grpc_server.ready(serving=await gateway.healthy())
    readiness = grpc_server.watch(gateway.healthy, "a scheduler replica serving")
    grpc_task = asyncio.create_task(grpc_server.run(grace, drain), name="gateway-grpc")
    context_task = asyncio.create_task(_adopt_scheduler_context(gateway))
    log.info("gateway serving %r: HTTP on %s:%s, gRPC on %s, schedulers %s", gateway.model_name,
             args.host, args.http_port, grpc_server.address, ",".join(gateway.scheduler.addrs))
    try:
        await asyncio.wait({http_task, grpc_task}, return_when=asyncio.FIRST_COMPLETED)
        if http_task.done() and not grpc_server.stopping.is_set():
            log.error("the HTTP server stopped on its own; stopping the gRPC server")
            grpc_server.stopping.set()
        await asyncio.wait({grpc_task})
        if not http_task.done():  # the grace period ran out: drop what is left
            http.force_exit = True
            http.should_exit = True
            await asyncio.wait({http_task})
    finally:
        readiness.cancel()
        context_task.cancel()
        await gateway.scheduler.close()
        if gateway.limiter is not None:
            await gateway.limiter.close()
    for task in (grpc_task, http_task):
        task.result()  # re-raise a failure of either server
