"""Structured outputs in request bodies: response_format, structured_outputs and guided_* become
one grammar (kind, source) on the scheduler's request, and every bad one is a 400 naming its
parameter (the engine's reason included)."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_api import parse_chat, parse_completion
from specserve.v1 import common_pb2

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("extra,want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, ("lark", 'start: "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, ("json_schema", '{"type": "object"}')),
    ({"guided_choice": ["a", "b"]}, ("choice", '["a", "b"]')),
    ({"guided_regex": "x+"}, ("regex", "x+")),
])
def test_each_form_becomes_one_grammar_on_the_scheduler_request(extra, want):
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"prompt": "hi"})):
        sampling = parse({**body, **extra}).sampling
        assert sampling.grammar == want
        params = sampling.to_proto(8)
        assert params.HasField("grammar") == (want is not None)
        if want is not None:
            assert (params.grammar.kind, params.grammar.source) == want


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": "json"}, "response_format", "object with a type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar", "nothing"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml", "not supported"),
    ({"structured_outputs": []}, "structured_outputs", "object"),
    ({"guided_regex": 5}, "guided_regex", "string"),
    ({"guided_json": {"type": "objekt"}}, "guided_json", "objekt"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both constrain"),
])
def test_bad_structured_outputs_are_400_naming_the_parameter(extra, param, words):
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **extra})
    assert e.value.status == 400
    assert e.value.param == param
    assert words in e.value.message


def test_the_public_grpc_api_checks_the_grammar_it_is_given():
    from services.gateway.public_grpc import api_request
    from specserve.v1 import gateway_pb2

    params = common_pb2.SamplingParams(grammar=common_pb2.Grammar(kind="regex", source="[0-9]+"))
    assert api_request(gateway_pb2.TextRequest(prompt="x", params=params)).sampling.grammar == ("regex", "[0-9]+")
    for kind, source, words in (("regex", "(a", "unclosed group"), ("yaml", "a", "grammar kind")):
        params = common_pb2.SamplingParams(grammar=common_pb2.Grammar(kind=kind, source=source))
        with pytest.raises(ApiError) as e:
            api_request(gateway_pb2.TextRequest(prompt="x", params=params))
        assert (e.value.status, e.value.param) == (400, "params.grammar") and words in e.value.message
