"""The OpenAI-compatible wire format: request bodies in, response objects and SSE chunks out.

Parsing turns a decoded JSON body into an `ApiRequest` (or an `ApiError` 400 naming the
parameter); `OpenAIFormatter` builds `text_completion` / `chat.completion` objects and the
streamed `text_completion` / `chat.completion.chunk` chunks. Nothing here does I/O.

Logprobs (`logprobs` / `top_logprobs` on chat, `logprobs` on completions: at most 20 alternatives,
as vLLM allows) are the target's log-probabilities under the request's sampling parameters (see
services/verifier/logprobs.py); services/gateway/logprobs.py shapes them.

Structured outputs (`response_format`, and vLLM's `structured_outputs` and `guided_*`) are read
by services/gateway/structured.py.

Extensions beyond OpenAI: `top_k`, `ignore_eos`, `draft_length` and `tree_size` (fix the
speculative draft length / tree budget for the request), `return_token_ids` (the output token
ids in each choice), and speculative statistics in `usage` (steps, drafted_tokens,
accepted_tokens, mean_accepted_length, acceptance_rate).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.gateway.errors import ApiError, invalid
from services.gateway.logprobs import TokenText, chat_logprobs, completion_logprobs
from services.gateway.structured import FIELDS as STRUCTURED, parse_structured
from services.gateway.tokenization import check_messages
from services.gateway.validation import MAX_LOGPROBS, Sampling, check_bool, check_int, parse_sampling
from specserve.v1 import scheduler_pb2

MAX_N = 16  # samples per request (the scheduler's limit too: services/scheduler/loop.py)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"

_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
             "draft_length", "tree_size"}
_COMMON = _SAMPLING | STRUCTURED | {"model", "stream", "stream_options", "n", "return_token_ids", "user",
                                    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls", "metadata",
                         "store"}
INFER_FIELDS = {"input", "max_length"}

# OpenAI parameters we accept only at their "off" value: name -> is the value off?
_OFF = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "logit_bias": lambda v: v in (None, {}),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
}


@dataclass
class ApiRequest:
    """A validated generation request, before tokenization."""

    kind: str  # "completion" or "chat"
    sampling: Sampling
    model: str | None = None
    prompt: str | None = None  # completion text
    prompt_ids: list[int] | None = None  # completion given as token ids
    messages: list[dict[str, str]] | None = None  # chat
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prompt_param: str = "prompt"  # the body field holding the prompt (for error messages)
    n: int = 1  # samples of the prompt (choices)


def _check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name in body:
        if name not in allowed:
            raise invalid(name, f"unrecognized request argument supplied: {name}", "unknown_parameter")
    for name, is_off in _OFF.items():
        if name in body and not is_off(body[name]):
            raise invalid(name, f"{name} is not supported by this server", "unsupported_parameter")
    return body


def _common(body: dict[str, Any], kind: str, max_tokens_params: tuple[str, ...]) -> dict[str, Any]:
    """Fields shared by completions and chat completions."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "model must be a string", "invalid_type")
    n = 1 if body.get("n") is None else check_int(body["n"], "n", lo=1, hi=MAX_N)
    stream = False if body.get("stream") is None else check_bool(body["stream"], "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", "stream_options must be an object with include_usage")
        if options.get("include_usage") is not None:
            include_usage = check_bool(options["include_usage"], "stream_options.include_usage")
    return_ids = body.get("return_token_ids")
    if kind == "chat":  # logprobs is a switch there, and top_logprobs the number of alternatives
        body = {**body, "logprobs": _chat_logprobs(body)}
    return dict(kind=kind, model=model, stream=stream, include_usage=include_usage, n=n,
                return_token_ids=False if return_ids is None else check_bool(return_ids, "return_token_ids"),
                sampling=replace(parse_sampling(body, max_tokens_params=max_tokens_params),
                                 grammar=parse_structured(body)))


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20) as one number of alternatives, or None."""
    on = False if body.get("logprobs") is None else check_bool(body["logprobs"], "logprobs")
    top = 0 if body.get("top_logprobs") is None else check_int(body["top_logprobs"], "top_logprobs", 0,
                                                               MAX_LOGPROBS)
    if top and not on:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    return top if on else None


def parse_completion(body: Any) -> ApiRequest:
    """A /v1/completions body. `prompt` is a string, a list of one string, a list of token ids
    or a list holding one list of token ids."""
    body = _check_fields(body, COMPLETION_FIELDS)
    req = ApiRequest(**_common(body, "completion", ("max_tokens",)))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                     for i in prompt):
        req.prompt_ids = list(prompt)
    elif prompt is None:
        raise invalid("prompt", "prompt is required", "missing_required_parameter")
    else:
        raise invalid("prompt", "prompt must be a string, a list of one string, or a non-empty "
                      "list of token ids (batched prompts are not supported)")
    return req


def parse_chat(body: Any) -> ApiRequest:
    """A /v1/chat/completions body (max_completion_tokens wins over the older max_tokens)."""
    body = _check_fields(body, CHAT_FIELDS)
    req = ApiRequest(**_common(body, "chat", ("max_completion_tokens", "max_tokens")))
    if body.get("messages") is None:
        raise invalid("messages", "messages is required", "missing_required_parameter")
    req.messages = check_messages(body["messages"])
    req.prompt_param = "messages"
    return req


def parse_infer(body: Any) -> ApiRequest:
    """The original /infer body: {"input": str, "max_length": int (optional)}; greedy."""
    body = _check_fields(body, INFER_FIELDS)
    text = body.get("input")
    if not isinstance(text, str) or not text:
        raise invalid("input", "input must be a non-empty string",
                      "missing_required_parameter" if text is None else "invalid_value")
    max_length = None if body.get("max_length") is None else check_int(body["max_length"], "max_length", lo=1)
    return ApiRequest(kind="completion", prompt=text, prompt_param="input",
                      sampling=Sampling(max_tokens=max_length, temperature=0.0,
                                        max_tokens_param="max_length"))


def usage_dict(usage) -> dict[str, Any]:
    """OpenAI's usage block plus the speculative statistics, from a scheduler Usage message."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "steps": usage.steps,
        "drafted_tokens": usage.drafted_tokens,
        "accepted_tokens": usage.accepted_tokens,
        "mean_accepted_length": round(float(usage.mean_accepted_length), 4),
        "acceptance_rate": round(float(usage.acceptance_rate), 4),
    }


