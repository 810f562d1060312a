"""Incremental detokenization and stop strings.

Decoding token by token can split a multi-byte character or change how a word boundary renders,
so new text is taken as the difference between decoding a short window with and without the
newest tokens, and held back while it ends in an incomplete character.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        # Output text is what decoding the output tokens alone gives (as tokenizer.decode does);
        # the prompt is not used as context.
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens before this are already in `text`
        self.text = ""
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars a stop string may still claim

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str | None:
        """Append one token. Returns the stop string it completed, or None."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        at, s = min(hits)
        self.text = self.text[:at]
        return s

    def stable_text(self) -> str:
        """Text that no stop string can still truncate (for streaming while running)."""
        return self.text[: max(0, len(self.text) - self.hold)] if self.stop else self.text
