"""CuPy wrapper around services/kernels/tree_attention_*.cu (same call as services.kernels.reference).

    out = tree_attention_cuda(q, k_caches, v_caches, prefix_lens, tree_sizes, parents, scale=None)

Shapes and semantics: reference.py. Every input is validated from tensor metadata before
anything is launched (ValueError naming the argument). cupy is imported lazily, so this module
imports on a machine without cupy or a GPU. The per-request caches are read in place: the kernel
gets one int64 metadata row per request (K/V pointers, head and row strides, L, T, q offset).

`prepare_tree_attention` returns a launch with every argument already on the device, so a caller
(or a benchmark) can validate once and launch many times; `tree_attention_cuda` is
`prepare_tree_attention(...).run()`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from services.kernels.validation import check_tree_attention_inputs

__all__ = [
    "CUDA_SOURCE_PATHS", "cuda_source", "TreeAttentionLaunch", "VARIANTS", "build_metadata", "cupy_available",
    "kernel_name", "mma_smem_bytes", "prepare_tree_attention", "tree_attention_cuda",
]

# One NVRTC source, joined in this order (NVRTC has no include path to our directory by default).
CUDA_SOURCE_PATHS = tuple(Path(__file__).with_name(f"tree_attention_{part}.cu")
                          for part in ("common", "mma", "simple", "entry"))
NVRTC_OPTIONS = ("-std=c++17",)
VARIANTS = ("mma", "simple")  # mma: tensor-core kernel; simple: one warp per (node, head)
# These mirror the constants in namespace ta of tree_attention_common.cu.
MMA_THREADS = 256
MMA_BLOCK_M = 128
MMA_BLOCK_N = 64
MMA_STAGES = 3
SIMPLE_WARPS = 4
META_FIELDS = 9  # k_ptr, v_ptr, k_head_stride, k_row_stride, v_head_stride, v_row_stride, L, T, q_off
MAX_GRID_YZ = 65535
LOG2E = 1.4426950408889634


def cuda_source() -> str:
    """The kernels' CUDA source: the tree_attention_*.cu parts joined in order."""
    return "\n".join(path.read_text() for path in CUDA_SOURCE_PATHS)


def cupy_available() -> bool:
    """True when cupy imports (it may still find no GPU)."""
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CUDA library error raised while importing
        return False
    return True


def kernel_name(variant: str, dtype: torch.dtype, head_dim: int) -> str:
    """extern "C" entry point, e.g. tree_attention_mma_bf16_d128."""
    suffix = "bf16" if dtype == torch.bfloat16 else "f16"
    return f"tree_attention_{variant}_{suffix}_d{head_dim}"


def mma_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the mma kernel: K and V tiles (rows padded by 8) for all stages."""
    return MMA_STAGES * 2 * MMA_BLOCK_N * (head_dim + 8) * 2


def build_metadata(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                   prefix_lens: Sequence[int], tree_sizes: Sequence[int]) -> torch.Tensor:
    """[B, META_FIELDS] int64 on the CPU; strides in elements; q_off = rows of earlier requests."""
    rows = []
    q_off = 0
    for k_cache, v_cache, prefix_len, tree_size in zip(k_caches, v_caches, prefix_lens, tree_sizes):
        rows.append([k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                     v_cache.stride(0), v_cache.stride(1), prefix_len, tree_size, q_off])
        q_off += tree_size
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), META_FIELDS)


@functools.lru_cache(maxsize=None)
def _load_kernel(device_index: int, name: str, dynamic_smem: int):
    """Compile the module (once per device, NVRTC) and fetch one entry point."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = _load_module(device_index)
        function = module.get_function(name)
        if dynamic_smem > 48 * 1024:  # above 48 KB a kernel must opt in
            function.max_dynamic_shared_size_bytes = dynamic_smem
    return function


@functools.lru_cache(maxsize=None)
def _load_module(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=cuda_source(), options=NVRTC_OPTIONS)


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


