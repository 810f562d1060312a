"""What OpenAI clients expect, through the real stack and the official `openai` client.

Logprobs (chat and completions, whole and streamed, and the public gRPC API): the stack's
scheduler speculates (a draft model, trees of 5 nodes); its tokens and logprobs must equal the
in-process engine's, and a plain engine's (no draft) too: speculation on or off gives the same
values. n samples: n choices, each the target's greedy output at temperature 0, distinct ones when
sampling, usage counting them all."""

from __future__ import annotations

import grpc
import openai
import pytest

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.test_gateway_api import MESSAGES, PROMPTS, chat_prompt

GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.9, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(stack):
    return Engine(load_model(str(stack.target)), None, StepConfig(draft_length=0), warm_up=False)


def model_name(client) -> str:
    return client.models.list().data[0].id


def engine_run(engine, text: str, max_tokens: int, logprobs: int, **sampling):
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **sampling))[0]


def assert_same(got: list[tuple[int, float, list]], want) -> None:
    """got: (token id, logprob, [(id, logprob)] alternatives) per token; want: TokenLogprob list."""
    assert [g[0] for g in got] == [w.token_id for w in want]
    for (_, lp, top), w in zip(got, want):
        assert lp == pytest.approx(w.logprob, abs=1e-5)
        assert [i for i, _ in top] == [i for i, _ in w.top]
        assert [v for _, v in top] == pytest.approx([v for _, v in w.top], abs=1e-5)


def from_chat(content, tok) -> list:
    ids = lambda text: tok.convert_tokens_to_ids(text)  # the tiny vocabulary's words are its tokens
    return [(ids(c.token), c.logprob, [(ids(t.token), t.logprob) for t in c.top_logprobs]) for c in content]


def test_chat_logprobs_equal_the_engine_s_whole_and_streamed(stack, client, plain):
    want = engine_run(stack.engine, chat_prompt(stack), 12, 3, **GREEDY)
    off = engine_run(plain, chat_prompt(stack), 12, 3, **GREEDY)
    assert want.output_ids == off.output_ids and want.stats.accepted > 0
    assert_same([(w.token_id, w.logprob, w.top) for w in off.logprobs], want.logprobs)
    kwargs = dict(model=model_name(client), messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3, **GREEDY)
    tok = stack.engine.tokenizer
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert_same(from_chat(content, tok), want.logprobs)
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kwargs)
                for c in (chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else [])]
    assert_same(from_chat(streamed, tok), want.logprobs)
    assert whole.choices[0].message.content == want.text


def test_completion_logprobs_seeded_equal_the_engine_s(stack, client):
    want = engine_run(stack.engine, PROMPTS[0], 16, 2, **SEEDED)
    got = client.completions.create(model=model_name(client), prompt=PROMPTS[0], max_tokens=16, logprobs=2,
                                    extra_body={"return_token_ids": True}, **SEEDED)
    lp = got.choices[0].logprobs
    ids = got.choices[0].token_ids
    assert ids == want.output_ids and lp.tokens == [stack.engine.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want.logprobs], abs=1e-5)
    for top, w in zip(lp.top_logprobs, want.logprobs):  # the alternatives and the chosen token
        vocab = stack.engine.tokenizer
        assert {vocab.convert_tokens_to_ids(t): v for t, v in top.items()} == pytest.approx(
            {**dict(w.top), w.token_id: w.logprob}, abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_grpc_logprobs_equal_the_engine_s(stack):
    want = engine_run(stack.engine, PROMPTS[2], 12, 4, **GREEDY)
    request = gateway_pb2.TextRequest(prompt=PROMPTS[2], params=common_pb2.SamplingParams(max_tokens=12, logprobs=4))
    metadata = (("authorization", f"Bearer {stack.api_key}"),)
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        whole = stub.Generate(request, metadata=metadata, timeout=120)
        chunks = list(stub.GenerateStream(request, metadata=metadata, timeout=120))
    for got in (list(whole.logprobs), [t for c in chunks for t in c.logprobs]):
        assert_same([(t.token_id, t.logprob, list(zip(t.top_ids, t.top_logprobs))) for t in got], want.logprobs)


def test_n_greedy_samples_are_n_copies_of_the_engine_s_output(stack, client):
    want = stack.engine_generate(PROMPTS[1], max_tokens=12)
    got = client.completions.create(model=model_name(client), prompt=PROMPTS[1], max_tokens=12, n=3, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [want["text"]] * 3
    assert got.usage.completion_tokens == 3 * len(want["token_ids"])
    assert got.usage.prompt_tokens == len(stack.engine.tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"])


def test_n_sampled_chat_streams_each_choice(stack, client):
    kwargs = dict(model=model_name(client), messages=MESSAGES, max_tokens=10, n=4, seed=3, temperature=1.0)
    whole = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # samples of their own (seeds 3, 4, 5, 6)
    streamed = {i: "" for i in range(4)}
    finished = set()
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage is not None:
            usage = chunk.usage
    assert finished == {0, 1, 2, 3} and [streamed[i] for i in range(4)] == texts  # the same seeds, the same text
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert_nothing_held(stack)


def assert_nothing_held(stack) -> None:
    from tests.integration.test_gateway_api import scheduler_state

    assert list(scheduler_state(stack).request_ids) == []


@pytest.mark.parametrize("route,kwargs,param", [
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("completions", dict(logprobs=21), "logprobs"),
    ("chat", dict(n=17), "n"),
    ("completions", dict(n=0), "n"),
])
def test_bad_logprobs_are_400_naming_the_parameter(client, route, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=model_name(client), messages=MESSAGES, max_tokens=4, **kwargs)
        else:
            client.completions.create(model=model_name(client), prompt=PROMPTS[0], max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
