"""ApiError: one error type for both public APIs, rendered in the OpenAI shape over HTTP
(`{"error": {"message", "type", "param", "code"}}`) and as a status code over gRPC."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc

# HTTP status -> the OpenAI error `type` used for it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# HTTP status -> the gRPC status code the public gRPC API answers with.
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass(eq=False)  # exceptions compare and hash by identity
class ApiError(Exception):
    """A request failure with everything both APIs need to report it.

    `param` names the offending request parameter (OpenAI's convention), `code` is a short
    machine-readable reason such as "invalid_api_key" or "model_not_found". `retry_after`
    (seconds) is when a refused request may be retried: HTTP's Retry-After header, gRPC's
    `retry-after` trailing metadata.
    """

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.type is None:
            self.type = ERROR_TYPES.get(self.status, "internal_error" if self.status >= 500
                                        else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        """HTTP headers of the error response: WWW-Authenticate on 401, Retry-After (whole
        seconds, rounded up) when the request may be retried later."""
        out = {}
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            out["Retry-After"] = str(retry_seconds(self.retry_after))
        return out or None

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of the gRPC status (retry-after, in whole seconds)."""
        return (("retry-after", str(retry_seconds(self.retry_after))),) if self.retry_after is not None else ()

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL if self.status >= 500
                              else grpc.StatusCode.INVALID_ARGUMENT)

    @property
    def grpc_message(self) -> str:
        return f"{self.param}: {self.message}" if self.param and self.param not in self.message \
            else self.message


def retry_seconds(seconds: float) -> int:
    """Retry-After in whole seconds: rounded up, at least 1, so a client waiting that long is
    never early."""
    return max(1, math.ceil(seconds - 1e-9))


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    """A 400 naming the parameter at fault."""
    return ApiError(400, message, param=param, code=code)
