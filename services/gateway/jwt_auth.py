"""JwtVerifier: JWT bearer tokens, HS256 with a shared secret and/or RS256 with a public key.

The accepted algorithms are fixed by configuration: each configured key is bound to exactly one
algorithm (the secret to HS256, the RSA public key to RS256), and a token is verified with
`algorithms=[that one]`. The token's `alg` header only picks among those configured pairs, so
`alg: none`, an algorithm nobody configured, or an HS256 token "signed" with the RSA public key
(the HS/RS confusion attack) are refused before any signature is computed. `exp` and `nbf` are
checked when the token carries them, `aud` and `iss` when the server is configured with them
(a token that names an audience is refused by a server configured without one, RFC 7519 4.1.3);
every token must name its subject (`sub`), which is what rate limits are keyed by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key must be at least 256 bits


class TokenError(Exception):
    """A refused token: `reason` is a short counter label, the message is for the client."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# PyJWT's exceptions -> (reason, message prefix). Order matters: subclasses first.
_ERRORS: tuple[tuple[type[Exception], str, str], ...] = (
    (jwt.ExpiredSignatureError, "expired", "the token has expired"),
    (jwt.ImmatureSignatureError, "not_yet_valid", "the token is not valid yet (nbf or iat in the future)"),
    (jwt.InvalidAudienceError, "wrong_audience", "the token's audience (aud) is not accepted"),
    (jwt.InvalidIssuerError, "wrong_issuer", "the token's issuer (iss) is not accepted"),
    (jwt.MissingRequiredClaimError, "missing_claim", "the token lacks a required claim"),
    (jwt.InvalidSignatureError, "bad_signature", "the token's signature does not verify"),
    (jwt.InvalidAlgorithmError, "wrong_algorithm", "the token's algorithm is not accepted"),
    (jwt.DecodeError, "malformed", "the token is not a well-formed JWT"),
    (jwt.InvalidTokenError, "invalid", "the token is invalid"),
)


def load_public_key(value: str, param: str = "--jwt-public-key") -> rsa.RSAPublicKey:
    """An RSA public key from PEM text, or from the path of a PEM file."""
    text = value.strip()
    if "-----BEGIN" not in text:
        path = Path(text).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"{param}: not PEM text, and {path} cannot be read: {e.strerror or e}") from None
    try:
        key = load_pem_public_key(text.encode())
    except ValueError as e:
        raise ValueError(f"{param}: not a PEM public key ({e})") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError(f"{param}: RS256 needs an RSA public key, got {type(key).__name__}")
    if key.key_size < 2048:
        raise ValueError(f"{param}: the RSA key has {key.key_size} bits; RS256 needs at least 2048")
    return key


class JwtVerifier:
    """Verifies bearer JWTs against the configured (algorithm, key) pairs."""

    def __init__(self, secret: str | None = None, public_key: str | None = None,
                 audience: str | None = None, issuer: str | None = None, leeway: float = 0.0):
        self._keys: dict[str, Any] = {}
        if secret:
            if len(secret.encode()) < MIN_SECRET_BYTES:
                raise ValueError(f"--jwt-secret must be at least {MIN_SECRET_BYTES} bytes for HS256, "
                                 f"got {len(secret.encode())}")
            self._keys["HS256"] = secret.encode()
        if public_key:
            self._keys["RS256"] = load_public_key(public_key)
        if leeway < 0:
            raise ValueError(f"--jwt-leeway must be >= 0 seconds, got {leeway}")
        self.audience = audience or None
        self.issuer = issuer or None
        self.leeway = float(leeway)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def verify(self, token: str) -> dict[str, Any]:
        """The token's claims, or a TokenError saying why it is refused."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as e:
            raise TokenError("malformed", f"the token is not a well-formed JWT: {e}") from None
        alg = header.get("alg")
        if alg not in self._keys:
            raise TokenError("wrong_algorithm", f"the token's algorithm {alg!r} is not accepted; "
                             f"this server accepts {', '.join(self._keys)}")
        try:
            claims = jwt.decode(token, self._keys[alg], algorithms=[alg], audience=self.audience,
                                issuer=self.issuer, leeway=self.leeway,
                                options={"require": ["sub"], "verify_sub": True})
        except jwt.InvalidTokenError as e:
            for kind, reason, message in _ERRORS:
                if isinstance(e, kind):
                    raise TokenError(reason, f"{message}: {e}") from None
            raise  # unreachable: InvalidTokenError is the last entry
        if not isinstance(claims.get("sub"), str) or not claims["sub"]:
            raise TokenError("missing_claim", "the token's subject (sub) must be a non-empty string")
        return claims
