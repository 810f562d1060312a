"""The native matmul on a GGUF file's own blocks, in float32 (`qmatmul.cpp`).

Each block is decoded to exactly the float32 weights of the dequantized model and multiplied
into float32 accumulators, so the only difference from float32 weights is the order of a sum;
torch's int4 route (`services.common.quant`) instead rounds activations to bfloat16. A row's
result does not depend on the other rows of the call (the kernel's comment says why). Built with
the other CPU kernels (`services.common.cpu_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common import cpu_kernels
from services.common.gguf_blocks import BlockTensor

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the kernel's block kinds


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
