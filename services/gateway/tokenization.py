"""PromptTokenizer: turns prompts and chat messages into the target's token ids.

The gateway loads only the target's tokenizer and config (no weights). Prompts are encoded
without added special tokens, exactly as `specserve generate` does; chat messages go through the
tokenizer's chat template with the generation prompt appended, rendered to text and then encoded
the same way (which is what `apply_chat_template(tokenize=True)` does), so HTTP, gRPC and the CLI
give the scheduler identical ids for the same input.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.gateway.errors import ApiError, invalid

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")


class PromptTokenizer:
    """The target's tokenizer plus the model facts that limit a prompt (context, vocabulary)."""

    def __init__(self, tokenizer, context_length: int, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.context_length = int(context_length)
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))

    @classmethod
    def load(cls, spec: str) -> "PromptTokenizer":
        """Load the tokenizer and context length of a target spec ("default", a .gguf file or a
        checkpoint directory). A GGUF target is dequantized into the shared cache on first use."""
        from transformers import AutoConfig, AutoTokenizer

        from services.common.loading import resolve_checkpoint
        from services.common.model_config import ModelConfig

        ckpt: Path = resolve_checkpoint(spec)
        config = ModelConfig.from_hf(AutoConfig.from_pretrained(ckpt))
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        log.info("tokenizer of %s loaded from %s (context %d tokens)", spec, ckpt, config.max_positions)
        return cls(tokenizer, config.max_positions, config.vocab_size)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt (no BOS or other special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs name it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]], param: str = "messages") -> str:
        """The chat template applied to `messages` (dicts with role and content), ending with the
        assistant's generation prompt. A 400 when the model has no template or it refuses them."""
        if not self.has_chat_template:
            raise invalid(param, "this model has no chat template: use /v1/completions with a "
                          "plain prompt", "chat_template_missing")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:  # a template may raise on role orders it does not support
            raise invalid(param, f"the chat template rejected the messages: {e}",
                          "chat_template_error") from e

    def encode_chat(self, messages: list[dict[str, str]], param: str = "messages") -> list[int]:
        return self.encode(self.render_chat(messages, param))

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """Token ids given directly by a client must be inside the vocabulary."""
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise invalid(param, f"{param} holds token id {i!r} outside the vocabulary "
                              f"[0, {self.vocab_size})")
        return list(ids)


def check_messages(messages, param: str = "messages") -> list[dict[str, str]]:
    """Validate chat messages into [{"role", "content"}] dicts for the chat template.

    Content is a string or a list of text parts ({"type": "text", "text": ...}); "developer" is
    OpenAI's newer name for "system".
    """
    if not isinstance(messages, list) or not messages:
        raise invalid(param, f"{param} must be a non-empty list of messages")
    out = []
    for n, m in enumerate(messages):
        where = f"{param}[{n}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object with role and content")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of system, user, assistant, "
                          f"developer; got {role!r}")
        out.append({"role": role, "content": _content_text(m.get("content"), f"{where}.content")})
    return out


def _content_text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(param, f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                              "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{param} must be a string or a list of text parts", param=param,
                   code="invalid_type")
