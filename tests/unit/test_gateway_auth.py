"""Authentication: API keys, JWTs (HS256, RS256) and the IP allowlist, alone and behind the HTTP
app and the public gRPC API. Every refusal path of a JWT is a real token built here."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time

import grpc
import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys, Authenticator, IpAllowlist, parse_bool
from services.gateway.errors import ApiError
from services.gateway.jwt_auth import JwtVerifier, TokenError
from services.gateway.public_grpc import peer_host
from tests.unit.test_gateway_http import KEY, make_gateway
from tests.unit.test_gateway_scheduler_client import running_fake

SECRET = "an-hs256-secret-of-at-least-32-bytes!"
AUD, ISS = "specserve", "https://issuer.test"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(header: dict, claims: dict, signature: bytes | None = None, hmac_key: bytes | None = None) -> str:
    """A JWT assembled by hand (PyJWT refuses to make the malicious ones)."""
    head = b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())
    if hmac_key is not None:
        signature = hmac.new(hmac_key, head.encode(), hashlib.sha256).digest()
    return head + "." + b64(signature or b"")


def claims(**extra) -> dict:
    now = int(time.time())
    return {"sub": "alice", "aud": AUD, "iss": ISS, "iat": now, "exp": now + 300, **extra}


@pytest.fixture(scope="module")
def rsa_keys():
    def pair():
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
        return private, public.decode()
    return pair(), pair()  # the configured pair, and another one


@pytest.fixture(scope="module")
def verifier(rsa_keys):
    (_, public), _ = rsa_keys
    return JwtVerifier(SECRET, public, audience=AUD, issuer=ISS)


def reason(verifier: JwtVerifier, token: str) -> str:
    with pytest.raises(TokenError) as e:
        verifier.verify(token)
    assert str(e.value)
    return e.value.reason


def test_valid_hs256_and_rs256_tokens_are_accepted(verifier, rsa_keys):
    (private, _), _ = rsa_keys
    assert verifier.algorithms == ("HS256", "RS256")
    assert verifier.verify(jwt.encode(claims(), SECRET, algorithm="HS256"))["sub"] == "alice"
    assert verifier.verify(jwt.encode(claims(sub="bob"), private, algorithm="RS256"))["sub"] == "bob"
    # aud may be a list holding ours; nbf in the past is fine
    assert verifier.verify(jwt.encode(claims(aud=["x", AUD], nbf=int(time.time()) - 5), SECRET,
                                      algorithm="HS256"))["sub"] == "alice"


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")  # HS384 with our secret
def test_every_refusal_has_its_reason(verifier, rsa_keys):
    (private, public), (other_private, _) = rsa_keys
    now = int(time.time())
    hs = jwt.encode(claims(), SECRET, algorithm="HS256")
    head, body, sig = hs.split(".")
    tampered_body = b64(json.dumps(claims(sub="admin")).encode())
    cases = {
        "expired": jwt.encode(claims(exp=now - 60), SECRET, algorithm="HS256"),
        "not_yet_valid": jwt.encode(claims(nbf=now + 600), SECRET, algorithm="HS256"),
        "wrong_audience": jwt.encode(claims(aud="someone-else"), SECRET, algorithm="HS256"),
        "wrong_issuer": jwt.encode(claims(iss="https://evil.test"), SECRET, algorithm="HS256"),
        "missing_claim": jwt.encode({k: v for k, v in claims().items() if k != "sub"}, SECRET, algorithm="HS256"),
        # the algorithm is never taken from the token
        "wrong_algorithm": jwt.encode(claims(), SECRET, algorithm="HS384"),
        "bad_signature": f"{head}.{tampered_body}.{sig}",  # payload changed, signature kept
        "malformed": "not.a.jwt",
    }
    for want, token in cases.items():
        assert reason(verifier, token) == want, want
    # a signature flipped in its last bytes
    assert reason(verifier, hs[:-4] + ("AAAA" if not hs.endswith("AAAA") else "BBBB")) == "bad_signature"
    # signed with the wrong key: another HS256 secret, another RSA key pair
    assert reason(verifier, jwt.encode(claims(), "x" * 40, algorithm="HS256")) == "bad_signature"
    assert reason(verifier, jwt.encode(claims(), other_private, algorithm="RS256")) == "bad_signature"


def test_alg_none_is_refused_with_or_without_a_signature(verifier):
    assert reason(verifier, forge({"alg": "none", "typ": "JWT"}, claims())) == "wrong_algorithm"
    assert reason(verifier, forge({"alg": "None"}, claims(), b"sig")) == "wrong_algorithm"
    assert reason(verifier, forge({"typ": "JWT"}, claims())) == "wrong_algorithm"  # no alg at all


def test_hs_rs_confusion_is_refused(rsa_keys):
    """An HS256 token whose HMAC key is the server's RSA public key (which is public)."""
    (_, public), _ = rsa_keys
    rs_only = JwtVerifier(public_key=public, audience=AUD, issuer=ISS)
    both = JwtVerifier(SECRET, public, audience=AUD, issuer=ISS)
    token = forge({"alg": "HS256", "typ": "JWT"}, claims(), hmac_key=public.encode())
    assert reason(rs_only, token) == "wrong_algorithm"  # HS256 is not configured at all
    assert reason(both, token) == "bad_signature"  # HS256 verifies with the secret, never the PEM
    rs_token = forge({"alg": "RS256"}, claims(), hmac_key=public.encode())
    assert reason(rs_only, rs_token) == "bad_signature"
    hs_only = JwtVerifier(SECRET)
    assert reason(hs_only, forge({"alg": "RS256"}, claims(), b"x" * 256)) == "wrong_algorithm"


