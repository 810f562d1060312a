"""Fuzzing the gateway's HTTP JSON API against the real stack (hypothesis).

Bodies for POST /v1/completions, /v1/chat/completions and /infer: random JSON values, random
bytes, and near-valid bodies (a valid body with one field replaced by a random, wrong-typed or
extreme value, or an unknown field added). Whatever comes in, the gateway must answer with a
documented status (never a 5xx), errors in the OpenAI shape, 200 streams ending with
`data: [DONE]` and no error frame, and stay healthy without holding any request afterwards.
Explicit cases: nesting beyond MAX_JSON_DEPTH, bodies beyond --max-request-bytes (declared or
chunked), invalid UTF-8.

SPECSERVE_FUZZ_EXAMPLES sets the examples per property (default 100; derandomized, so a run is
reproducible); a longer run by hand: SPECSERVE_FUZZ_EXAMPLES=1000 pytest -s tests/integration/test_fuzz_*.py
(-s prints the requests per test and status).
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections import Counter, defaultdict

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.validation import MAX_JSON_DEPTH
from specserve.v1 import common_pb2, draft_pb2_grpc, scheduler_pb2_grpc, verifier_pb2_grpc
from tests.integration.fuzzing import FUZZ

# What the HTTP API may answer (README): 413 only for size, 429 only for limits; never a 5xx.
DOCUMENTED = {200, 400, 401, 404, 413, 422, 429}
ERROR_KEYS = {"message", "type", "param", "code"}
MAX_BODY = 2 * 1024 * 1024  # the stack gateway's --max-request-bytes (the default)
PATHS = ("/v1/completions", "/v1/chat/completions", "/infer")
OUTCOMES: defaultdict[str, Counter] = defaultdict(Counter)  # test -> status -> requests (-s prints it)

BASES = {  # valid bodies, cheap to generate from (max 4 tokens)
    "/v1/completions": {"prompt": "w5 w6 w7", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4},
    "/infer": {"input": "w5 w6 w7", "max_length": 4},
}
_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer"]),
    "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                     "text": st.text(max_size=10)}), max_size=2)}),
    min_size=1, max_size=3)
_COMMON = {  # valid values of the fields completions and chat share
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0), "top_k": st.integers(-1, 100),
    "seed": st.integers(-(2**63), 2**63 - 1), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "draft_length": st.integers(0, 64), "tree_size": st.integers(0, 256), "n": st.just(1),
    "model": st.sampled_from(["target", ""]), "return_token_ids": st.booleans(), "user": st.text(max_size=20),
    "logit_bias": st.just({}), "max_tokens": st.integers(1, 8),
}
VALID = {  # each route's fields and valid values for them (max_tokens <= 8: cheap to serve)
    "/v1/completions": {**_COMMON, "prompt": st.text(min_size=1, max_size=40) | st.sampled_from(["w5", ["w5 w6"]])
                        | st.lists(st.integers(0, 63), min_size=1, max_size=8), "echo": st.just(False),
                        "logprobs": st.none() | st.integers(0, 20),
                        "best_of": st.just(1), "suffix": st.just("")},
    "/v1/chat/completions": {**_COMMON, "messages": _MESSAGES, "max_completion_tokens": st.integers(1, 8),
                             "tools": st.just([]), "tool_choice": st.just("none"),
                             "response_format": st.just({"type": "text"}), "top_logprobs": st.just(0),
                             "logprobs": st.booleans(),
                             "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)},
    "/infer": {"input": st.text(min_size=1, max_size=40), "max_length": st.integers(1, 8)},
}
UNKNOWN_FIELDS = st.sampled_from(["functions", "prompt_ids", "", "max_tokens ", "\u00e9", "__proto__"])

# -- strategies ---------------------------------------------------------------------------------
huge_ints = st.sampled_from([2**31, 2**31 - 1, -(2**31) - 1, 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**30,
                             -(10**30), 10**4000])
odd_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e-320, 1e308, 2.0000001])
odd_strings = st.sampled_from(["", "NaN", "Infinity", "-1", "1e309", "0x10", "true", "null", "w5", "\ud800",
                               "\udc80w5", "\x00", "w5 " * 3000, "x" * 100_000, "<s></s>", "{{ 7*7 }}"])
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40)
           | huge_ints | odd_floats | odd_strings)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=5)
                           | st.dictionaries(st.text(max_size=10), kids, max_size=5), max_leaves=20)
# Values a field may take: mostly odd ones; small positive ints so valid max_tokens stay cheap.
field_values = (json_values | st.integers(-3, 8) | huge_ints | odd_floats | odd_strings
                | st.lists(st.integers(-(2**33), 2**33), max_size=6)
                | st.lists(st.integers(0, 63), min_size=1, max_size=6)
                | st.just([]) | st.just({}) | st.just([[5, 6]]) | st.just(["w5 w6"])
                | st.just({"include_usage": True}) | st.just([{"role": "user", "content": "w5"}])
                | st.just([{"role": "user", "content": [{"type": "text", "text": "w5"}]}])
                | st.just([{"role": "tool", "content": "w5"}]) | st.just([{"role": "user"}]))


@st.composite
def near_valid(draw):
    """(path, body): a valid body with up to two more valid fields, then one field set to a
    fuzzed value, to a valid one, or an unknown field added."""
    path = draw(st.sampled_from(PATHS))
    valid = VALID[path]
    body = json.loads(json.dumps(BASES[path]))
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=2, unique=True)):
        body[name] = draw(valid[name])
    mode = draw(st.sampled_from(["valid", "wild", "wild", "unknown"]))
    if mode == "unknown":
        body[draw(UNKNOWN_FIELDS)] = draw(field_values)
    else:
        name = draw(st.sampled_from(sorted(valid)))
        body[name] = draw(valid[name] if mode == "valid" else field_values)
    if body.get("stream") is True and path != "/infer" and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return path, body


# -- checks -------------------------------------------------------------------------------------
def auth(stack) -> dict:
    return {"Authorization": f"Bearer {stack.api_key}"}


def check_answer(status: int, content_type: str, raw: bytes) -> None:
    """The invariants every answer keeps, whatever the body was."""
    assert status in DOCUMENTED, (status, raw[:800])
    if status != 200:
        err = json.loads(raw)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
        return
    if content_type.startswith("text/event-stream"):
        text = raw.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        frames = text[:-2].split("\n\n")
        assert all(f.startswith("data: ") for f in frames), frames
        for f in frames[:-1]:
            assert "error" not in json.loads(f[len("data: "):]), f  # a failure inside a 200 stream
    else:
        body = json.loads(raw)
        assert "output" in body or body["choices"], body


def post(client: httpx.Client, stack, path: str, *, body=None, content: bytes | None = None,
         test: str = "explicit") -> int:
    """POST and check the answer; returns its status."""
    kw = {"content": content} if content is not None else {"content": json.dumps(body).encode()}
    with client.stream("POST", f"{stack.http_url}{path}", headers=auth(stack), **kw) as r:
        raw = r.read()
    check_answer(r.status_code, r.headers.get("content-type", ""), raw)
    OUTCOMES[test][r.status_code] += 1
    return r.status_code


def worker_request_ids(stack) -> dict[str, list[str]]:
    out = {}
    for name, addr, stub_cls in (("scheduler", stack.scheduler_addr, scheduler_pb2_grpc.SchedulerServiceStub),
                                 ("draft", stack.draft_addr, draft_pb2_grpc.DraftServiceStub),
                                 ("verifier", stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub)):
        with grpc.insecure_channel(addr) as ch:
            out[name] = list(stub_cls(ch).State(common_pb2.StateRequest(), timeout=5).request_ids)
    return out


def assert_healthy_and_idle(stack, before: dict[str, list[str]], timeout: float = 5.0) -> None:
    """The gateway answers /health 200, and no service holds a request beyond those it held
    `before` (gateway request ids are random: any new one was left behind by this module)."""
    assert httpx.get(f"{stack.http_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + timeout
    while new := {k: sorted(set(v) - set(before[k])) for k, v in worker_request_ids(stack).items()
                  if set(v) - set(before[k])}:
        assert time.monotonic() < deadline, f"requests still held after the fuzz run: {new}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(stack):
    before = worker_request_ids(stack)
    with httpx.Client(timeout=60) as c:
        yield c
    assert_healthy_and_idle(stack, before)
    print(f"\nHTTP fuzz requests per test and status: { {k: dict(v) for k, v in OUTCOMES.items()} }")


# -- properties ---------------------------------------------------------------------------------
def test_random_json_bodies(stack, client):
    @FUZZ
    @given(path=st.sampled_from(PATHS), body=json_values)
    def run(path, body):
        post(client, stack, path, body=body, test="random_json")

    run()
    assert OUTCOMES["random_json"][400] > 0, OUTCOMES  # the property ran and refused what it should


def test_random_bytes(stack, client):
    @FUZZ
    @given(path=st.sampled_from(PATHS), content=st.binary(max_size=200)
           | st.sampled_from([b"", b"\xff\xfe\xfd", b'{"prompt": "\xc3\x28"}', b"\x00" * 64, b"[" * 10,
                              b'{"prompt": NaN}', b'{"prompt": "w5"} trailing', b"\xef\xbb\xbf{}"]))
    def run(path, content):
        post(client, stack, path, content=content, test="random_bytes")

    run()


def test_near_valid_bodies(stack, client):
    @FUZZ
    @given(case=near_valid())
    def run(case):
        path, body = case
        post(client, stack, path, body=body, test="near_valid")

    run()
    statuses = OUTCOMES["near_valid"]
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # both valid and refused bodies ran


# -- explicit cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                     b'{"a":' * 5_000 + b"1" + b"}" * 5_000],
                         ids=["open-arrays", "open-objects", "closed-arrays", "closed-objects"])
def test_deep_nesting_is_refused_quickly(stack, client, content):
    started = time.monotonic()
    with client.stream("POST", f"{stack.http_url}/v1/completions", headers=auth(stack), content=content) as r:
        raw = r.read()
    assert r.status_code == 400, raw[:300]
    assert json.loads(raw)["error"]["code"] in ("json_too_deep", "invalid_json")
    assert time.monotonic() - started < 5.0


def test_nesting_limit_is_exact(stack, client):
    """`user` takes any JSON: nested to MAX_JSON_DEPTH levels in all it is served, one more is a 400."""
    def nested(levels: int):  # the body is level 1, so the value gets levels - 1
        value: object = 1
        for _ in range(levels - 1):
            value = [value]
        return {**BASES["/v1/completions"], "user": value}

    assert post(client, stack, "/v1/completions", body=nested(MAX_JSON_DEPTH)) == 200
    r = client.post(f"{stack.http_url}/v1/completions", headers=auth(stack), json=nested(MAX_JSON_DEPTH + 1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text


def raw_http(stack, head: str, body_chunks, read_timeout: float = 10.0) -> tuple[int, bytes, int]:
    """Send a request by hand (headers, then body chunks until the server answers); returns
    (status, the answer's body, body bytes sent before the answer came)."""
    host, port = stack.http_url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(head.encode())
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:  # the server answered already
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent += len(chunk)
        data = b""
        while b"\r\n\r\n" not in data or not _complete(data):
            try:
                part = sock.recv(65536)
            except ConnectionResetError:  # closed with our unread body in its buffer
                break
            if not part:
                break
            data += part
    head_part, _, rest = data.partition(b"\r\n\r\n")
    status = int(head_part.split(b" ", 2)[1])
    return status, rest, sent


def _complete(data: bytes) -> bool:
    head, _, rest = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(rest) >= int(value)
    return rest.endswith(b"0\r\n\r\n")


def headers(stack, extra: str) -> str:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {stack.api_key}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n")


def test_declared_oversized_body_is_refused_without_reading_it(stack):
    gib = 1 << 30
    started = time.monotonic()
    status, body, sent = raw_http(stack, headers(stack, f"Content-Length: {gib}\r\n"),
                                  (b"w" * 65536 for _ in range(gib // 65536)))
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    assert sent < 16 * MAX_BODY and time.monotonic() - started < 10.0, sent  # answered before 1 GiB came


def test_chunked_oversized_body_is_refused_at_the_limit(stack):
    chunk = b"w" * 65536
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    status, body, sent = raw_http(stack, headers(stack, "Transfer-Encoding: chunked\r\n"),
                                  (frame for _ in range(1 << 14)))  # up to 1 GiB
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    assert MAX_BODY < sent < 16 * MAX_BODY, sent  # read up to the limit, not to the end


@pytest.mark.parametrize("content,code", [
    (b'{"prompt": "w5 \xff\xfe", "max_tokens": 2}', "invalid_utf8"),
    (b'{"prompt": "w5 \xed\xa0\x80", "max_tokens": 2}', "invalid_utf8"),  # an encoded surrogate
    (b'{"prompt": "w5 \\ud800", "max_tokens": 2}', "invalid_utf8"),  # a JSON-escaped one
    (bytes(range(256)), "invalid_utf8"),
    (b'{"prompt": "w5", "max_tokens": 1' + b"0" * 5000 + b"}", "invalid_json"),  # beyond int digits
])
def test_invalid_text_is_400(stack, client, content, code):
    r = client.post(f"{stack.http_url}/v1/completions", headers=auth(stack), content=content)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_top_k_beyond_int32_is_400(stack, client):
    r = client.post(f"{stack.http_url}/v1/completions", headers=auth(stack),
                    json={**BASES["/v1/completions"], "top_k": 2**31})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
