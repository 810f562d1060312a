"""Preallocated key/value cache of one sequence, for every layer of one model.

Slots are filled in order: the committed prefix first, then the pending tokens and draft tree
nodes of the current step. After verification `keep` moves the accepted path next to the prefix
and drops the rest, so nothing is ever recomputed; rollback is moving `length` back.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one sequence: `k`, `v` are [layers, kv_heads, capacity, head_dim].

    Every method that allocates or writes runs in inference mode, like the forward that fills the
    cache, so the tensors are always inference tensors whoever calls.
    """

    @torch.inference_mode()
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, kv_heads, max(capacity, 1), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0  # valid slots

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @torch.inference_mode()
    def reserve(self, needed: int) -> None:
        """Make room for `needed` slots in total, growing geometrically (copying valid slots)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        layers, kv_heads, _, head_dim = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((layers, kv_heads, capacity, head_dim))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    @torch.inference_mode()
    def fork(self, length: int, capacity: int) -> "KVCache":
        """A new cache holding a copy of this one's first `length` slots, room for `capacity`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot fork {length} slots of a cache of length {self.length}")
        layers, kv_heads, _, head_dim = self.k.shape
        out = KVCache(layers, kv_heads, head_dim, max(capacity, length), self.k.dtype, self.k.device)
        out.k[:, :, :length] = self.k[:, :, :length]
        out.v[:, :, :length] = self.v[:, :, :length]
        out.length = length
        return out

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` slots."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @torch.inference_mode()
    def keep(self, start: int, slots: list[int]) -> None:
        """Keep slots[0..m) as slots start..start+m and drop every slot after them.

        `slots` must be increasing and each >= its destination (an accepted tree path always is,
        since nodes are stored in creation order after their parents).
        """
        if slots:
            src = torch.tensor(slots, dtype=torch.long, device=self.k.device)
            if slots != list(range(start, start + len(slots))):
                # Advanced indexing gathers into a temporary first, so overlapping moves are safe.
                self.k[:, :, start : start + len(slots)] = self.k[:, :, src]
                self.v[:, :, start : start + len(slots)] = self.v[:, :, src]
        self.length = start + len(slots)