def test_audience_and_issuer_are_checked_only_when_configured():
    plain = JwtVerifier(SECRET)
    assert plain.verify(jwt.encode({"sub": "a", "iss": "anyone"}, SECRET, algorithm="HS256"))["sub"] == "a"
    # a token meant for a named audience is not accepted by a server that names none (RFC 7519)
    assert reason(plain, jwt.encode({"sub": "a", "aud": "x"}, SECRET, algorithm="HS256")) == "wrong_audience"
    # without exp a token does not expire; a configured leeway tolerates skew
    assert plain.verify(jwt.encode({"sub": "a"}, SECRET, algorithm="HS256"))
    lenient = JwtVerifier(SECRET, leeway=120)
    assert lenient.verify(jwt.encode({"sub": "a", "exp": int(time.time()) - 60}, SECRET, algorithm="HS256"))


def test_bad_jwt_configuration_is_refused_at_startup(tmp_path, rsa_keys):
    with pytest.raises(ValueError, match="--jwt-secret must be at least 32 bytes"):
        JwtVerifier("short")
    with pytest.raises(ValueError, match="--jwt-public-key: not PEM text"):
        JwtVerifier(public_key=str(tmp_path / "missing.pem"))
    ec_pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with pytest.raises(ValueError, match="RS256 needs an RSA public key"):
        JwtVerifier(public_key=ec_pem)
    (_, public), _ = rsa_keys
    path = tmp_path / "key.pem"
    path.write_text(public)
    assert JwtVerifier(public_key=str(path)).algorithms == ("RS256",)  # a path works too


