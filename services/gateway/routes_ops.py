"""The original and operational routes: POST /infer, GET /health (readiness) and GET /health/live
(liveness), both open unless --auth-metrics, and GET /metrics."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.common.metrics import CONTENT_TYPE, GatewayMetrics
from services.gateway import openai_api
from services.gateway.core import Gateway
from services.gateway.errors import ApiError
from services.gateway.http_auth import principal_of
from services.gateway.http_io import CLIENT_CLOSED, DISCONNECTED, capped, log_done, read_json, until_disconnect


async def infer_once(gateway: Gateway, request: Request, limit: int) -> Response:
    """One /infer request: the whole text, its latency and usage."""
    req = openai_api.parse_infer(await read_json(request, limit))
    scheduler_request = await gateway.prepare(req, gateway.new_request_id("infer"), principal_of(request))
    started = time.perf_counter()
    done = await until_disconnect(request, gateway.collect(scheduler_request))
    if done is DISCONNECTED:
        return Response(status_code=CLIENT_CLOSED)
    done = done[0]  # /infer asks for one sample
    latency_ms = (time.perf_counter() - started) * 1000
    log_done(scheduler_request.request_id, done.finish_reason, done.usage, started)
    return JSONResponse(openai_api.infer_response(done.text, latency_ms, done.usage))


def add_ops_routes(app: FastAPI, gateway: Gateway, metrics: GatewayMetrics) -> None:
    """Register /infer, /health and /metrics over `gateway` and `metrics` on `app`."""
    limit = gateway.config.max_body_bytes

    @app.post("/infer")
    async def infer(request: Request) -> Response:
        return await capped(gateway, lambda slot: infer_once(gateway, request, limit))

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 200 while at least one scheduler replica serves, else 503 saying which not."""
        replicas = await gateway.scheduler.health()
        if any(replicas.values()):
            return JSONResponse({"status": "ok"})
        reason = "no scheduler replica is serving (" + ", ".join(f"{a}: not serving" for a in replicas) + ")"
        e = ApiError(503, reason, code="scheduler_unavailable", retry_after=1.0)
        return JSONResponse({"status": "unavailable", **e.body()}, status_code=503, headers=e.headers())

    @app.get("/health/live")
    async def live() -> JSONResponse:
        """Liveness: the process answers (a gateway waiting for its schedulers is alive, not ready)."""
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.registry.exposition(), media_type=CONTENT_TYPE)

