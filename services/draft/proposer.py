"""The proposer interface: whatever proposes draft trees (a draft model, an n-gram lookup)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from services.common.sampling import SamplingParams
from services.common.tree import DraftTree


@dataclass
class ProposeItem:
    req_id: str
    tokens: list[int]  # every committed token of the request (prompt + output so far)
    draft_length: int  # maximum tree depth k; 0 = no speculation this step
    tree_size: int  # node budget; equal to draft_length = a chain
    params: SamplingParams
    generator: torch.Generator | None  # the request's draft random stream (T > 0)


class Proposer(ABC):
    """Proposes one draft tree per request per step; keeps whatever per-request state it needs,
    rebuilt from the committed tokens when missing or stale."""

    name = "proposer"
    max_positions: int | None = None  # the draft's context, when it has one
    runs_model = True  # False: no torch work (a draft service then steps it on its event loop)

    @abstractmethod
    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        """One tree per item (empty when item.draft_length == 0)."""

    def release(self, req_id: str) -> None:
        """Forget a finished or cancelled request."""

    def active_requests(self) -> list[str]:
        return []

    def cache_bytes(self) -> int:
        """Bytes of per-request cache held (0 for a proposer without one)."""
        return 0
