"""Authenticator: who may call the gateway, checked the same way for HTTP and gRPC.

Three independent mechanisms, each off unless configured:

- `ApiKeys`: bearer API keys. Only sha256 digests of the configured keys are kept. A presented
  key is hashed and compared with every stored digest using `hmac.compare_digest` (no early
  exit), so the time a check takes does not reveal which key, or how much of one, matched.
- `JwtVerifier` (jwt_auth.py): bearer JWTs, HS256 and/or RS256 with fixed algorithms.
- `IpAllowlist`: the client's address must be in one of the configured networks (403 otherwise).

A request that passes gets a `Principal`, whose `subject` keys its rate limits: `key:<sha256 of
the key>` (never the raw key), `sub:<the JWT's sub>`, or `ip:<address>` when no credentials are
configured. Refusals are `ApiError`s: 401 for missing or bad credentials (with the reason in the
message), 403 for an address outside the allowlist; `failures[reason]` counts them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from services.gateway.errors import ApiError
from services.gateway.jwt_auth import JwtVerifier, TokenError

_SAFE_SUB = re.compile(r"[A-Za-z0-9._@|+=-]{1,128}")  # used verbatim in Redis keys; else hashed


def parse_bool(value: str | bool | None, param: str) -> bool:
    if isinstance(value, bool):
        return value
    text = (value or "").strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{param} must be true or false, got {value!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._digests = [_digest(k) for k in keys if k]

    @classmethod
    def from_setting(cls, value: str | None) -> "ApiKeys":
        """From SPECSERVE_API_KEYS: comma-separated keys; unset or empty = no API keys."""
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
        if self.enabled:
            Authenticator(self).authenticate(header, None)


class IpAllowlist:
    """Client networks allowed to call the gateway (CIDRs or single addresses, v4 and v6)."""

    def __init__(self, networks: Iterable[str] = (), param: str = "--ip-allowlist"):
        self.networks = []
        for text in networks:
            try:
                self.networks.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                raise ValueError(f"{param}: {text.strip()!r} is not an IP network (e.g. 10.0.0.0/8)") from None

    @classmethod
    def from_setting(cls, value: str | None) -> "IpAllowlist":
        """From SPECSERVE_IP_ALLOWLIST: comma-separated CIDRs; unset or empty = any address."""
        return cls(n for n in (value or "").split(",") if n.strip())

    @property
    def enabled(self) -> bool:
        return bool(self.networks)

    def allows(self, host: str | None) -> bool:
        if not self.enabled:
            return True
        try:
            addr = ipaddress.ip_address((host or "").strip("[]"))
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.networks if net.version == addr.version)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: `subject` keys its rate limits; `kind` is api_key, jwt or anonymous."""

    subject: str
    kind: str


class Authenticator:
    """API keys, JWTs and the IP allowlist together; `authenticate` is the one check."""

    def __init__(self, keys: ApiKeys | None = None, jwt: JwtVerifier | None = None,
                 allowlist: IpAllowlist | None = None, protect_ops: bool = False):
        self.keys = keys or ApiKeys()
        self.jwt = jwt if jwt is not None and jwt.enabled else None
        self.allowlist = allowlist or IpAllowlist()
        self.protect_ops = protect_ops  # whether /health and /metrics need credentials too
        self.failures: Counter[str] = Counter()  # refusals by reason (missing, invalid_api_key, expired, ...)

    @classmethod
    def from_args(cls, args) -> "Authenticator":
        """From the gateway options (--api-keys, --jwt-*, --ip-allowlist, --auth-metrics)."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        try:
            leeway = float(get("jwt_leeway") or 0)
        except ValueError:
            raise ValueError(f"--jwt-leeway must be a number of seconds, got {get('jwt_leeway')!r}") from None
        return cls(ApiKeys.from_setting(get("api_keys")),
                   JwtVerifier(get("jwt_secret"), get("jwt_public_key"), get("jwt_audience"),
                               get("jwt_issuer"), leeway),
                   IpAllowlist.from_setting(get("ip_allowlist")),
                   parse_bool(get("auth_metrics", "false"), "--auth-metrics"))

    def describe(self) -> str:
        """What is checked, for the startup log."""
        parts = [f"{len(self.keys._digests)} API keys"] if self.keys.enabled else []
        parts += [f"JWT ({', '.join(self.jwt.algorithms)})"] if self.jwt is not None else []
        parts += [f"IP allowlist ({len(self.allowlist.networks)} networks)"] if self.allowlist.enabled else []
        return " + ".join(parts) + (" (also on /health, /metrics)" if self.protect_ops else "") if parts else "open"

    @property
    def requires_credentials(self) -> bool:
        return self.keys.enabled or self.jwt is not None

    def _refuse(self, status: int, reason: str, message: str, code: str) -> ApiError:
        self.failures[reason] += 1
        return ApiError(status, message, code=code)

    def authenticate(self, authorization: str | None, client_host: str | None) -> Principal:
        """The principal of a request with this Authorization header value from this client
        address, or a 401/403 ApiError."""
        if not self.allowlist.allows(client_host):
            raise self._refuse(403, "ip_not_allowed", f"the client address {client_host or '(unknown)'} "
                               "is not in the gateway's IP allowlist", "ip_not_allowed")
        if not self.requires_credentials:
            return Principal(f"ip:{client_host or 'unknown'}", "anonymous")
        what = "KEY" if self.jwt is None else ("TOKEN" if not self.keys.enabled else "KEY or TOKEN")
        if not authorization:
            raise self._refuse(401, "missing", f"missing credentials: send the header "
                               f"'Authorization: Bearer {what}'", "missing_api_key")
        scheme, _, credential = authorization.strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise self._refuse(401, "malformed_header", f"malformed Authorization header: expected "
                               f"'Bearer {what}'", "invalid_api_key")
        if self.keys.enabled and self.keys.matches(credential):
            return Principal("key:" + _digest(credential).hex(), "api_key")
        if self.jwt is not None and credential.count(".") == 2:
            try:
                claims = self.jwt.verify(credential)
            except TokenError as e:
                code = "expired_token" if e.reason == "expired" else "invalid_token"
                raise self._refuse(401, e.reason, str(e), code) from None
            sub = claims["sub"]
            ident = sub if _SAFE_SUB.fullmatch(sub) else hashlib.sha256(sub.encode()).hexdigest()
            return Principal(f"sub:{ident}", "jwt")
        if self.keys.enabled:
            raise self._refuse(401, "invalid_api_key", "incorrect API key provided", "invalid_api_key")
        raise self._refuse(401, "malformed", "the bearer token is not a JWT", "invalid_token")
