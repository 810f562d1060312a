"""A prompt's token ids as the CLI and the benchmarks encode it (the gateway applies chat
templates per message: services/gateway/tokenization.py)."""

from __future__ import annotations


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """`prompt` as one user turn of the target's chat template (`chat`), else as plain text."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
