"""The target's hidden states of committed positions, carried from the verifier to a
feature-level draft (services/draft/head_proposer.py), in process and on the wire.

The verifier returns, with each verdict, the states of the positions the step committed to its
cache (the pending tokens and the accepted path: rows for positions start .. start + rows - 1),
at the layers the scheduler asked for; the scheduler hands them to the draft with the request's
next propose item. On the wire they are float16 bytes, rows x width, little-endian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HiddenStates:
    start: int  # position of the first row
    data: torch.Tensor  # [rows, layers * hidden] float16

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def to_bytes(self) -> bytes:
        return self.data.to(torch.float16).contiguous().numpy().astype("<f2", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, start: int, rows: int, width: int, data: bytes) -> "HiddenStates":
        """ValueError (naming what is wrong) for a size that does not match or a non-finite value."""
        if start < 0 or rows < 0 or width <= 0:
            raise ValueError(f"hidden states: start {start}, rows {rows}, width {width} out of range")
        if len(data) != 2 * rows * width:
            raise ValueError(f"hidden states: {len(data)} bytes for {rows} x {width} float16 values "
                             f"({2 * rows * width} expected)")
        array = np.frombuffer(data, dtype="<f2").reshape(rows, width)
        states = cls(start, torch.from_numpy(array.astype(np.float16)))
        states.check(width)
        return states

    def check(self, width: int) -> None:
        """ValueError for the wrong width or a NaN / infinite value."""
        if self.data.dim() != 2 or self.data.shape[1] != width:
            raise ValueError(f"hidden states have shape {tuple(self.data.shape)}, expected [rows, {width}]")
        # one reduction: a float64 sum of finite float16 / bfloat16 values is finite, and NaN or an
        # infinity makes it NaN or infinite
        if not math.isfinite(float(self.data.sum(dtype=torch.float64))):
            raise ValueError("hidden states contain NaN or infinite values")


def join(parts: list[HiddenStates]) -> list[HiddenStates]:
    """Merge runs of consecutive positions (what a draft that skipped steps is sent at once),
    concatenating each run once."""
    runs: list[list[HiddenStates]] = []
    for p in parts:
        if runs and runs[-1][-1].start + runs[-1][-1].rows == p.start:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else HiddenStates(r[0].start, torch.cat([p.data for p in r])) for r in runs]
