"""The native matmuls on a GGUF file's own blocks (`qmatmul.cpp`, `q8matmul.cpp`).

`BlockWeight` (any of Q4_0, Q4_1, Q8_0): each block is decoded to exactly the float32 weights of
the dequantized model and multiplied into float32 accumulators, so the only difference from
float32 weights is the order of a sum. `TileWeight` (Q4_0, Q4_1, Q8_0; the served route for
them): the blocks repacked 16 outputs to a tile, multiplied by activations rounded to int8 per
block of 32 in exact integer sums, as llama.cpp does: 2 to 3 times faster for 4-bit layers, and
on the Q8_0 LM head a verify tree's rows cost little more than one (BENCHMARKS.md), at the
accuracy tests/unit/test_native_weights.py bounds. torch's int4 route (`services.common.quant`)
rounds activations to bfloat16. On each, a row's result does not depend on the other rows of the
call (the kernels' comments say why). Built with the other CPU kernels
(`services.common.cpu_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common import cpu_kernels
from services.common.gguf_blocks import BlockTensor

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the kernel's block kinds
TILES = 3  # layers.cpp's kind for a TileWeight's tiles (q8matmul.cpp)


@dataclass
class BlockWeight:
    """A linear weight [out, in] as the file's blocks; multiplied by `qmatmul.cpp`."""

    block: BlockTensor

    rounds_activations = False  # float32 in, float32 accumulation

    @property
    def shape(self) -> tuple[int, int]:
        return self.block.shape

    def nbytes(self) -> int:
        return self.block.nbytes()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ w.T (+ bias) -> [rows, out] in x's dtype."""
        y = torch.ops.specserve_q.qmatmul(x.float().contiguous(), self.block.raw, KINDS[self.block.kind])
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def supports(block: BlockTensor) -> bool:
    return block.kind in KINDS and cpu_kernels.available()


def block_rows(block: BlockTensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), in] rows of a weight kept in its blocks (the embedding's lookup): the
    block kernel's decode where this process has loaded it, else BlockTensor.dequantize (the same
    values: each is q * d + m with an exact product)."""
    if block.kind in KINDS and cpu_kernels.loaded():
        return torch.ops.specserve_q.block_rows(block.raw, ids.cpu(), KINDS[block.kind])
    return block.dequantize(ids.cpu())


TILE = 16  # outputs per tile of q8matmul.cpp


@dataclass
class TileWeight:
    """A 4-bit or Q8_0 linear weight [out, in] repacked for `q8matmul.cpp`: `tiles` [out / 16,
    blocks * 320 (4-bit) or 544 (Q8_0)] uint8, per tile and block the 16 outputs' quants
    interleaved by 4 inputs, then their scales d (and for 4 bits offsets m) in float16 (a weight
    is q * d + m)."""

    tiles: torch.Tensor
    shape: tuple[int, int]

    rounds_activations = True  # to int8 per block of 32

    def nbytes(self) -> int:
        return self.tiles.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ w.T (+ bias) -> [rows, out] in x's dtype."""
        y = torch.ops.specserve_q.q8matmul(x.float().contiguous(), self.tiles).to(x.dtype)
        return y if bias is None else y + bias


def pack_tiles(block: BlockTensor) -> TileWeight:
    """A Q4_0, Q4_1 or Q8_0 weight in q8matmul.cpp's tiles (the same bytes as the file's blocks)."""
    out, k = block.shape
    q, scale, low = block.decode()  # q [out, in] (Q4_0's already less 8), scale, low [out, blocks]
    if block.kind == "Q8_0":
        return _pack_q8_tiles(q, scale)
    if low is None:  # Q4_0: (q - 8) d = q d + m with m = -8 d
        q, low = q + 8, -8 * scale
    blocks = k // 32
    # q[16 g + j, 32 b + 16 h + 4 t + i] -> [g, b, t, j, i] with h (low, high nibble) combined
    q = q.to(torch.uint8).view(out // TILE, TILE, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out // TILE, blocks, 256)
    halves = [v.half().view(out // TILE, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
              for v in (scale, low)]  # [g, b, 32] each
    tiles = torch.cat([nibbles, *halves], dim=-1).reshape(out // TILE, blocks * 320)
    return TileWeight(tiles.contiguous(), (out, k))


def _pack_q8_tiles(q: torch.Tensor, scale: torch.Tensor) -> TileWeight:
    """q [out, in] (-128..127), scale [out, blocks] -> 544 bytes a tile-block: 8 groups of the 16
    outputs' 4 signed bytes, then their 16 scales."""
    out, k = q.shape
    blocks = k // 32
    # q[16 g + j, 32 b + 4 t + i] -> [g, b, t, j, i]
    quants = q.to(torch.int8).view(out // TILE, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    quants = quants.reshape(out // TILE, blocks, 512).view(torch.uint8)
    d = scale.half().view(out // TILE, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    tiles = torch.cat([quants, d], dim=-1).reshape(out // TILE, blocks * 544)
    return TileWeight(tiles.contiguous(), (out, k))


def supports_tiles(block: BlockTensor) -> bool:
    return block.kind in ("Q4_0", "Q4_1", "Q8_0") and block.shape[0] % TILE == 0 and cpu_kernels.available()