def test_api_keys_compare_digests_and_subjects_never_hold_the_key():
    auth = Authenticator(ApiKeys.from_setting("sk-a, sk-b"))
    p = auth.authenticate("Bearer sk-b", "127.0.0.1")
    assert p.kind == "api_key" and p.subject == "key:" + hashlib.sha256(b"sk-b").hexdigest()
    assert "sk-b" not in p.subject
    assert auth.authenticate("bearer  sk-a ", None).subject != p.subject
    for header, status, code, why in [(None, 401, "missing_api_key", "missing"),
                                      ("Bearer sk-c", 401, "invalid_api_key", "invalid_api_key"),
                                      ("Basic sk-a", 401, "invalid_api_key", "malformed_header"),
                                      ("Bearer", 401, "invalid_api_key", "malformed_header")]:
        with pytest.raises(ApiError) as e:
            auth.authenticate(header, "127.0.0.1")
        assert (e.value.status, e.value.code, e.value.type) == (status, code, "authentication_error")
    assert auth.failures == {"missing": 1, "invalid_api_key": 1, "malformed_header": 2}


def test_keys_and_tokens_together(verifier):
    auth = Authenticator(ApiKeys([KEY]), verifier)
    assert auth.authenticate(f"Bearer {KEY}", None).kind == "api_key"
    p = auth.authenticate("Bearer " + jwt.encode(claims(sub="carol@example.com"), SECRET, algorithm="HS256"), None)
    assert (p.kind, p.subject) == ("jwt", "sub:carol@example.com")
    odd = auth.authenticate("Bearer " + jwt.encode(claims(sub="{weird} sub"), SECRET, algorithm="HS256"), None)
    assert odd.subject == "sub:" + hashlib.sha256(b"{weird} sub").hexdigest()  # no braces in Redis keys
    with pytest.raises(ApiError) as e:
        auth.authenticate("Bearer " + jwt.encode(claims(exp=1), SECRET, algorithm="HS256"), None)
    assert e.value.status == 401 and e.value.code == "expired_token" and "expired" in e.value.message
    with pytest.raises(ApiError) as e:
        auth.authenticate("Bearer sk-nope", None)
    assert e.value.code == "invalid_api_key"
    assert auth.failures == {"expired": 1, "invalid_api_key": 1}


def test_ip_allowlist():
    allow = IpAllowlist.from_setting("10.0.0.0/8, 192.168.1.7, ::1")
    assert allow.allows("10.2.3.4") and allow.allows("192.168.1.7") and allow.allows("::1")
    assert allow.allows("::ffff:10.9.9.9")  # IPv4-mapped IPv6
    assert not allow.allows("192.168.1.8") and not allow.allows("11.0.0.1") and not allow.allows(None)
    assert not allow.allows("not-an-ip")
    assert IpAllowlist.from_setting(None).allows(None)
    with pytest.raises(ValueError, match="--ip-allowlist: '10.0.0.0/33'"):
        IpAllowlist.from_setting("10.0.0.0/33")
    auth = Authenticator(allowlist=allow)
    assert auth.authenticate(None, "10.1.1.1").subject == "ip:10.1.1.1"  # no credentials configured
    with pytest.raises(ApiError) as e:
        auth.authenticate(None, "8.8.8.8")
    assert (e.value.status, e.value.code, e.value.type) == (403, "ip_not_allowed", "permission_error")
    assert e.value.grpc_code == grpc.StatusCode.PERMISSION_DENIED
    assert "8.8.8.8" in e.value.message and auth.failures == {"ip_not_allowed": 1}


def test_grpc_peer_addresses():
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("unix:/tmp/sock") is None and peer_host(None) is None


def test_parse_bool():
    assert parse_bool("true", "--x") and parse_bool("1", "--x") and not parse_bool("false", "--x")
    assert not parse_bool(None, "--x")
    with pytest.raises(ValueError, match="--auth-metrics must be true or false"):
        parse_bool("maybe", "--auth-metrics")


# --- behind the HTTP app and the public gRPC API -------------------------------------------------


def http_run(auth: Authenticator, scenario, client_host: str = "127.0.0.1"):
    async def go():
        async with running_fake() as (fake, addr):
            gw = make_gateway([addr])
            gw.auth = auth
            app = create_app(gw)

            if not any(getattr(r, "path", None) == "/metrics" for r in app.routes):
                @app.get("/metrics")  # stands in for the metrics module's route
                async def metrics() -> dict:
                    return {"ok": True}

            transport = httpx.ASGITransport(app=app, client=(client_host, 1234))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                out = await scenario(client)
            await gw.scheduler.close()
            return out, fake.requests
    return asyncio.run(go())


