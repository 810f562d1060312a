"""Gateway security on real processes: two gateway replicas (API keys, HS256 and RS256 JWTs, IP
allowlist, request and token limits, deny pattern, input limits) in front of the `stack`
fixture's scheduler, sharing its real Redis.

Every credential is accepted and every bad token refused over HTTP and gRPC; the request limit
is exact at the boundary and shared by the two replicas, and its Retry-After is honoured; the
token limit is exact at the boundary; every input error has its status, code and parameter."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid

import grpc
import httpx
import jwt
import pytest
import redis
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.stack import Stack, free_port

KEYS = ("sk-sec-one", "sk-sec-two")
SECRET = "integration-hs256-secret-0123456789abcdef"
AUD, ISS = "specserve-it", "https://issuer.it"
RATE, TOKENS = "4/20s", "60/h"  # 4 requests in a burst, then one per 5 s; 60 tokens, then one a minute
PROMPT = "w5 w6"  # 2 tokens


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(header: dict, claims: dict, hmac_key: bytes | None = None) -> str:
    head = b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())
    sig = hmac.new(hmac_key, head.encode(), hashlib.sha256).digest() if hmac_key else b""
    return head + "." + b64(sig)


def claims(sub: str, **extra) -> dict:
    now = int(time.time())
    return {"sub": sub, "aud": AUD, "iss": ISS, "iat": now, "exp": now + 600, **extra}


def rsa_pair():
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, pem


class Replica:
    def __init__(self, http_url: str, grpc_addr: str):
        self.http_url, self.grpc_addr = http_url, grpc_addr

    def post(self, path: str, body=None, token: str | None = None, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if content is not None:
            headers["Content-Type"] = "application/json"
        return httpx.post(self.http_url + path, json=body if content is None else None, content=content,
                          headers=headers, timeout=120)

    def grpc(self, token: str | None, prompt: str = PROMPT, max_tokens: int = 1):
        """The TextResponse, or the AioRpcError-like grpc.RpcError raised."""
        md = (("authorization", f"Bearer {token}"),) if token else ()
        with grpc.insecure_channel(self.grpc_addr) as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            try:
                return stub.Generate(gateway_pb2.TextRequest(prompt=prompt, params=common_pb2.SamplingParams(
                    max_tokens=max_tokens)), metadata=md, timeout=120)
            except grpc.RpcError as e:
                return e


@pytest.fixture(scope="module")
def secured(stack, tmp_path_factory):
    """Two gateway replicas with every security option on; yields (A, B, rsa private key, other key)."""
    root = tmp_path_factory.mktemp("secured")
    private, pem = rsa_pair()
    other_private, _ = rsa_pair()
    (root / "jwt.pem").write_text(pem)
    env = {**stack.stack.env, "SPECSERVE_API_KEYS": ",".join(KEYS), "SPECSERVE_JWT_SECRET": SECRET,
           "SPECSERVE_JWT_PUBLIC_KEY": str(root / "jwt.pem"), "SPECSERVE_JWT_AUDIENCE": AUD,
           "SPECSERVE_JWT_ISSUER": ISS, "SPECSERVE_IP_ALLOWLIST": "127.0.0.0/8,::1",
           "SPECSERVE_RATE_LIMIT": RATE, "SPECSERVE_TOKEN_LIMIT": TOKENS,
           "SPECSERVE_DENY_PATTERNS": r"\bw40\b", "SPECSERVE_MAX_PROMPT_TOKENS": "16",
           "SPECSERVE_MAX_REQUEST_BYTES": "4096"}
    st = Stack(root, env)
    replicas = []
    try:
        for _ in range(2):
            http_port = free_port()
            svc = st.start("gateway", "--target", str(stack.target), "--scheduler-addrs", stack.scheduler_addr,
                           "--http-port", str(http_port))
            replicas.append((svc, Replica(f"http://127.0.0.1:{http_port}", svc.addr)))
        for svc, replica in replicas:
            st.wait_healthy(svc)
            deadline = time.monotonic() + 60
            while httpx.get(replica.http_url + "/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, svc.log_tail()
                time.sleep(0.2)
        yield replicas[0][1], replicas[1][1], private, other_private
    finally:
        st.stop_all()


def hs(sub: str, **extra) -> str:
    return jwt.encode(claims(sub, **extra), SECRET, algorithm="HS256")


def test_every_credential_is_accepted_over_http_and_grpc(secured):
    a, b, private, _ = secured
    user = f"rs-{uuid.uuid4().hex[:8]}"
    for replica, token in ((a, KEYS[0]), (b, hs(f"hs-{uuid.uuid4().hex[:8]}")),
                           (a, jwt.encode(claims(user), private, algorithm="RS256"))):
        r = replica.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, token)
        assert r.status_code == 200, r.text
        assert replica.grpc(token).finish_reason  # a TextResponse, not an error
    assert a.post("/v1/models", token=None).status_code == 401
    assert httpx.get(a.http_url + "/health", timeout=10).status_code == 200  # open by default


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")
def test_every_bad_token_is_refused_over_http_and_grpc(secured):
    a, b, private, other_private = secured
    _, pem = rsa_pair()
    good = hs("mallory")
    head, _, sig = good.split(".")
    now = int(time.time())
    bad = {
        "expired": (hs("mallory", exp=now - 120), "expired_token", "expired"),
        "wrong audience": (hs("mallory", aud="another-service"), "invalid_token", "audience"),
        "wrong issuer": (hs("mallory", iss="https://evil.it"), "invalid_token", "issuer"),
        "wrong algorithm": (jwt.encode(claims("mallory"), SECRET, algorithm="HS512"), "invalid_token", "HS512"),
        "alg none": (forge({"alg": "none", "typ": "JWT"}, claims("mallory")), "invalid_token", "none"),
        "tampered signature": (f"{head}.{b64(json.dumps(claims('admin')).encode())}.{sig}", "invalid_token",
                               "signature"),
        "wrong HS key": (jwt.encode(claims("mallory"), "y" * 48, algorithm="HS256"), "invalid_token", "signature"),
        "wrong RS key": (jwt.encode(claims("mallory"), other_private, algorithm="RS256"), "invalid_token",
                         "signature"),
        "HS/RS confusion": (forge({"alg": "HS256"}, claims("mallory"), hmac_key=pem.encode()), "invalid_token",
                            "signature"),
        "wrong API key": ("sk-sec-three", "invalid_api_key", "API key"),
    }
    for name, (token, code, words) in bad.items():
        r = a.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, token)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (name, r.text)
        e = r.json()["error"]
        assert e["code"] == code and e["type"] == "authentication_error" and words in e["message"], (name, e)
        refused = b.grpc(token)
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert words in refused.details(), (name, refused.details())


def test_request_limit_is_exact_and_shared_by_both_replicas_and_retry_after_is_honoured(secured, redis_url):
    a, b, _, _ = secured
    sub = f"shared-{uuid.uuid4().hex[:8]}"
    token = hs(sub)
    body = {"prompt": PROMPT, "max_tokens": 1}
    codes = [replica.post("/v1/completions", body, token).status_code for replica in (a, b, a, b)]
    assert codes == [200] * 4
    over_a = a.post("/v1/completions", body, token)
    over_b = b.grpc(token)
    assert over_a.status_code == 429 and over_a.json()["error"]["code"] == "rate_limit_requests"
    assert over_a.json()["error"]["type"] == "rate_limit_error"
    assert isinstance(over_b, grpc.RpcError) and over_b.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = int(over_a.headers["retry-after"])
    assert 1 <= retry_after <= 5  # one emission interval: 20 s / 4
    assert int(dict(over_b.trailing_metadata())["retry-after"]) <= 5
    time.sleep(retry_after)
    assert b.post("/v1/completions", body, token).status_code == 200  # honoured: admitted again
    assert a.post("/v1/completions", body, token).status_code == 429  # and only one
    r = redis.Redis.from_url(redis_url)  # the stack's Redis, which both replicas use
    keys = [k.decode() for k in r.scan_iter("specserve:ratelimit:*")]
    assert f"specserve:ratelimit:{{sub:{sub}}}:requests" in keys
    assert not any(key in k for k in keys for key in KEYS)  # API keys appear only as digests


def test_token_limit_is_exact_at_the_boundary(secured):
    a, b, private, _ = secured
    token = jwt.encode(claims(f"tok-{uuid.uuid4().hex[:8]}"), private, algorithm="RS256")
    first = a.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 38, "ignore_eos": True}, token)
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] == 2  # 40 tokens charged
    over = b.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 19}, token)  # 61 > 60
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_tokens"
    assert 50 <= int(over.headers["retry-after"]) <= 60  # 1 token too many: a minute at 60 per hour
    exact = b.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 18}, token)  # exactly 60
    assert exact.status_code == 200, exact.text
    too_big = a.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 59}, token)
    assert too_big.status_code == 429 and too_big.json()["error"]["code"] == "tokens_exceed_limit"
    assert "retry-after" not in too_big.headers and too_big.json()["error"]["param"] == "max_tokens"


def test_every_input_error_has_its_status_and_parameter(secured):
    a, b, _, _ = secured
    key = KEYS[1]
    cases = [
        (dict(body={"prompt": "w5 w40 w6"}), 400, "prompt", "prompt_denied"),
        (dict(body={"messages": [{"role": "user", "content": "w40"}]}), 400, "messages[0].content",
         "prompt_denied"),
        (dict(body={"prompt": " ".join(["w7"] * 17)}), 400, "prompt", "prompt_too_long"),
        (dict(content=b'{"prompt": "' + b"w5 " * 1400 + b'"}'), 413, None, "body_too_large"),
        (dict(content=b'{"prompt": "w5 \xc3\x28"}'), 400, None, "invalid_utf8"),
        (dict(content=b'{"prompt": "w5 \\udc80"}'), 400, "prompt", "invalid_utf8"),
        (dict(body={"prompt": PROMPT, "model": "gpt-4"}), 404, "model", "model_not_found"),
        (dict(body={"prompt": PROMPT, "temperature": 9}), 400, "temperature", "invalid_value"),
        (dict(body={"prompt": PROMPT, "top_p": 0}), 400, "top_p", "invalid_value"),
        (dict(body={"prompt": PROMPT, "max_tokens": 10_000}), 400, "max_tokens", "context_length_exceeded"),
    ]
    for kw, status, param, code in cases:
        path = "/v1/chat/completions" if "messages" in (kw.get("body") or {}) else "/v1/completions"
        r = a.post(path, token=key, **kw)
        assert r.status_code == status, (kw, r.text)
        e = r.json()["error"]
        assert (e["param"], e["code"]) == (param, code) and e["message"], (kw, e)
        if param:
            assert param in e["message"], e
    denied = b.grpc(key, prompt="w40 w5")
    assert isinstance(denied, grpc.RpcError) and denied.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deny pattern" in denied.details()
