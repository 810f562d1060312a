"""HTTP exception handlers: every error, FastAPI's own 404/405 and validation errors included, is
answered in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.

Kept apart from errors.py, which the public gRPC API shares and which needs no FastAPI.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.core import Gateway
from services.gateway.errors import ApiError
from services.gateway.http_io import log


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def add_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    """Register the handlers rendering every failure on `app` as an OpenAI-shaped error."""

    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        gateway.count_refusal(e)
        return error_response(e)

    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            return error_response(ApiError(404, f"no route {request.method} {request.url.path}",
                                           code="not_found"))
        if e.status_code == 405:
            return error_response(ApiError(405, f"method {request.method} is not allowed on "
                                           f"{request.url.path}", code="method_not_allowed"))
        return error_response(ApiError(e.status_code, str(e.detail), code=None))

    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(ApiError(400, first.get("msg", "invalid request"), param=param,
                                       code="invalid_value"))

    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
