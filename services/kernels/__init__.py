"""Tree attention for the verifier: a CuPy CUDA kernel on CUDA devices, a torch reference elsewhere.

    attn = select_tree_attention(device)
    out = attn(q, k_caches, v_caches, prefix_lens, tree_sizes, parents, scale=None)

See reference.py (beside this file) for the shapes and the exact semantics, NOTES.md for the design.
"""

from __future__ import annotations

from typing import Callable

import torch

from services.kernels.reference import tree_attention_reference

__all__ = ["kernel_available", "select_tree_attention", "tree_attention_reference"]


def kernel_available() -> bool:
    """True when cupy imports and torch sees a CUDA device (the kernel can be launched)."""
    from services.kernels.tree_attention import cupy_available

    return cupy_available() and torch.cuda.is_available()


def select_tree_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    """The CUDA kernel wrapper for a CUDA device when cupy imports, the torch reference otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        from services.kernels.tree_attention import cupy_available, tree_attention_cuda

        if cupy_available():
            return tree_attention_cuda
    return tree_attention_reference
