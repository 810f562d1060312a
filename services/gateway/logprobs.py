"""Logprobs in OpenAI's shapes, from the scheduler's TokenLogprob messages (one per output token:
its log-probability under the request's sampling distribution and the alternatives asked for).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, where
each top_logprobs entry holds the alternatives and the chosen token, as vLLM and OpenAI's legacy
API give them. A token's text is its own decoding (special tokens included); `bytes` is that
text's UTF-8 (a token holding part of a character shows U+FFFD there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TokenText = Callable[[int], str]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: Sequence, token_text: TokenText) -> dict[str, Any]:
    content = []
    for t in logprobs:
        entry = _entry(token_text(t.token_id), t.logprob)
        entry["top_logprobs"] = [_entry(token_text(i), v) for i, v in zip(t.top_ids, t.top_logprobs)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(logprobs: Sequence, token_text: TokenText, offset: int = 0) -> dict[str, Any]:
    """`offset`: the text offset of the first token (its characters before, in this completion)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in logprobs:
        text = token_text(t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        top = {token_text(i): v for i, v in zip(t.top_ids, t.top_logprobs)}
        top.setdefault(text, t.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out
