"""The committed tokens a worker has been sent, per request.

Step messages carry only the tokens a worker has not seen yet: `offset` (how many it already
has) and `tokens` (the rest). A worker that lost its state, or a new replica, cannot extend an
offset it never saw and answers `need_resync`; the scheduler then resends from offset 0.
"""

from __future__ import annotations


class TokenLedger:
    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._tokens

    def ids(self) -> list[str]:
        return list(self._tokens)

    def update(self, req_id: str, offset: int, tokens: list[int]) -> list[int] | None:
        """All committed tokens after this update, or None when a resync is needed."""
        known = self._tokens.get(req_id)
        if offset == 0:
            known = []
        elif known is None or offset > len(known) or offset < 0:
            return None
        del known[offset:]
        known.extend(tokens)
        self._tokens[req_id] = known
        return known

    def release(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
