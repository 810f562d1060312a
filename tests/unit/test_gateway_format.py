"""The OpenAI response shapes: usage blocks, whole responses with their n choices, and SSE
chunks (framing, the chat role chunk, held-back text)."""

from __future__ import annotations

import json

import pytest

from services.gateway.core import Completion
from services.gateway.openai_api import OpenAIFormatter, parse_chat, sse, usage_dict
from specserve.v1 import scheduler_pb2


def _usage():
    return scheduler_pb2.Usage(prompt_tokens=3, completion_tokens=4, steps=2, drafted_tokens=6,
                               accepted_tokens=2, mean_accepted_length=2.0, acceptance_rate=1 / 3)


def test_usage_block_has_openai_counts_and_speculative_stats():
    u = usage_dict(_usage())
    assert u["total_tokens"] == 7 and u["prompt_tokens"] == 3 and u["completion_tokens"] == 4
    assert u["steps"] == 2 and u["drafted_tokens"] == 6 and u["accepted_tokens"] == 2
    assert u["mean_accepted_length"] == 2.0 and u["acceptance_rate"] == pytest.approx(0.3333)


def test_response_shapes():
    comp = OpenAIFormatter("completion", "cmpl-1", "m", return_token_ids=True).response(
        [Completion("hi", [4, 5], "stop", _usage())])
    assert comp["object"] == "text_completion" and comp["id"] == "cmpl-1" and comp["model"] == "m"
    assert comp["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop",
                                "token_ids": [4, 5]}]
    chat = OpenAIFormatter("chat", "chatcmpl-1", "m").response([Completion("hi", [4], "length", _usage())])
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["choices"][0]["finish_reason"] == "length" and "token_ids" not in chat["choices"][0]
    assert chat["usage"]["total_tokens"] == 7 and isinstance(chat["created"], int)


def test_n_samples_are_n_choices_with_their_usage_summed_and_the_prompt_counted_once():
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 16}).n == 16
    samples = [Completion("a", [4], "stop", _usage()), Completion("bc", [5, 6], "length", _usage())]
    out = OpenAIFormatter("chat", "chatcmpl-1", "m", n=2).response(samples)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == \
        [(0, "a", "stop"), (1, "bc", "length")]
    u = out["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], u["steps"]) == (3, 8, 11, 4)
    assert u["mean_accepted_length"] == 2.0 and u["acceptance_rate"] == pytest.approx(4 / 12, abs=1e-4)
    fmt = OpenAIFormatter("chat", "chatcmpl-1", "m", n=2)
    assert [c["choices"][0]["index"] for c in fmt.start_chunks()] == [0, 1]
    (chunk,) = fmt.event_chunks(scheduler_pb2.GenerateEvent(token_ids=[4], text="x", index=1))
    assert chunk["choices"][0]["index"] == 1


def test_sse_framing_of_chat_chunks():
    fmt = OpenAIFormatter("chat", "chatcmpl-1", "m", include_usage=True)
    frames = [sse(c) for c in fmt.start_chunks()]
    frames += [sse(c) for c in fmt.event_chunks(scheduler_pb2.GenerateEvent(token_ids=[4], text="é"))]
    assert fmt.event_chunks(scheduler_pb2.GenerateEvent(token_ids=[5])) == []  # text held back
    final = scheduler_pb2.GenerateEvent(finish_reason="stop", usage=_usage())
    frames += [sse(c) for c in fmt.event_chunks(final)] + [sse(fmt.usage_chunk(final.usage))]
    for f in frames:
        assert f.startswith(b"data: ") and f.endswith(b"\n\n") and b"\n" not in f[:-2]
    objs = [json.loads(f[6:]) for f in frames]
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == "chatcmpl-1" for o in objs)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[1]["choices"][0]["delta"] == {"content": "é"} and objs[1]["usage"] is None
    assert objs[2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert objs[3]["choices"] == [] and objs[3]["usage"]["completion_tokens"] == 4


def test_completion_chunks():
    fmt = OpenAIFormatter("completion", "cmpl-1", "m", return_token_ids=True)
    assert fmt.start_chunks() == []
    (c,) = fmt.event_chunks(scheduler_pb2.GenerateEvent(token_ids=[5, 6], text=""))
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "" and c["choices"][0]["token_ids"] == [5, 6]
    assert "usage" not in c
