"""Input checks shared by the tree-attention reference and the CUDA wrapper.

Everything here reads tensor metadata only (no cupy, no GPU); the optional parent-value check reads
`parents` itself, which costs one device sync when it lives on a GPU. Every error is a ValueError
whose message starts with the offending argument, e.g.
"k_caches[3]: expected dtype torch.float16 like q, got torch.float32".
"""

from __future__ import annotations

from typing import Sequence

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_MAX_TREE = 256  # the kernel keeps each node's ancestors as a 4 x 64-bit bitset
KERNEL_ALIGN_BYTES = 16  # K/V rows are copied to shared memory in 16-byte chunks

__all__ = [
    "KERNEL_ALIGN_BYTES", "KERNEL_DTYPES", "KERNEL_HEAD_DIMS", "KERNEL_MAX_TREE",
    "check_tree_attention_inputs",
]


def _int_list(name: str, value) -> list[int]:
    """A list/tuple of ints or a 1-D integer tensor -> list[int] (non-negative)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {value.dtype} with shape "
                             f"{tuple(value.shape)}")
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{name}: expected a list of ints or a 1-D int tensor, got "
                         f"{type(value).__name__}")
    result = []
    for idx, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"{name}[{idx}]: expected an int, got {type(item).__name__}")
        if item < 0:
            raise ValueError(f"{name}[{idx}]: must be >= 0, got {item}")
        result.append(item)
    return result


def _check_parent_values(parents: torch.Tensor, tree_sizes: list[int]) -> None:
    """Every parent is -1 or a smaller index within its own tree."""
    if parents.numel() == 0:
        return
    sizes = torch.tensor(tree_sizes, dtype=torch.long, device=parents.device)
    starts = torch.cumsum(sizes, 0) - sizes  # [B] offset of each tree
    local = torch.arange(parents.numel(), device=parents.device) - torch.repeat_interleave(
        starts, sizes)  # [N] index of each node within its tree
    parents_long = parents.to(torch.long)
    bad = (parents_long < -1) | (parents_long >= local)  # [N]
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"parents[{first}]: expected -1 or an index < {int(local[first])} within its tree "
            f"(parents must precede children), got {int(parents_long[first])}")


def _check_cache(name: str, cache, q: torch.Tensor, num_kv_heads: int, needed_rows: int,
                 for_kernel: bool) -> None:
    """One per-request K or V cache view: [KVH, C_i, D]."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor [KVH, C, D], got shape "
                         f"{tuple(cache.shape)}")
    if cache.dtype != q.dtype:
        raise ValueError(f"{name}: expected dtype {q.dtype} like q, got {cache.dtype}")
    if cache.device != q.device:
        raise ValueError(f"{name}: expected device {q.device} like q, got {cache.device}")
    if cache.shape[2] != q.shape[2]:
        raise ValueError(f"{name}: expected head_dim {q.shape[2]} like q, got {cache.shape[2]}")
    if cache.shape[0] != num_kv_heads:
        raise ValueError(f"{name}: expected {num_kv_heads} kv heads like k_caches[0], got "
                         f"{cache.shape[0]}")
    if cache.shape[1] < needed_rows:
        raise ValueError(f"{name}: capacity {cache.shape[1]} < prefix_len + tree_size = "
                         f"{needed_rows}")
    if not for_kernel:
        return
    if cache.stride(2) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides "
                         f"{tuple(cache.stride())}")
    elem_align = KERNEL_ALIGN_BYTES // cache.element_size()
    if cache.stride(0) % elem_align or cache.stride(1) % elem_align:
        raise ValueError(f"{name}: head and row strides must be multiples of {elem_align} "
                         f"elements ({KERNEL_ALIGN_BYTES} bytes), got {tuple(cache.stride())}")
    if cache.data_ptr() % KERNEL_ALIGN_BYTES:
        raise ValueError(f"{name}: data pointer must be {KERNEL_ALIGN_BYTES}-byte aligned")


