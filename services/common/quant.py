"""Linear layers on a GGUF file's own quantized blocks: the route for a block, and torch's int4 one.

`native_weight` takes the CPU kernels of `services.common.qmatmul` where they build on this
machine: integer dot products on int8-rounded activations (`TileWeight`: Q4_0, Q4_1 and Q8_0
weights whose outputs come in sixteens), else the float32 block kernel (`BlockWeight`); torch's
int4 CPU matmul (below) where they do not. `SPECSERVE_NATIVE_MATMUL=float` keeps every weight on
the float32 kernel, `int4` forces torch's route (comparisons). All hold the weights at the file's size.

torch's `_weight_int4pack_mm_for_cpu` computes x @ w.T with w = (q - 8) * scale + zero per group
of 32 inputs, q in 0..15: exactly the form of GGUF's 32-value blocks. Q4_0 (value (q - 8) * d) is
scale d, zero 0; Q4_1 (q * d + m) is scale d, zero m + 8d. Q8_0 (q * d, q in -128..127) splits
into two 4-bit planes of u = q + 128 = 16 * hi + lo: w = 16d (hi - 8) + d (lo - 8) + 8d, two
matmuls over the same activations. The kernel wants bfloat16 activations (float32 ones take a
path about 30 times slower), so inputs, scales and zeros are rounded to bfloat16 and the
product comes back in bfloat16; the accuracy this costs is bounded in tests/unit/test_native_weights.py.
Rows are independent: a row's output does not depend on the other rows of the call (the verify
and plain decoding paths agree bitwise), also checked there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.common import qmatmul
from services.common.gguf_blocks import BLOCK, BlockTensor

INNER_K_TILES = 2  # the CPU layout's k tiling (inputs a multiple of 64)
ROUTE_ENV = "SPECSERVE_NATIVE_MATMUL"  # auto (default), float or int4
ROUTES = ("auto", "float", "int4")
# a feature head's linears when served (services/draft/feature_head.py): auto (q4 where the
# kernels are built), q4 (Q4_1 tiles), q8 (Q8_0 blocks) or float
HEAD_WEIGHTS_ENV = "SPECSERVE_HEAD_WEIGHTS"
HEAD_WEIGHT_KINDS = ("auto", "q4", "q8", "float")


@dataclass
class Int4Plane:
    packed: torch.Tensor  # torch's int4 CPU layout of q [out, in]
    scale_zeros: torch.Tensor  # [in / 32, out, 2] bfloat16


@dataclass
class Int4Weight:
    """A linear weight [out, in] as one (Q4) or two (Q8_0) int4 planes whose products add up."""

    planes: list[Int4Plane]
    shape: tuple[int, int]

    rounds_activations = True  # to bfloat16: see the module's docstring

    def nbytes(self) -> int:
        return sum(p.packed.numel() * p.packed.element_size() + p.scale_zeros.numel() * 2 for p in self.planes)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, self, bias)


def _plane(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Plane:
    # q [out, in] in 0..15; scale, zero [out, blocks]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Plane(packed, sz)


def supports(block: BlockTensor) -> bool:
    """Whether the int4 route takes this weight's shape (its layout tiles inputs by 64, outputs by 16)."""
    out, k = block.shape
    return k % (BLOCK * INNER_K_TILES) == 0 and out % 16 == 0


def pack(block: BlockTensor) -> Int4Weight:
    q, scale, low = block.decode()
    if block.kind == "Q8_0":
        u = q + 128  # 0..255
        planes = [_plane(u >> 4, 16 * scale, torch.zeros_like(scale)), _plane(u & 15, scale, 8 * scale)]
    elif block.kind == "Q4_0":
        planes = [_plane(q + 8, scale, torch.zeros_like(scale))]
    else:  # Q4_1
        planes = [_plane(q, scale, low + 8 * scale)]
    return Int4Weight(planes, block.shape)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] (any float dtype) @ w.T (+ bias) -> [rows, out] in x's dtype."""
    xb = x.to(torch.bfloat16)
    y = None
    for p in w.planes:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.packed, BLOCK, p.scale_zeros).to(x.dtype)
        y = part if y is None else y + part
    return y if bias is None else y + bias


def native_weight(block: BlockTensor) -> "qmatmul.TileWeight | qmatmul.BlockWeight | Int4Weight | None":
    """The weight as a native route runs it, or None where none takes it (dequantize then)."""
    route = os.environ.get(ROUTE_ENV, "auto").strip() or "auto"
    if route not in ROUTES:
        raise ValueError(f"{ROUTE_ENV} must be one of {', '.join(ROUTES)}, not {route!r}")
    if route == "auto" and qmatmul.supports_tiles(block):
        return qmatmul.pack_tiles(block)
    if route != "int4" and qmatmul.supports(block):
        return qmatmul.BlockWeight(block)
    return pack(block) if supports(block) else None
