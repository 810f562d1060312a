"""The model's dense matmul, x @ w.T (+ b), chosen by device, dtype and the number of rows.

On CPU in float32 no single library routine is fastest at every row count a serving step has.
Measured on the 2-core Xeon of BENCHMARKS.md ("Matmul routes", `scripts/bench_matmul.py`), over
the default model's weights (one step reads ~540 MB; the memory floor is ~21 ms): at 1-3 rows
(plain decoding, short drafts) MKL's F.linear streams the weights near memory speed (26-30 ms)
while oneDNN takes 41-50 ms; at 4-32 rows (verifying a tree, a batch of streams) F.linear jumps
to 48-79 ms, oneDNN on plain weights takes 51-82 ms, and oneDNN on weights reordered once into
its blocked layout 39-70 ms. So each CPU float32 weight is kept twice (plain and blocked: twice
the weight memory) and each call takes the faster route. Elsewhere (CUDA, half precision, or a
build without oneDNN) it is F.linear on plain weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Up to this many rows F.linear reads the weights fastest; above it the blocked oneDNN copy.
SMALL_ROWS = 3
# The row count oneDNN's blocked layout is tuned for (a typical verify step of a small batch).
PACK_ROWS = 16


class Weight(NamedTuple):
    """A linear layer's weight: `dense` [out, in] and, where used, oneDNN's blocked copy of it."""

    dense: torch.Tensor
    packed: torch.Tensor | None


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _packing_works() -> bool:
    """oneDNN's reorder and linear exist in this build and agree with F.linear at both routes'
    row counts (checked once per process)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            w, b = torch.randn(96, 64), torch.randn(96)
            packed = _pack(w)
            for rows in (1, SMALL_ROWS + 1, PACK_ROWS + 5):
                x = torch.randn(rows, 64)
                if not torch.allclose(_packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                    return False
        return True
    except (AttributeError, RuntimeError):
        return False


_PACKING: bool | None = None


class Matmul:
    """Builds `Weight`s for one model and multiplies by them: `matmul(x [rows, in], weight, bias)`
    -> [rows, out]."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        global _PACKING
        self.pack = False
        if device.type == "cpu" and dtype == torch.float32:
            if _PACKING is None:
                _PACKING = _packing_works()
            self.pack = _PACKING

    def weight(self, w: torch.Tensor) -> Weight:
        if not self.pack:
            return Weight(w, None)
        with torch.inference_mode():
            return Weight(w, _pack(w))

    def __call__(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.packed is None or x.shape[0] <= SMALL_ROWS:
            return F.linear(x, w.dense, b)
        return _packed_linear(x, w.packed, b)
