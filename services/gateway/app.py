"""The HTTP API: an OpenAI-compatible FastAPI app over a `Gateway`.

Routes: POST /v1/completions, POST /v1/chat/completions (whole responses, or SSE streams with
`stream: true`), GET /v1/models, GET /v1/models/{id} (routes_openai), POST /infer (the original
API), GET /health (open unless --auth-metrics), GET /metrics (routes_ops). AuthMiddleware checks
credentials and the IP allowlist, and the Gateway's rate limits run once a request is validated.
Every error, FastAPI's own 404/405 included, is returned in the OpenAI shape
`{"error": {"message", "type", "param", "code"}}` (http_errors).

Generation routes run in one of the gateway's in-flight slots (`capped`, --max-concurrent-requests:
503 with Retry-After when none is free), freed when the response is ready or its SSE stream ends.
A client that disconnects cancels its scheduler call at once (http_io).
"""

from __future__ import annotations

from fastapi import FastAPI

from services.common.metrics import GatewayMetrics, HttpMetricsMiddleware, Registry
from services.common.tracing import fastapi_telemetry
from services.gateway.core import Gateway
from services.gateway.http_auth import AuthMiddleware
from services.gateway.http_errors import add_error_handlers
from services.gateway.routes_openai import add_openai_routes
from services.gateway.routes_ops import add_ops_routes


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

    app.add_middleware(AuthMiddleware, auth=gateway.auth)  # every route but /health and /metrics
    # Outside auth, so refusals are counted too (the last added runs first). `routes` is the
    # router's own list, so it sees the routes added below.
    metrics = metrics or gateway_metrics(gateway)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics, routes=app.router.routes)

    add_error_handlers(app, gateway)
    add_openai_routes(app, gateway)  # before the ops routes: route order is match and OpenAPI order
    add_ops_routes(app, gateway, metrics)
    return app