def test_http_jwt_and_keys(verifier):
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    expired = jwt.encode(claims(exp=1), SECRET, algorithm="HS256")
    none = forge({"alg": "none"}, claims())
    auth = Authenticator(ApiKeys([KEY]), verifier)

    async def s(client):
        body = {"prompt": "w5", "max_tokens": 2}
        out = []
        for cred in (token, KEY, expired, none, "sk-wrong"):
            out.append(await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {cred}"}))
        out.append(await client.get("/health"))
        out.append(await client.get("/metrics"))
        out.append(await client.get("/v1/nothing"))  # unknown routes are not open either
        return out
    (ok_jwt, ok_key, exp, alg_none, wrong, health, metrics, nothing), reqs = http_run(auth, s)
    assert ok_jwt.status_code == 200 and ok_key.status_code == 200 and len(reqs) == 2
    for r, code in ((exp, "expired_token"), (alg_none, "invalid_token"), (wrong, "invalid_api_key"),
                    (nothing, "missing_api_key")):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "authentication_error"
    assert "none" in alg_none.json()["error"]["message"]
    assert health.status_code == 200 and metrics.status_code == 200  # open by default


def test_http_auth_metrics_protects_health_and_metrics():
    auth = Authenticator(ApiKeys([KEY]), protect_ops=True)

    async def s(client):
        return [await client.get("/health"), await client.get("/metrics"),
                await client.get("/health", headers={"Authorization": f"Bearer {KEY}"})]
    (health, metrics, ok), _ = http_run(auth, s)
    assert health.status_code == 401 and metrics.status_code == 401 and ok.status_code == 200


def test_http_ip_allowlist_is_403():
    auth = Authenticator(ApiKeys([KEY]), allowlist=IpAllowlist(["10.0.0.0/8"]))

    async def s(client):
        return [await client.post("/v1/completions", json={"prompt": "w5"},
                                  headers={"Authorization": f"Bearer {KEY}"}),
                await client.get("/health")]
    (refused, health), reqs = http_run(auth, s, client_host="192.0.2.1")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "ip_not_allowed"
    assert health.status_code == 200 and reqs == []
    (ok, _), reqs = http_run(auth, s, client_host="10.0.0.5")
    assert ok.status_code == 200 and len(reqs) == 1


def test_grpc_jwt_and_allowlist(verifier, rsa_keys):
    from tests.unit.test_gateway_grpc import public_api, text_request

    (private, _), _ = rsa_keys
    good = jwt.encode(claims(), private, algorithm="RS256")
    wrong_aud = jwt.encode(claims(aud="other"), private, algorithm="RS256")

    async def go(auth: Authenticator):
        async with public_api(keys=()) as (stub, fake, servicer):
            servicer.gateway.auth = auth
            out = []
            for token in (good, wrong_aud, None):
                md = (("authorization", f"Bearer {token}"),) if token else ()
                try:
                    await stub.Generate(text_request(max_tokens=2), metadata=md, timeout=10)
                    out.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
            return out, len(fake.requests)

    (ok, aud, missing), n = asyncio.run(go(Authenticator(jwt=verifier)))
    assert ok == grpc.StatusCode.OK and n == 1
    assert aud[0] == grpc.StatusCode.UNAUTHENTICATED and "audience" in aud[1]
    assert missing[0] == grpc.StatusCode.UNAUTHENTICATED
    blocked = Authenticator(jwt=verifier, allowlist=IpAllowlist(["10.0.0.0/8"]))
    results, n = asyncio.run(go(blocked))
    assert all(r[0] == grpc.StatusCode.PERMISSION_DENIED for r in results) and n == 0
