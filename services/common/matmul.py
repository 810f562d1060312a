"""The model's dense matmul, x @ w.T (+ b), chosen by device, dtype and the number of rows.

On CPU in float32 no single library routine is fastest at every row count a serving step has,
and which one wins depends on the machine (`scripts/bench_matmul.py`, BENCHMARKS.md "Matmul
routes"). Over the default model's weights (~540 MB per step): on a 2-core Intel Xeon, MKL's
F.linear streams the weights near memory speed at 1-3 rows (26-30 ms) but jumps to 45-79 ms at
4-32 rows, where oneDNN on weights reordered once into its blocked layout takes 38-66 ms; on a
2-core AMD EPYC, F.linear takes 32-67 ms at every row count while the blocked route takes
14-16 ms from 1 to 8 rows. So each CPU float32 weight is kept twice (plain and blocked), and
`Matmul.tune` times both routes on the model's own weights once at load to find `small_rows`,
the row counts F.linear takes. Elsewhere (CUDA, half precision, or a build without oneDNN) it is
F.linear on plain weights at every row count. A weight read natively from a GGUF file's quantized
blocks (`services.common.quant`) has a single route, the native kernel, and no dense copy.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.common.qmatmul import BlockWeight, TileWeight
from services.common.quant import Int4Weight

# The row count oneDNN's blocked layout is tuned for (a typical verify step of a small batch).
PACK_ROWS = 16
# Tuning compares the routes at 1..MAX_SMALL_ROWS rows; above it the blocked route always wins.
MAX_SMALL_ROWS = 8
# Fixes small_rows instead of timing (e.g. the same route in every process of a test).
SMALL_ROWS_ENV = "SPECSERVE_MATMUL_SMALL_ROWS"

# MKL's vector math (torch's CPU cos, sin, exp...) computed the first call of a process at low
# accuracy (errors up to 1.5e-4 on the calling thread's share) in about a third of the processes
# whose first call came after `Matmul.tune`: a model's RoPE tables then differed between processes.
# One call before any matmul keeps every later call exact (tests/unit/test_llama_forward.py).
torch.ones(8).cos()


class Weight(NamedTuple):
    """A linear layer's weight: `dense` [out, in] and, where used, oneDNN's blocked copy of it;
    or, for a quantized one, only `native` (dense and packed None)."""

    dense: torch.Tensor | None
    packed: torch.Tensor | None
    native: TileWeight | BlockWeight | Int4Weight | None = None

    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes()
        blocked = 0 if self.packed is None else self.dense.numel() * self.dense.element_size()
        return self.dense.numel() * self.dense.element_size() + blocked


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _packing_works() -> bool:
    """oneDNN's reorder and linear exist in this build and agree with F.linear at a few row counts
    (checked once per process)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            w, b = torch.randn(96, 64), torch.randn(96)
            packed = _pack(w)
            for rows in (1, 4, PACK_ROWS + 5):
                x = torch.randn(rows, 64)
                if not torch.allclose(_packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                    return False
        return True
    except (AttributeError, RuntimeError):
        return False


_PACKING: bool | None = None


def pick_small_rows(timings: Callable[[int], tuple[float, float]], max_rows: int = MAX_SMALL_ROWS) -> int:
    """The largest r <= max_rows such that F.linear was faster than the blocked route at every row
    count 1..r (0: the blocked route from one row on). `timings(rows)` -> (F.linear s, blocked s);
    asked for increasing rows, and no further than the first row count the blocked route wins."""
    small = 0
    for rows in range(1, max_rows + 1):
        linear_s, blocked_s = timings(rows)
        if linear_s >= blocked_s:
            break
        small = rows
    return small


class Matmul:
    """Builds `Weight`s for one model and multiplies by them: `matmul(x [rows, in], weight, bias)`
    -> [rows, out]. Rows up to `small_rows` take F.linear on the plain weight, more rows the
    blocked copy (where there is one)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        global _PACKING
        self.pack = False
        if device.type == "cpu" and dtype == torch.float32:
            if _PACKING is None:
                _PACKING = _packing_works()
            self.pack = _PACKING
        self.small_rows = 0

    def weight(self, w: torch.Tensor) -> Weight:
        if not self.pack:
            return Weight(w, None)
        with torch.inference_mode():
            return Weight(w, _pack(w))

    @torch.inference_mode()
    def tune(self, weights: Sequence[Weight], repeats: int = 5) -> int:
        """Set `small_rows` from timing both routes over `weights` (a whole forward's: weights that
        fit in the CPU's cache would time the cache, not the memory a step streams from), median
        of `repeats` interleaved runs after an untimed one; `SPECSERVE_MATMUL_SMALL_ROWS` fixes it
        instead. Without a blocked route it stays 0 (F.linear at every row count)."""
        weights = [w for w in weights if w.packed is not None]
        if not weights:
            return self.small_rows
        fixed = os.environ.get(SMALL_ROWS_ENV, "").strip()
        if fixed:
            self.small_rows = max(0, int(fixed))
            return self.small_rows

        def run(route: str, xs: list[torch.Tensor]) -> float:
            t0 = time.perf_counter()
            for x, w in zip(xs, weights):
                if route == "linear":
                    F.linear(x, w.dense)
                else:
                    _packed_linear(x, w.packed, None)
            return time.perf_counter() - t0

        def timings(rows: int) -> tuple[float, float]:
            xs = [torch.randn(rows, w.dense.shape[1], dtype=w.dense.dtype) for w in weights]
            run("linear", xs), run("blocked", xs)  # untimed: oneDNN builds kernels per row count
            pairs = [(run("linear", xs), run("blocked", xs)) for _ in range(repeats)]
            return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)

        self.small_rows = pick_small_rows(timings)
        return self.small_rows

    def __call__(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.native is not None:
            return w.native.linear(x, b)
        if w.packed is None or x.shape[0] <= self.small_rows:
            return F.linear(x, w.dense, b)
        return _packed_linear(x, w.packed, b)
