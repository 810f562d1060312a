"""Torch reference for tree attention (the semantics every tree-attention kernel must match).

One verifier forward covers the draft-tree nodes of every request in a batch. Node j of request i
attends to every cached prefix position of request i, to its ancestors in the tree, and to itself.

Shapes (B requests, request i has a prefix of L_i cached positions and T_i tree nodes):
    q            [N, H, D]       packed queries, N = sum(T_i); request i owns rows
                                 offset_i .. offset_i + T_i - 1, offset_i = T_0 + ... + T_{i-1}
    k_caches[i]  [KVH, C_i, D]   rows 0..L_i-1: the prefix; rows L_i..L_i+T_i-1: the tree nodes in
    v_caches[i]  [KVH, C_i, D]   node order; rows from L_i+T_i on are garbage and never read
    prefix_lens  B ints (list or int tensor), L_i >= 0
    tree_sizes   B ints (list or int tensor), T_i >= 0
    parents      [N] int          parent of each node as an index within its own tree, -1 = a root
                                  (child of the prefix); parents[j] < j; several roots are allowed
    out          [N, H, D]        in q's dtype

H must be a multiple of KVH: query head h reads kv head h // (H // KVH) (grouped-query attention).
scale defaults to 1/sqrt(D). Scores and softmax are computed in float32 (float64 for float64 input).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from services.kernels.validation import check_tree_attention_inputs

__all__ = ["ancestor_mask", "tree_attention_reference"]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[T] local parent indices -> [T, T] bool, mask[j, a] = a is j itself or an ancestor of j.

    Pointer jumping: after round r, mask[j] holds the ancestors at distance < 2**r and jump[j] is
    the ancestor at distance 2**r (or -1), so ceil(log2(T)) rounds cover any depth.
    """
    num_nodes = parents.shape[0]
    device = parents.device
    mask = torch.eye(num_nodes, dtype=torch.bool, device=device)  # [T, T]
    jump = parents.to(torch.long).clone()  # [T]
    for _ in range(max(1, math.ceil(math.log2(max(num_nodes, 2))))):
        has = jump >= 0  # [T]
        if not bool(has.any()):
            break
        safe = jump.clamp(min=0)
        mask = mask | (mask[safe] & has[:, None])  # [T, T]
        jump = torch.where(has, jump[safe], jump)  # [T]
    return mask


def tree_attention_reference(
    q: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    prefix_lens,
    tree_sizes,
    parents: torch.Tensor,
    scale: float | None = None,
    *,
    check_parents: bool = True,
) -> torch.Tensor:
    """Tree attention over packed tree-node queries; see the module docstring for shapes."""
    prefix_list, tree_list = check_tree_attention_inputs(
        q, k_caches, v_caches, prefix_lens, tree_sizes, parents, for_kernel=False,
        check_parents=check_parents,
    )
    num_heads, head_dim = q.shape[1], q.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)  # [N, H, D]
    offset = 0
    for i, (prefix_len, tree_size) in enumerate(zip(prefix_list, tree_list)):
        if tree_size == 0:
            continue
        kv_len = prefix_len + tree_size
        num_kv_heads = k_caches[i].shape[0]
        group = num_heads // num_kv_heads
        keys = k_caches[i][:, :kv_len].to(compute_dtype)  # [KVH, L+T, D]
        values = v_caches[i][:, :kv_len].to(compute_dtype)  # [KVH, L+T, D]
        # [T, H, D] -> [KVH, G*T, D]: the G query heads of one kv head share its keys without a copy
        q_req = q[offset:offset + tree_size].to(compute_dtype)
        q_req = q_req.view(tree_size, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_req = q_req.reshape(num_kv_heads, group * tree_size, head_dim)
        scores = torch.matmul(q_req, keys.transpose(1, 2)) * scale  # [KVH, G*T, L+T]
        scores = scores.view(num_kv_heads, group, tree_size, kv_len)
        visible = torch.ones(tree_size, kv_len, dtype=torch.bool, device=q.device)  # [T, L+T]
        visible[:, prefix_len:] = ancestor_mask(parents[offset:offset + tree_size])
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * tree_size, kv_len)
        out_req = torch.matmul(probs, values)  # [KVH, G*T, D]
        out_req = out_req.view(num_kv_heads, group, tree_size, head_dim).permute(2, 0, 1, 3)
        out[offset:offset + tree_size] = out_req.reshape(tree_size, num_heads, head_dim).to(q.dtype)
        offset += tree_size
    return out
