"""Input validation shared by the HTTP and the public gRPC API, so that both accept and refuse
exactly the same values: `Sampling` (the generation parameters of one request), text checks
(`check_text`: no unpaired surrogates, i.e. valid UTF-8) and `DenyPatterns` (regular expressions
a prompt must not match).

Every check raises an `ApiError` (400) naming the parameter at fault. Values arrive as plain
Python objects (decoded JSON, or fields read off a protobuf message), so booleans are refused
where numbers are expected (in Python, True is an int).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import ApiError, invalid
from specserve.v1 import common_pb2

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_DRAFT_LENGTH = 64
MAX_TREE_SIZE = 256  # the scheduler's limit on draft nodes per step
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body (a chat body needs 4)
MAX_LOGPROBS = 20  # alternatives per token (the workers' limit too: services/common/sampling.py)
INT32 = 2**31  # top_k travels as a protobuf int32
INT64 = 2**63


def check_int(value: Any, param: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param, f"{param} must be an integer, got {_show(value)}", "invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(param, f"{param} must be {_range(lo, hi)}, got {value}")
    return value


def check_json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """`value` (decoded JSON) unless its arrays and objects nest deeper than `limit` (the body
    itself is level 1): a 400. Iterative, and it visits containers only."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise too_deep(limit)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def too_deep(limit: int = MAX_JSON_DEPTH) -> ApiError:
    return ApiError(400, f"the request body nests arrays and objects deeper than {limit} levels",
                    code="json_too_deep")


def check_number(value: Any, param: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(param, f"{param} must be a number, got {_show(value)}", "invalid_type")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise invalid(param, f"{param} must be in {interval}, got {value:g}")
    return value


def check_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"{param} must be a boolean, got {_show(value)}", "invalid_type")
    return value


def check_text(value: str, param: str) -> str:
    """A string that encodes to UTF-8: JSON escapes can smuggle in unpaired surrogates
    ("\\ud800"), which no tokenizer or protobuf string accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} is not valid UTF-8: an unpaired surrogate "
                       f"{value[e.start]!r} at character {e.start}", param=param,
                       code="invalid_utf8") from None
    return value


class DenyPatterns:
    """Regular expressions (Python `re` syntax, searched anywhere in the text) that refuse a
    prompt with a 400 naming the field that matched. Use `(?i)` for case-insensitive ones."""

    def __init__(self, patterns: Iterable[str] = (), param: str = "--deny-patterns"):
        self.patterns: list[re.Pattern[str]] = []
        for text in patterns:
            try:
                self.patterns.append(re.compile(text))
            except re.error as e:
                raise ValueError(f"{param}: {text!r} is not a valid regular expression: {e}") from None

    @classmethod
    def from_setting(cls, value: str | None, param: str = "--deny-patterns") -> "DenyPatterns":
        """From SPECSERVE_DENY_PATTERNS: one pattern per line, or `@PATH` for a file of them
        (one per line; blank lines and lines starting with # are skipped)."""
        value = value or ""
        if value.strip().startswith("@"):
            path = Path(value.strip()[1:]).expanduser()
            try:
                value = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(f"{param}: cannot read {path}: {e.strerror or e}") from None
        lines = (line.strip() for line in value.splitlines())
        return cls((line for line in lines if line and not line.startswith("#")), param)

    @property
    def enabled(self) -> bool:
        return bool(self.patterns)

    def check(self, text: str, param: str) -> None:
        """Refuse `text` (the field `param`) when a pattern matches it. The message gives the
        pattern's number, not the pattern, so that it does not teach how to get around it."""
        for n, pattern in enumerate(self.patterns, 1):
            if pattern.search(text):
                raise ApiError(400, f"{param} matches deny pattern #{n} of this server; the request "
                               "is refused", param=param, code="prompt_denied")


def check_stop(value: Any, param: str = "stop") -> tuple[str, ...]:
    """None, one string, or a list of at most MAX_STOP non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise invalid(param, f"{param} must be a string or a list of strings, got {_show(value)}",
                      "invalid_type")
    if len(items) > MAX_STOP:
        raise invalid(param, f"{param} accepts at most {MAX_STOP} strings, got {len(items)}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise invalid(param, f"{param} must hold non-empty strings, got {_show(s)}")
        check_text(s, param)
    return tuple(items)


@dataclass(frozen=True)
class Sampling:
    """Validated sampling and stopping parameters of one request.

    `max_tokens` None means "the gateway default, capped to what fits the context";
    `max_tokens_param` is the name the client used for it (max_tokens, max_completion_tokens,
    max_length), so a context error names the parameter the client actually sent.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    draft_length: int | None = None
    tree_size: int | None = None
    max_tokens_param: str = "max_tokens"
    logprobs: int | None = None  # None: none; n: each token's logprob and its n most likely alternatives
    grammar: tuple[str, str] | None = None  # structured output: (kind, source), services/gateway/structured.py

    def to_proto(self, max_tokens: int) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                           top_p=self.top_p, top_k=self.top_k, stop=list(self.stop),
                                           ignore_eos=self.ignore_eos)
        if self.seed is not None:
            params.seed = self.seed
        if self.logprobs is not None:
            params.logprobs = self.logprobs
        if self.grammar is not None:
            params.grammar.kind, params.grammar.source = self.grammar
        return params


