"""The gateway's public APIs against the real stack (draft, verifier, scheduler and gateway
processes on a tiny model): OpenAI-compatible HTTP, SSE streaming and public gRPC must give
exactly the tokens of the in-process engine, greedy and seeded."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest

from specserve.v1 import (common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, scheduler_pb2_grpc,
                          verifier_pb2_grpc)

PROMPTS = ["w5 w6 w7 w8 w5 w6", "w11 w12 w13 w14 w15", "w20 w21 w20 w21 w20"]
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7),
             dict(temperature=1.3, top_k=10, seed=123)]
MESSAGES = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w6 w7 w8"}]


def auth(stack) -> dict:
    return {"Authorization": f"Bearer {stack.api_key}"}


def post(stack, path: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(f"{stack.http_url}{path}", json=body, headers=auth(stack), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def sse_stream(stack, path: str, body: dict) -> list:
    """POST with stream: true; the decoded data objects, checking the SSE framing."""
    with httpx.stream("POST", f"{stack.http_url}{path}", json={**body, "stream": True}, headers=auth(stack),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def prompt_len(stack, text: str) -> int:
    return len(stack.engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt(stack) -> str:
    """The chat template of the stack's target applied to MESSAGES, as the gateway must."""
    tok = stack.engine.tokenizer
    assert tok.chat_template, "the stack's tiny target needs a chat template for chat completions"
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def check_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert 1 <= usage["steps"] <= completion_tokens
    assert 0 <= usage["accepted_tokens"] <= usage["drafted_tokens"]
    assert usage["mean_accepted_length"] == pytest.approx(completion_tokens / usage["steps"], abs=1e-3)
    if usage["drafted_tokens"]:
        assert usage["acceptance_rate"] == pytest.approx(usage["accepted_tokens"] / usage["drafted_tokens"],
                                                         abs=1e-3)


def test_models_and_health(stack):
    assert httpx.get(f"{stack.http_url}/health", timeout=10).json() == {"status": "ok"}
    models = httpx.get(f"{stack.http_url}/v1/models", headers=auth(stack), timeout=10).json()
    assert [m["id"] for m in models["data"]] == [Path(stack.target).name]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded-top-p", "seeded-top-k"])
def test_completion_equals_the_engine(stack, sampling):
    for prompt in PROMPTS:
        want = stack.engine_generate(prompt, max_tokens=24, **sampling)
        got = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "return_token_ids": True,
                                              **sampling})
        choice = got["choices"][0]
        assert got["object"] == "text_completion"
        assert choice["token_ids"] == want["token_ids"]
        assert choice["text"] == want["text"]
        assert choice["finish_reason"] == want["finish_reason"]
        check_usage(got["usage"], prompt_len(stack, prompt), len(want["token_ids"]))


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "seeded"])
def test_streamed_completion_equals_the_engine(stack, sampling):
    prompt = PROMPTS[0]
    want = stack.engine_generate(prompt, max_tokens=24, ignore_eos=True, **sampling)
    objs = sse_stream(stack, "/v1/completions", {
        "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}, **sampling})
    chunks, usage = objs[:-1], objs[-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len([c for c in chunks if c["choices"][0]["token_ids"]]) > 1  # streamed step by step
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"] == "length"
    assert usage["choices"] == []
    check_usage(usage["usage"], prompt_len(stack, prompt), 24)


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "seeded"])
def test_chat_completion_equals_the_engine_on_the_chat_template(stack, sampling):
    want = stack.engine_generate(chat_prompt(stack), max_tokens=20, **sampling)
    got = post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 20,
                                               "return_token_ids": True, **sampling})
    choice = got["choices"][0]
    assert got["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": want["text"]}
    assert choice["token_ids"] == want["token_ids"] and choice["finish_reason"] == want["finish_reason"]
    check_usage(got["usage"], prompt_len(stack, chat_prompt(stack)), len(want["token_ids"]))

    chunks = sse_stream(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, **sampling})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"]


def test_infer_equals_the_greedy_engine(stack):
    want = stack.engine_generate(PROMPTS[1], max_tokens=16)
    got = post(stack, "/infer", {"input": PROMPTS[1], "max_length": 16})
    assert got["output"] == want["text"] and got["tokens"] == len(want["token_ids"])
    assert got["latency_ms"] > 0 and got["mean_accepted_length"] >= 1.0


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "seeded"])
def test_grpc_stream_equals_the_engine(stack, sampling):
    want = stack.engine_generate(PROMPTS[2], max_tokens=24, **sampling)
    request = gateway_pb2.TextRequest(prompt=PROMPTS[2], params=common_pb2.SamplingParams(max_tokens=24, **sampling))
    metadata = (("authorization", f"Bearer {stack.api_key}"),)
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        chunks = list(stub.GenerateStream(request, metadata=metadata, timeout=120))
        whole = stub.Generate(request, metadata=metadata, timeout=120)
    assert [t for c in chunks for t in c.token_ids] == want["token_ids"] == list(whole.token_ids)
    assert "".join(c.text for c in chunks) == want["text"] == whole.text
    assert chunks[-1].finish_reason == want["finish_reason"] == whole.finish_reason
    assert all(c.id == chunks[0].id for c in chunks)
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(want["token_ids"])
    assert usage.prompt_tokens == prompt_len(stack, PROMPTS[2]) and usage.steps >= 1


def test_requests_without_the_key_are_refused(stack):
    body = {"prompt": PROMPTS[0], "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        r = httpx.post(f"{stack.http_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(gateway_pb2.TextRequest(prompt=PROMPTS[0]), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_invalid_request_is_400_naming_the_parameter(stack):
    r = httpx.post(f"{stack.http_url}/v1/completions", headers=auth(stack), timeout=30,
                   json={"prompt": PROMPTS[0], "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def scheduler_state(stack) -> common_pb2.StateResponse:
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).State(common_pb2.StateRequest(), timeout=10)


def test_client_disconnect_mid_stream_cancels_the_request(stack):
    max_tokens = 200
    body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{stack.http_url}/v1/completions", json=body, headers=auth(stack)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: dropping it would close the connection
            first = next(line for line in lines if line)
            request_id = json.loads(first[len("data: "):])["id"]
            state = scheduler_state(stack)
            assert request_id in state.request_ids  # still generating
            steps_at_first = state.steps
        # the connection is closed here, mid-stream
    # Freed in the scheduler, the draft and the verifier within one second.
    def holders() -> list[str]:
        held = []
        for addr, stub_cls in ((stack.scheduler_addr, scheduler_pb2_grpc.SchedulerServiceStub),
                               (stack.draft_addr, draft_pb2_grpc.DraftServiceStub),
                               (stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub)):
            with grpc.insecure_channel(addr) as ch:
                if request_id in stub_cls(ch).State(common_pb2.StateRequest(), timeout=5).request_ids:
                    held.append(addr)
        return held

    deadline = time.monotonic() + 1.0
    while (held := holders()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not held, f"request state still held after 1 s by {held}"
    state = scheduler_state(stack)
    # Cancelled, not finished: a step outputs at most tree size + 1 <= 6 tokens (conftest's
    # TREE_SIZE is 5), so finishing the remaining tokens would have taken far more steps.
    assert state.steps - steps_at_first < (max_tokens - 1) // 6
    # the stack keeps serving
    got = post(stack, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
    assert got["choices"][0]["text"] == stack.engine_generate(PROMPTS[1], max_tokens=4)["text"]
