"""Structured outputs through the real stack and the official `openai` client.

A stack of its own serves a tiny model with a byte-level tokenizer (the kind the grammar engine
reads; the session stack's word-level one is refused, which a test here checks). Its scheduler
speculates with a draft model (trees of 5 nodes): the constrained output must equal the
in-process engine's and a plain engine's (no draft), tokens and logprobs; a JSON schema response
parses and follows the schema; bad grammars are 400s naming the parameter and leave nothing.
"""

from __future__ import annotations

import json

import openai
import pytest

from services.common.grammar import Grammar
from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.integration.conftest import API_KEY, running_stack
from tests.integration.test_gateway_api import scheduler_state

V = 288
MESSAGES = [{"role": "user", "content": 'Describe a pet as JSON: {"name": "ab", "age": 3, "cat": true}'}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "cat": {"type": "boolean"}},
          "required": ["name", "age", "cat"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def byte_stack(tmp_path_factory, redis_url, home):
    root = tmp_path_factory.mktemp("structured-stack")
    target = tiny.make_checkpoint(root / "target", vocab_size=V, seed=41, merges=('{"', '":', "ab", "ca"))
    draft = tiny.make_checkpoint(root / "draft", vocab_size=V, seed=42, merges=('{"', '":', "ab", "ca"),
                                 noise_from=target, noise_std=0.08)
    with running_stack(root, target, draft, redis_url) as running:
        yield running


@pytest.fixture(scope="module")
def client(byte_stack):
    return openai.OpenAI(base_url=f"{byte_stack.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(byte_stack):
    return Engine(load_model(str(byte_stack.target)), None, StepConfig(draft_length=0), warm_up=False)


def engine_chat(engine: Engine, grammar: Grammar, max_tokens: int, **sampling):
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, grammar=grammar, **sampling))[0]


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "cat"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 99 and isinstance(value["cat"], bool))


def test_a_json_schema_answer_parses_follows_the_schema_and_equals_plain_decoding(byte_stack, client, plain):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    want = engine_chat(byte_stack.engine, grammar, 48, logprobs=2)
    off = engine_chat(plain, grammar, 48, logprobs=2)
    assert want.output_ids == off.output_ids and want.finish_reason == "stop"
    assert [t.logprob for t in want.logprobs] == pytest.approx([t.logprob for t in off.logprobs], abs=1e-5)
    kwargs = dict(model="", messages=MESSAGES, max_tokens=48, temperature=0, response_format=RESPONSE_FORMAT)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
    text = whole.choices[0].message.content
    assert follows_schema(text) and text == want.text and whole.choices[0].finish_reason == "stop"
    assert [c.logprob for c in whole.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in want.logprobs], abs=1e-5)
    assert whole.usage.accepted_tokens > 0  # the draft's proposals were speculated on, and kept
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **kwargs) if chunk.choices)
    assert streamed == text


def test_n_sampled_json_answers_all_follow_the_schema(byte_stack, client):
    got = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=48, n=3, temperature=1.0, seed=5,
                                         response_format=RESPONSE_FORMAT)
    texts = [c.message.content for c in got.choices]
    assert all(c.finish_reason == "stop" for c in got.choices) and all(follows_schema(t) for t in texts)
    want = engine_chat(byte_stack.engine, Grammar("json_schema", json.dumps(SCHEMA)), 48, temperature=1.0, seed=5)
    assert texts[0] == want.text  # seeded: the first sample is the engine's


@pytest.mark.parametrize("extra,grammar", [
    ({"structured_outputs": {"choice": ["cat", "dog", "abab"]}}, Grammar("choice", '["cat", "dog", "abab"]')),
    ({"guided_regex": "(ab|ca)+[0-9]"}, Grammar("regex", "(ab|ca)+[0-9]")),
])
def test_regex_and_choice_on_completions_equal_the_engine_s(byte_stack, client, plain, extra, grammar):
    prompt = "ab ca ab 7 cat"
    ids = byte_stack.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=16, grammar=grammar)
    want, off = (e.generate([ids], params)[0] for e in (byte_stack.engine, plain))
    assert want.output_ids == off.output_ids
    got = client.completions.create(model="", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
    assert got.choices[0].text == want.text


@pytest.mark.parametrize("kwargs,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"structured_outputs": {"regex": "(ab"}}), "structured_outputs.regex"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
])
def test_bad_grammars_are_400_naming_the_parameter_and_leave_nothing(byte_stack, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert list(scheduler_state(byte_stack).request_ids) == []


def test_a_tokenizer_the_engine_cannot_read_is_a_400(stack):
    """The session stack's word-level tiny tokenizer has no bytes to spell text with."""
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=stack.api_key, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="w5 w6", max_tokens=4, extra_body={"guided_regex": "w5"})
    assert "tokenizer the grammar engine can read" in e.value.body["message"]
    assert list(scheduler_state(stack).request_ids) == []
