"""ApiKeys: bearer API keys, checked the same way for HTTP and gRPC.

Only sha256 digests of the configured keys are kept. A presented key is hashed and compared
with every stored digest using `hmac.compare_digest` (no early exit), so the time a check takes
does not reveal which key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from services.gateway.errors import ApiError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._digests = [_digest(k) for k in keys if k]

    @classmethod
    def from_setting(cls, value: str | None) -> "ApiKeys":
        """From SPECSERVE_API_KEYS: comma-separated keys; unset or empty = no auth."""
        return cls(k.strip() for k in (value or "").split(",") if k.strip())

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def matches(self, key: str) -> bool:
        presented = _digest(key)
        found = False
        for stored in self._digests:
            found |= hmac.compare_digest(presented, stored)
        return found

    def check_authorization(self, header: str | None) -> None:
        """Accept an `Authorization: Bearer KEY` header value, else raise a 401 ApiError.

        Does nothing when no keys are configured.
        """
        if not self.enabled:
            return
        if not header:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="missing_api_key")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "malformed Authorization header: expected 'Bearer KEY'",
                           code="invalid_api_key")
        if not self.matches(key.strip()):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