def parse_sampling(body: Mapping[str, Any], *, default_temperature: float = 1.0,
                   max_tokens_params: tuple[str, ...] = ("max_tokens",)) -> Sampling:
    """Validate the sampling fields of a request body (missing or null = default); `logprobs` is
    the number of alternatives (completions' meaning; chat's is read by openai_api.parse_chat).

    With several names for max_tokens (chat accepts max_completion_tokens too), the first one
    present wins.
    """
    max_tokens, max_param = None, max_tokens_params[0]
    for name in max_tokens_params:
        if body.get(name) is not None:
            max_tokens, max_param = check_int(body[name], name, lo=1), name
            break
    get = body.get
    top_k = 0 if get("top_k") is None else check_int(get("top_k"), "top_k", lo=-1, hi=INT32 - 1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=(default_temperature if get("temperature") is None
                     else check_number(get("temperature"), "temperature", 0.0, MAX_TEMPERATURE)),
        top_p=1.0 if get("top_p") is None else check_number(get("top_p"), "top_p", 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # -1 means off, as in vLLM
        seed=None if get("seed") is None else check_int(get("seed"), "seed", -INT64, INT64 - 1),
        stop=check_stop(get("stop")),
        ignore_eos=False if get("ignore_eos") is None else check_bool(get("ignore_eos"), "ignore_eos"),
        draft_length=(None if get("draft_length") is None
                      else check_int(get("draft_length"), "draft_length", 0, MAX_DRAFT_LENGTH)),
        tree_size=(None if get("tree_size") is None
                   else check_int(get("tree_size"), "tree_size", 0, MAX_TREE_SIZE)),
        max_tokens_param=max_param,
        logprobs=None if get("logprobs") is None else check_int(get("logprobs"), "logprobs", 0, MAX_LOGPROBS),
    )


def fit_max_tokens(sampling: Sampling, prompt_tokens: int, context: int, default: int,
                   prompt_param: str) -> int:
    """The max_tokens to send: the requested one if prompt + max_tokens fits the context (else a
    400 naming the max_tokens parameter), or the default capped to the room left."""
    if prompt_tokens < 1:
        raise invalid(prompt_param, f"{prompt_param} must contain at least one token")
    room = context - prompt_tokens
    if room < 1:
        raise invalid(prompt_param, f"the prompt has {prompt_tokens} tokens, which leaves no room "
                      f"for output in the model's context of {context} tokens",
                      "context_length_exceeded")
    if sampling.max_tokens is None:
        return min(default, room)
    if sampling.max_tokens > room:
        name = sampling.max_tokens_param
        raise invalid(name, f"{name} ({sampling.max_tokens}) + prompt tokens ({prompt_tokens}) = "
                      f"{sampling.max_tokens + prompt_tokens} exceeds the model's context of "
                      f"{context} tokens", "context_length_exceeded")
    return sampling.max_tokens


def _range(lo: int | None, hi: int | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in [{lo}, {hi}]"


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
