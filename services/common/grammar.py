"""Structured outputs: the grammar a request's output must follow, as the API names it, and its
form for the grammar engine (llguidance, chosen over xgrammar for its footprint: no dependencies,
where xgrammar pulls triton; BENCHMARKS.md compares their speed).

The output (the tokens from `start` on, the prompt's length) must stay inside the grammar: the
verifier masks the target's distribution to the tokens the grammar allows at every tree node
(services/common/constraint.py), so speculation reproduces plain constrained decoding exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("json_schema", "regex", "choice", "lark")
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
# JSON as json.dumps writes it: whitespace only in the separators. Free whitespace lets a small
# model loop on newlines until max_tokens; a schema's own "x-guidance" options still win.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of KINDS
    source: str  # a JSON Schema (JSON text), a regular expression, a JSON array of strings, a Lark grammar
    start: int = 0  # the first constrained position: the prompt's length (the scheduler sets it)

    def validate(self) -> None:
        """Raise ValueError saying what is wrong: an unknown kind, malformed source, or a grammar
        the engine rejects (its own message)."""
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"grammar start must be a non-negative integer, got {self.start!r}")
        problem = _problem(self.kind, self.source)
        if problem:
            raise ValueError(problem)

    def engine_form(self) -> str:
        """The grammar as llguidance takes it (a valid grammar: `validate` first)."""
        return _engine_form(self.kind, self.source)


@lru_cache(maxsize=256)
def _engine_form(kind: str, source: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.loads(source), defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "choice":  # one Lark rule: the literal strings as alternatives
        options = json.loads(source)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    return LLMatcher.grammar_from_lark(source)


@lru_cache(maxsize=256)
def _problem(kind: str, source: str) -> str:
    """What is wrong with a grammar's source, or "" (cached: workers see each grammar once per request)."""
    from llguidance import LLMatcher

    if not isinstance(source, str) or not source.strip():
        return "the grammar is empty"
    if kind in ("json_schema", "choice"):
        try:
            value = json.loads(source)
        except ValueError as e:
            return f"not valid JSON: {e}"
        if kind == "json_schema" and not isinstance(value, dict):
            return f"a JSON Schema must be a JSON object, got {type(value).__name__}"
        if kind == "choice" and (not isinstance(value, list) or not value
                                 or not all(isinstance(v, str) and v for v in value)):
            return "choice must be a non-empty list of non-empty strings"
    lines = LLMatcher.validate_grammar(_engine_form(kind, source)).strip().splitlines()
    # The engine's first line says where; a regex's cause follows on an "error:" line.
    return "; ".join(line.strip() for i, line in enumerate(lines) if i == 0 or line.startswith("error:"))
