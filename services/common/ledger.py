"""The committed tokens a worker has been sent, per request.

Step messages carry only the tokens a worker has not seen yet: `offset` (how many it already
has) and `tokens` (the rest). A worker that lost its state, or a new replica, cannot extend an
offset it never saw and answers `need_resync`; the scheduler then resends from offset 0.

Given the model's vocabulary size and context length, the ledger also refuses (ValueError, which
the step stream answers with INVALID_ARGUMENT) token ids outside the vocabulary, a request with
no committed token, and more committed tokens than the context holds: the model would otherwise
index past its embedding or position tables, or allocate caches of any size a client asks for.
"""

from __future__ import annotations


class TokenLedger:
    def __init__(self, vocab_size: int | None = None, max_positions: int | None = None) -> None:
        self._tokens: dict[str, list[int]] = {}
        self.vocab_size = vocab_size or None  # None (or 0): token ids are not checked
        self.max_positions = max_positions or None  # None (or 0): no length limit

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._tokens

    def ids(self) -> list[str]:
        return list(self._tokens)

    def update(self, req_id: str, offset: int, tokens: list[int]) -> list[int] | None:
        """All committed tokens after this update, or None when a resync is needed. Raises
        ValueError (before changing anything) for tokens the model cannot take."""
        known = self._tokens.get(req_id)
        if offset == 0:
            known = []
        elif known is None or offset > len(known) or offset < 0:
            return None
        self._check(req_id, offset, tokens)
        del known[offset:]
        known.extend(tokens)
        self._tokens[req_id] = known
        return known

    def _check(self, req_id: str, offset: int, tokens: list[int]) -> None:
        total = offset + len(tokens)
        if total == 0:
            raise ValueError(f"request {req_id!r}: no committed token (a request needs at least one)")
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(f"request {req_id!r}: {total} committed tokens exceed the context of "
                             f"{self.max_positions} tokens")
        if self.vocab_size is not None:
            bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {req_id!r}: token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def release(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