def total_usage(usages: list[scheduler_pb2.Usage]) -> scheduler_pb2.Usage:
    """The usage of a request's n samples together: the prompt once, everything else summed."""
    if len(usages) == 1:
        return usages[0]
    out = scheduler_pb2.Usage(prompt_tokens=usages[0].prompt_tokens)
    for u in usages:
        out.completion_tokens += u.completion_tokens
        out.steps += u.steps
        out.drafted_tokens += u.drafted_tokens
        out.accepted_tokens += u.accepted_tokens
    out.mean_accepted_length = out.completion_tokens / out.steps if out.steps else 0.0
    out.acceptance_rate = out.accepted_tokens / out.drafted_tokens if out.drafted_tokens else 0.0
    return out


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class OpenAIFormatter:
    """Response objects and stream chunks of one request, in the OpenAI shapes: `n` choices, one
    per sample. `token_text` names tokens in logprobs (needed when the request asks for them)."""

    kind: str  # "completion" or "chat"
    request_id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    token_text: TokenText | None = None
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    # completions' logprobs: per sample, the characters of the tokens already streamed
    text_offset: dict[int, int] = field(default_factory=dict)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, index: int, logprobs: Sequence | None) -> dict[str, Any] | None:
        """The choice's logprobs for these tokens' TokenLogprob messages (None: not asked for)."""
        if logprobs is None or self.token_text is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(logprobs, self.token_text)
        out = completion_logprobs(logprobs, self.token_text, self.text_offset.get(index, 0))
        self.text_offset[index] = self.text_offset.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def _choice(self, index: int, c) -> dict[str, Any]:
        """One sample's whole choice (c: its gateway Completion)."""
        if self.kind == "chat":
            choice = {"index": index, "message": {"role": "assistant", "content": c.text}}
        else:
            choice = {"index": index, "text": c.text}
        choice.update(logprobs=self._logprobs(index, c.logprobs), finish_reason=c.finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def response(self, completions: list) -> dict[str, Any]:
        """The whole (non-streamed) `text_completion` or `chat.completion` object of the samples'
        gateway Completions, usage summed."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [self._choice(i, c) for i, c in enumerate(completions)])
        out["usage"] = usage_dict(total_usage([c.usage for c in completions]))
        return out

    def _chunk(self, text: str | None, token_ids: list[int], finish_reason: str | None,
               role: bool = False, logprobs: Sequence | None = None, index: int = 0) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None and (text or role):
                delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=self._logprobs(index, logprobs), finish_reason=finish_reason)
        out = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if self.include_usage:
            out["usage"] = None
        return out

    def start_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any output: a chat stream opens each choice with the assistant role."""
        return [self._chunk("", [], None, role=True, index=i) for i in range(self.n)] if self.kind == "chat" else []

    def event_chunks(self, event) -> list[dict[str, Any]]:
        """Chunks for one scheduler GenerateEvent (none when it carries nothing to show); its
        tokens' logprobs go with it, even while a stop string holds its text back."""
        text, ids, finish = event.text, list(event.token_ids), event.finish_reason or None
        logprobs = list(event.logprobs) if event.logprobs else None
        if not (text or finish or (ids and (self.return_token_ids or logprobs))):
            return []
        return [self._chunk(text, ids, finish, logprobs=logprobs, index=event.index)]

    def usage_chunk(self, usage) -> dict[str, Any]:
        """The final chunk of a stream with stream_options.include_usage: no choices, usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage_dict(usage)
        return out


def models_response(model: str, root: str, context_length: int, created: int) -> dict[str, Any]:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [model_card(model, root, context_length, created)]}


def model_card(model: str, root: str, context_length: int, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "specserve",
            "root": root, "max_model_len": context_length}


def infer_response(text: str, latency_ms: float, usage) -> dict[str, Any]:
    """POST /infer: the seed API's answer."""
    return {"output": text, "latency_ms": round(latency_ms, 3), "tokens": usage.completion_tokens,
            "mean_accepted_length": round(float(usage.mean_accepted_length), 4),
            "acceptance_rate": round(float(usage.acceptance_rate), 4)}