def _check_q(q, for_kernel: bool, require_cuda: bool) -> None:
    """q [N, H, D]: floating; for the kernel also its dtype, head_dim, layout and device."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: expected a 3-D tensor [N, H, D], got shape {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q: expected a floating dtype, got {q.dtype}")
    if not for_kernel:
        return
    if require_cuda and q.device.type != "cuda":
        raise ValueError(f"q: expected a CUDA tensor for the kernel, got device {q.device}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q: expected dtype torch.float16 or torch.bfloat16, got {q.dtype}")
    if q.shape[2] not in KERNEL_HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {KERNEL_HEAD_DIMS}, got {q.shape[2]}")
    if not q.is_contiguous():
        raise ValueError(f"q: expected a contiguous tensor, got strides {tuple(q.stride())}")
    if q.data_ptr() % KERNEL_ALIGN_BYTES:
        raise ValueError(f"q: data pointer must be {KERNEL_ALIGN_BYTES}-byte aligned")


def _check_sizes(prefix_lens, tree_sizes, num_nodes: int, for_kernel: bool) -> tuple[list[int], list[int]]:
    """One prefix length and tree size per request, the trees covering q's rows."""
    prefix_list = _int_list("prefix_lens", prefix_lens)
    tree_list = _int_list("tree_sizes", tree_sizes)
    if len(tree_list) != len(prefix_list):
        raise ValueError(f"tree_sizes: expected {len(prefix_list)} entries like prefix_lens, got "
                         f"{len(tree_list)}")
    if sum(tree_list) != num_nodes:
        raise ValueError(f"tree_sizes: they sum to {sum(tree_list)} but q has {num_nodes} rows")
    if for_kernel:
        for idx, size in enumerate(tree_list):
            if size > KERNEL_MAX_TREE:
                raise ValueError(f"tree_sizes[{idx}]: at most {KERNEL_MAX_TREE} nodes per tree "
                                 f"for the kernel, got {size}")
    return prefix_list, tree_list


def _check_parents_tensor(parents, q: torch.Tensor, for_kernel: bool) -> None:
    """parents [N] int32/int64 (the values are _check_parent_values' business)."""
    if not isinstance(parents, torch.Tensor):
        raise ValueError(f"parents: expected a torch.Tensor, got {type(parents).__name__}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents: expected dtype torch.int32 or torch.int64, got {parents.dtype}")
    if parents.dim() != 1 or parents.shape[0] != q.shape[0]:
        raise ValueError(f"parents: expected shape ({q.shape[0]},), got {tuple(parents.shape)}")
    if for_kernel and parents.device != q.device:
        raise ValueError(f"parents: expected device {q.device} like q, got {parents.device}")


def _check_cache_lists(k_caches, v_caches, num_requests: int) -> None:
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if not isinstance(caches, (list, tuple)):
            raise ValueError(f"{name}: expected a list of tensors, got {type(caches).__name__}")
        if len(caches) != num_requests:
            raise ValueError(f"{name}: expected {num_requests} tensors (one per request), got "
                             f"{len(caches)}")


def _check_caches(k_caches, v_caches, q: torch.Tensor, prefix_list: list[int],
                  tree_list: list[int], for_kernel: bool) -> None:
    """Each request's K and V cache: q's dtype and head_dim, room for its prefix and tree."""
    num_requests = len(prefix_list)
    if not num_requests:
        return
    if not isinstance(k_caches[0], torch.Tensor) or k_caches[0].dim() != 3:
        _check_cache("k_caches[0]", k_caches[0], q, 0, 0, for_kernel)  # raises
    num_kv_heads = k_caches[0].shape[0]
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"k_caches[0]: q has {q.shape[1]} heads, not a multiple of "
                         f"{num_kv_heads} kv heads")
    for idx in range(num_requests):
        needed = prefix_list[idx] + tree_list[idx]
        _check_cache(f"k_caches[{idx}]", k_caches[idx], q, num_kv_heads, needed, for_kernel)
        _check_cache(f"v_caches[{idx}]", v_caches[idx], q, num_kv_heads, needed, for_kernel)
        if for_kernel and k_caches[idx].shape[1] >= 2**31:
            raise ValueError(f"k_caches[{idx}]: capacity must be < 2**31 rows")


def check_tree_attention_inputs(
    q: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    prefix_lens,
    tree_sizes,
    parents: torch.Tensor,
    *,
    for_kernel: bool,
    require_cuda: bool = True,
    check_parents: bool = True,
) -> tuple[list[int], list[int]]:
    """Validate tree-attention inputs; return (prefix_lens, tree_sizes) as lists of ints.

    for_kernel adds the CUDA kernel's limits (dtype, head_dim, tree size, strides, alignment);
    require_cuda (only with for_kernel) demands CUDA tensors; tests turn it off to check the
    other kernel limits on CPU tensors.
    """
    _check_q(q, for_kernel, require_cuda)
    prefix_list, tree_list = _check_sizes(prefix_lens, tree_sizes, q.shape[0], for_kernel)
    _check_cache_lists(k_caches, v_caches, len(prefix_list))
    _check_parents_tensor(parents, q, for_kernel)
    _check_caches(k_caches, v_caches, q, prefix_list, tree_list, for_kernel)
    if check_parents:
        _check_parent_values(parents, tree_list)
    return prefix_list, tree_list
