"""Prompts the target writes itself: its chat template up to the start of a user turn, sampled
until the turn ends (the Magpie method, Xu et al. 2024). An instruction-tuned target then writes
the kinds of request it was tuned on, far more varied than the templates of prompts.py, and
still from the target alone (never Spec-Bench)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MARK = "\x00PROMPT\x00"  # stands for the user's text while the template is rendered


def user_turn(tokenizer) -> tuple[list[int], int]:
    """(the template's ids up to where a user's text starts, the id that ends a user turn)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    prefix, suffix = text.split(MARK)
    ends = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    if not ends:
        raise ValueError("the chat template ends a user turn with nothing: no prompt end to sample to")
    return tokenizer(prefix, add_special_tokens=False)["input_ids"], ends[0]


def write(answer: Callable, tokenizer, n: int, seed: int, max_tokens: int = 96, rounds: int = 8) -> list[str]:
    """n distinct prompts the target writes, sampled at T = 1 (top-p 0.95). `answer(prompts,
    temperatures, eos_ids, max_tokens, seed)` is a teacher's generate returning Samples. A prompt
    counts only if its turn ended within max_tokens and it has three words or more."""
    prefix, end = user_turn(tokenizer)
    out: list[str] = []
    seen: set[str] = set()
    for r in range(rounds):
        want = n - len(out)
        if want <= 0:
            break
        ask = want + want // 4 + 8  # some are cut or too short
        for s in answer([prefix] * ask, [1.0] * ask, (end,), max_tokens, seed * 1009 + r):
            answered = s.ids[s.prompt_len :]
            text = tokenizer.decode(answered[:-1], skip_special_tokens=True).strip()
            if answered[-1] == end and len(text.split()) >= 3 and text not in seen and len(out) < n:
                seen.add(text)
                out.append(text)
        log.info("self-written prompts: %d of %d after round %d", len(out), n, r + 1)
    return out
