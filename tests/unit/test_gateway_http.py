"""The HTTP app end to end over ASGI, with a scripted scheduler on loopback gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys
from services.gateway.core import Gateway, GatewayConfig
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.tokenization import PromptTokenizer
from tests import tiny
from tests.unit.test_gateway_scheduler_client import FakeScheduler, dead_addr, running_fake

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
KEY = "sk-unit-test"


def make_gateway(addrs: list[str], keys=(), context: int = 64, max_body: int = 1 << 20) -> Gateway:
    tok = tiny.make_tokenizer(64)
    tok.chat_template = TEMPLATE
    config = GatewayConfig(model_name="tiny", target="/models/tiny", default_max_tokens=8,
                           max_body_bytes=max_body)
    return Gateway(config, PromptTokenizer(tok, context), SchedulerClient(addrs), ApiKeys(keys))


@contextlib.asynccontextmanager
async def client_for(fake: FakeScheduler | None = None, *, dead: bool = False, **kw):
    """An httpx client on the app, its gateway and the fake scheduler behind it."""
    async with running_fake(fake) as (fake, addr):
        gw = make_gateway([dead_addr()] if dead else [addr], **kw)
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, fake, gw
        await gw.scheduler.close()


def run(scenario, fake=None, **kw):
    """Run `scenario(client, fake, gateway)` in a fresh loop; returns its result."""
    async def go():
        async with client_for(fake, **kw) as (client, f, gw):
            return await scenario(client, f, gw)
    return asyncio.run(go())


def sse_objects(text: str) -> list:
    """Parse an SSE body into its JSON objects (and "[DONE]"), checking the framing."""
    assert text.endswith("\n\n")
    out = []
    for frame in text[:-2].split("\n\n"):
        assert frame.startswith("data: ")
        data = frame[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param
    if code is not None:
        assert e["code"] == code
    return e


def test_completion_returns_the_scheduler_text_and_usage():
    async def s(client, fake, gw):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 4,
                                                       "temperature": 0, "seed": 3, "stop": ["zz"], "top_k": 5,
                                                       "draft_length": 2, "tree_size": 3,
                                                       "return_token_ids": True})
        return r, fake.requests
    r, reqs = run(s)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    assert body["choices"][0]["text"] == FakeScheduler.expected_text(4)
    assert body["choices"][0]["token_ids"] == [10, 11, 12, 13]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 7 and body["usage"]["mean_accepted_length"] == 2.0
    (req,) = reqs
    assert req.request_id == body["id"] and list(req.prompt_ids) == [5, 6, 7]
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, list(p.stop)) == (4, 0.0, 5, 3, ["zz"])
    assert req.draft_length == 2 and req.tree_size == 3


def test_defaults_sent_to_the_scheduler():
    async def s(client, fake, gw):
        r = await client.post("/v1/completions", json={"prompt": "w5"})
        return r, fake.requests[0]
    r, req = run(s)
    assert r.status_code == 200
    assert req.params.max_tokens == 8 and req.params.temperature == 1.0 and req.params.top_p == 1.0
    assert not req.params.HasField("seed") and not req.HasField("draft_length")


def test_chat_completion_applies_the_chat_template():
    async def s(client, fake, gw):
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "w5 w6"}], "max_completion_tokens": 3})
        return r, fake.requests[0], gw
    r, req, gw = run(s)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": FakeScheduler.expected_text(3)}
    assert list(req.prompt_ids) == [5, 6, 9] == gw.tokenizer.encode_chat([{"role": "user", "content": "w5 w6"}])


def test_streamed_completion_is_sse_with_usage_and_done():
    async def s(client, fake, gw):
        return await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 5, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    r = run(s)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    objs = sse_objects(r.text)
    assert objs[-1] == "[DONE]"
    chunks, usage = objs[:-2], objs[-2]
    assert len(chunks) == 5 and all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == FakeScheduler.expected_text(5)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert len({c["id"] for c in objs[:-1]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_streamed_chat_opens_with_the_role_and_ends_with_finish_reason():
    async def s(client, fake, gw):
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "stream": True})
    objs = sse_objects(run(s).text)
    assert objs[-1] == "[DONE]"
    chunks = objs[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == FakeScheduler.expected_text(3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_api_keys_guard_everything_but_health():
    async def s(client, fake, gw):
        body = {"prompt": "w5", "max_tokens": 2}
        return (await client.post("/v1/completions", json=body),
                await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                await client.get("/v1/models"),
                await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}),
                await client.get("/health"), fake.requests)
    missing, wrong, models, ok, health, reqs = run(s, keys=[KEY])
    assert_openai_error(missing, 401, code="missing_api_key")
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_openai_error(wrong, 401, code="invalid_api_key")
    assert_openai_error(models, 401)
    assert ok.status_code == 200 and health.status_code == 200 and health.json() == {"status": "ok"}
    assert len(reqs) == 1  # refused requests never reached the scheduler


def test_models_and_routing_errors_in_openai_shape():
    async def s(client, fake, gw):
        return [await client.get("/v1/models"), await client.get("/v1/models/tiny"),
                await client.get("/v1/models/other"), await client.get("/v1/nothing"),
                await client.get("/v1/completions"),
                await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "w5"})]
    models, one, other, nothing, wrong_method, wrong_model = run(s)
    data = models.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["tiny"]
    assert data["data"][0]["object"] == "model" and data["data"][0]["max_model_len"] == 64
    assert one.json()["id"] == "tiny"
    assert_openai_error(other, 404, param="model", code="model_not_found")
    assert_openai_error(nothing, 404, code="not_found")
    assert_openai_error(wrong_method, 405)
    assert_openai_error(wrong_model, 404, param="model", code="model_not_found")


def test_body_errors_happen_before_the_scheduler_is_called():
    async def s(client, fake, gw):
        post = client.post
        out = [await post("/v1/completions", content=b"{not json"),
               await post("/v1/completions", content=b""),
               await post("/v1/completions", json=["prompt"]),
               await post("/v1/completions", content=b'{"prompt": "' + b"w5 " * 1000 + b'"}'),
               await post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 63}),
               await post("/v1/completions", json={"prompt": "w5 " * 64}),
               await post("/v1/completions", json={"prompt": [99]}),
               await post("/v1/completions", json={"prompt": "w5", "temperature": 3}),
               await post("/v1/chat/completions", json={"messages": [{"role": "user"}]})]
        return out, fake.requests
    (bad_json, empty, array, big, too_long, prompt_too_long, bad_ids, hot, no_content), reqs = run(s, max_body=2000)
    assert_openai_error(bad_json, 400, code="invalid_json")
    assert_openai_error(empty, 400, code="invalid_json")
    assert_openai_error(array, 400, code="invalid_json")
    assert_openai_error(big, 413, code="body_too_large")
    e = assert_openai_error(too_long, 400, param="max_tokens", code="context_length_exceeded")
    assert "64" in e["message"]
    assert_openai_error(prompt_too_long, 400, param="prompt", code="context_length_exceeded")
    assert_openai_error(bad_ids, 400, param="prompt")
    assert_openai_error(hot, 400, param="temperature")
    assert_openai_error(no_content, 400, param="messages[0].content")
    assert reqs == []


def test_unreachable_scheduler_is_503_and_unhealthy():
    async def s(client, fake, gw):
        return (await client.post("/v1/completions", json={"prompt": "w5"}),
                await client.post("/v1/completions", json={"prompt": "w5", "stream": True}),
                await client.post("/infer", json={"input": "w5"}),
                await client.get("/health"))
    plain, stream, infer, health = run(s, dead=True)
    for r in (plain, stream, infer):
        assert_openai_error(r, 503, code="scheduler_unavailable")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health.json()["error"]["code"] == "scheduler_unavailable"


@pytest.mark.parametrize("code,status", [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429),
                                         ("UNAVAILABLE", 503)])
def test_scheduler_status_codes_become_http_statuses(code, status):
    import grpc

    fake = FakeScheduler()
    fake.abort = getattr(grpc.StatusCode, code)

    async def s(client, fake, gw):
        return (await client.post("/v1/completions", json={"prompt": "w5"}),
                await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                                "stream": True}))
    for r in run(s, fake):
        assert_openai_error(r, status)


def test_scheduler_failures_before_and_after_the_stream_started():
    async def s(client, fake, gw):
        fake.error_after = 0
        first = (await client.post("/v1/completions", json={"prompt": "w5", "stream": True}),
                 await client.post("/v1/completions", json={"prompt": "w5"}))
        fake.error_after = 2
        mid = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 5, "stream": True})
        fake.error_after, fake.no_final = None, True
        cut = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 3, "stream": True})
        return first, mid, cut
    (at_start, whole), mid, cut = run(s)
    assert_openai_error(at_start, 500, code="generation_error")
    assert_openai_error(whole, 500, code="generation_error")
    objs = sse_objects(mid.text)
    assert mid.status_code == 200 and objs[-1] == "[DONE]"
    assert [o["choices"][0]["text"] for o in objs[:2]] == ["t0 ", "t1 "]
    assert objs[2]["error"]["code"] == "generation_error" and "scripted failure" in objs[2]["error"]["message"]
    assert sse_objects(cut.text)[-2]["error"]["code"] == "incomplete_stream"


def test_infer_endpoint():
    async def s(client, fake, gw):
        return (await client.post("/infer", json={"input": "w5 w6", "max_length": 6}),
                await client.post("/infer", json={"input": 5}),
                await client.post("/infer", json={"input": "w5", "max_length": 100}), fake.requests)
    ok, bad, long, reqs = run(s)
    body = ok.json()
    assert ok.status_code == 200 and set(body) == {"output", "latency_ms", "tokens", "mean_accepted_length",
                                                   "acceptance_rate"}
    assert body["output"] == FakeScheduler.expected_text(6) and body["tokens"] == 6
    assert body["latency_ms"] > 0 and body["mean_accepted_length"] == 2.0 and body["acceptance_rate"] == 0.5
    assert reqs[0].params.temperature == 0.0 and reqs[0].params.max_tokens == 6
    assert_openai_error(bad, 400, param="input")
    assert_openai_error(long, 400, param="max_length", code="context_length_exceeded")


async def _asgi_post(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Drive the ASGI app like a server would; the client 'disconnects' when `disconnect` is set."""
    raw = json.dumps(body).encode()
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if pending:
            return pending.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("gw", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_scheduler_call(stream):
    async def go():
        async with running_fake(FakeScheduler(delay=0.05)) as (fake, addr):
            gw = make_gateway([addr])
            app = create_app(gw)
            gone = asyncio.Event()

            async def disconnect_soon():
                while not fake.requests:  # the request reached the scheduler
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # a few tokens later
                gone.set()

            started = time.perf_counter()
            watcher = asyncio.create_task(disconnect_soon())
            sent = await _asgi_post(app, "/v1/completions", {"prompt": "w5", "max_tokens": 60, "stream": stream},
                                    gone)
            elapsed = time.perf_counter() - started
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            await watcher
            await gw.scheduler.close()
            return fake, sent, elapsed

    fake, sent, elapsed = asyncio.run(go())
    assert elapsed < 2.0  # 60 tokens at 50 ms each would take 3 s
    assert fake.cancelled == [fake.requests[0].request_id] and fake.finished == []
    if stream:
        assert sent[0]["status"] == 200
        assert any(m.get("body", b"").startswith(b"data: ") for m in sent[1:])
