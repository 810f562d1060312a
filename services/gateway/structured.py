"""Structured outputs in a request body: OpenAI's `response_format` and vLLM's extensions, as one
grammar (services/common/grammar.py) or none.

- `response_format`: {"type": "text"} (free text), {"type": "json_object"}, or {"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- `structured_outputs` (vLLM): exactly one of {"json": schema, "regex": str, "choice": [str],
  "grammar": Lark text, "json_object": true};
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: vLLM's older names.

A request may name one of them. Every refusal is a 400 naming the parameter at fault, including
a grammar the engine rejects (its message).
"""

from __future__ import annotations

import json
from typing import Any

from services.common.grammar import JSON_OBJECT, Grammar
from services.gateway.errors import invalid

# structured_outputs key / guided_* name -> grammar kind
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
GUIDED = {f"guided_{key}": kind for key, kind in _KINDS.items()}
FIELDS = {"response_format", "structured_outputs", *GUIDED}


def parse_structured(body: dict[str, Any]) -> tuple[str, str] | None:
    """The request's grammar as (kind, source), or None for free text."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, kind, body[name]))
    found = [f for f in found if f is not None]
    if len(found) > 1:
        raise invalid(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output; give one")
    if not found:
        return None
    param, kind, value = found[0]
    return check_grammar(kind, _source(param, kind, value), param)


def check_grammar(kind: str, source: str, param: str) -> tuple[str, str]:
    """(kind, source) of a grammar the engine accepts, else a 400 naming `param`."""
    try:
        Grammar(kind, source).validate()
    except ValueError as e:
        raise invalid(param, f"{param}: {e}", "invalid_grammar") from None
    return kind, source


def _response_format(value: Any) -> tuple[str, str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("response_format", "response_format must be an object with a type", "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_schema", JSON_OBJECT
    if kind != "json_schema":
        raise invalid("response_format.type", "response_format.type must be text, json_object or json_schema, "
                      f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "response_format.json_schema must be an object "
                      "with a schema", "missing_required_parameter" if spec is None else "invalid_type")
    if spec.get("schema") is None:
        raise invalid("response_format.json_schema.schema", "response_format.json_schema.schema is required",
                      "missing_required_parameter")
    return "response_format.json_schema.schema", "json_schema", spec["schema"]


def _structured_outputs(value: Any) -> tuple[str, str, Any]:
    if not isinstance(value, dict):
        raise invalid("structured_outputs", "structured_outputs must be an object", "invalid_type")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_KINDS) - {"json_object"})
    if unknown:
        raise invalid(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported "
                      f"(use one of {', '.join([*_KINDS, 'json_object'])})", "unsupported_parameter")
    if len(given) != 1:
        raise invalid("structured_outputs", "structured_outputs must name exactly one of "
                      f"{', '.join([*_KINDS, 'json_object'])}")
    key, v = next(iter(given.items()))
    if key == "json_object":
        return "structured_outputs.json_object", "json_schema", JSON_OBJECT
    return f"structured_outputs.{key}", _KINDS[key], v


def _source(param: str, kind: str, value: Any) -> str:
    """The grammar's text: a schema (object, or JSON text) and choices travel as JSON."""
    if kind == "json_schema":
        if isinstance(value, str):
            return value
        if not isinstance(value, dict):
            raise invalid(param, f"{param} must be a JSON Schema object", "invalid_type")
        return json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise invalid(param, f"{param} must be a list of strings", "invalid_type")
        return json.dumps(value)
    if not isinstance(value, str):
        raise invalid(param, f"{param} must be a string", "invalid_type")
    return value
