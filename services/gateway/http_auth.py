"""AuthMiddleware: the Authenticator in front of every HTTP route.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would get between the
handlers and the `http.disconnect` message they watch for). It checks every request, routes
added later and mounted apps included, except the operational endpoints `/health` and
`/metrics` unless the authenticator protects them (`--auth-metrics`). A refusal is answered here
in the OpenAI error shape (401 with `WWW-Authenticate: Bearer`, or 403); an accepted request's
`Principal` is left in the request state for the rate limiter (`principal_of`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.auth import Authenticator, Principal
from services.gateway.errors import ApiError

OPS_PATHS = frozenset({"/health", "/health/live", "/metrics"})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, auth: Authenticator):
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope.get("path") in OPS_PATHS and not self.auth.protect_ops):
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        client = scope.get("client")
        try:
            principal = self.auth.authenticate(header, client[0] if client else None)
        except ApiError as e:
            await JSONResponse(e.body(), status_code=e.status, headers=e.headers())(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def principal_of(request: Request) -> Principal | None:
    """The principal AuthMiddleware accepted for this request (None on open paths)."""
    return request.scope.get("state", {}).get("principal")