@dataclass
class TreeAttentionLaunch:
    """Validated launch: device-side arguments kept alive here; run() launches on torch's stream."""

    variant: str
    q: torch.Tensor  # [N, H, D]
    out: torch.Tensor  # [N, H, D]
    parents: torch.Tensor  # [N] int32 on q's device
    meta: torch.Tensor  # [B, META_FIELDS] int64 on q's device
    num_kv_heads: int
    max_tree: int
    scale_log2: float

    def run(self) -> torch.Tensor:
        """Launch the kernel; return `out` ([N, H, D], q's dtype)."""
        num_nodes, num_heads, head_dim = self.q.shape
        num_requests = self.meta.shape[0]
        if num_nodes == 0:
            return self.out
        import cupy

        args_head = (_ptr(self.q), _ptr(self.out), _ptr(self.parents), _ptr(self.meta))
        scale_log2 = np.float32(self.scale_log2)
        device_index = self.q.device.index if self.q.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(self.q.device).cuda_stream
        with cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(stream):
            if self.variant == "mma":
                smem = mma_smem_bytes(head_dim)
                kernel = _load_kernel(device_index, kernel_name("mma", self.q.dtype, head_dim), smem)
                group = num_heads // self.num_kv_heads
                row_tiles = math.ceil(self.max_tree * group / MMA_BLOCK_M)
                kernel((row_tiles, self.num_kv_heads, num_requests), (MMA_THREADS, 1, 1),
                       args_head + (np.int32(num_heads), np.int32(self.num_kv_heads), scale_log2),
                       shared_mem=smem)
            else:
                kernel = _load_kernel(device_index, kernel_name("simple", self.q.dtype, head_dim), 0)
                kernel((math.ceil(num_heads / SIMPLE_WARPS), num_nodes, 1), (SIMPLE_WARPS * 32, 1, 1),
                       args_head + (np.int32(num_requests), np.int32(num_heads),
                                    np.int32(self.num_kv_heads), scale_log2))
        return self.out


def prepare_tree_attention(
    q: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    prefix_lens,
    tree_sizes,
    parents: torch.Tensor,
    scale: float | None = None,
    *,
    check_parents: bool = True,
    variant: str = "mma",
    out: torch.Tensor | None = None,
) -> TreeAttentionLaunch:
    """Validate everything, move the metadata to the device, return a launch (nothing runs yet).

    check_parents=False skips the one check that reads `parents` (a device sync); the kernel
    stays memory-safe on malformed parents but its output is then meaningless.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    prefix_list, tree_list = check_tree_attention_inputs(
        q, k_caches, v_caches, prefix_lens, tree_sizes, parents, for_kernel=True,
        require_cuda=True, check_parents=check_parents)
    num_nodes, num_heads, head_dim = q.shape
    num_requests = len(tree_list)
    if num_requests > MAX_GRID_YZ:
        raise ValueError(f"tree_sizes: at most {MAX_GRID_YZ} requests per launch, got {num_requests}")
    if variant == "simple" and num_nodes > MAX_GRID_YZ:
        raise ValueError(f"q: the simple variant takes at most {MAX_GRID_YZ} nodes, got {num_nodes}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {q.dtype} tensor of shape {tuple(q.shape)} "
                         f"on {q.device}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    meta = build_metadata(k_caches, v_caches, prefix_list, tree_list).to(q.device)
    return TreeAttentionLaunch(
        variant=variant, q=q, out=out, parents=parents.to(torch.int32).contiguous(), meta=meta,
        num_kv_heads=k_caches[0].shape[0] if num_requests else 1,
        max_tree=max(tree_list, default=0), scale_log2=float(scale) * LOG2E)


def tree_attention_cuda(
    q: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    prefix_lens,
    tree_sizes,
    parents: torch.Tensor,
    scale: float | None = None,
    *,
    check_parents: bool = True,
    variant: str = "mma",
) -> torch.Tensor:
    """Tree attention on a CUDA device with the CuPy kernel; same semantics as the reference."""
    return prepare_tree_attention(q, k_caches, v_caches, prefix_lens, tree_sizes, parents, scale,
                                  check_parents=check_parents, variant=variant).run()
