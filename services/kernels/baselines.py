"""Torch baselines the GPU check times the kernel against (plain torch: they also run on a CPU).

- padded: every request padded to the batch's largest tree and KV length, K/V expanded to all
  query heads, one scaled_dot_product_attention call with a boolean tree mask. Building the padded
  tensors is a copy of the whole cache and is NOT part of the timed call (it favours SDPA).
- loop: one scaled_dot_product_attention call per request on views of its own cache (no copy),
  with grouped-query attention and that request's boolean tree mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from services.kernels.reference import ancestor_mask

__all__ = ["LoopInputs", "PaddedInputs", "build_loop_inputs", "build_padded_inputs",
           "loop_output", "run_loop", "run_padded", "tree_visibility", "unpad"]


def tree_visibility(prefix_len: int, parents: torch.Tensor) -> torch.Tensor:
    """[T] local parents -> [T, L+T] bool: the prefix and each node's ancestors and itself."""
    tree_size = parents.shape[0]
    visible = torch.ones(tree_size, prefix_len + tree_size, dtype=torch.bool, device=parents.device)
    visible[:, prefix_len:] = ancestor_mask(parents)
    return visible


@dataclass
class PaddedInputs:
    q: torch.Tensor  # [B, H, T_max, D]
    k: torch.Tensor  # [B, H, KV_max, D]  (kv heads expanded to query heads)
    v: torch.Tensor  # [B, H, KV_max, D]
    mask: torch.Tensor  # [B, 1, T_max, KV_max] bool, True = attend
    tree_sizes: list[int]


def build_padded_inputs(q: torch.Tensor, k_caches: Sequence[torch.Tensor],
                        v_caches: Sequence[torch.Tensor], prefix_lens: Sequence[int],
                        tree_sizes: Sequence[int], parents: torch.Tensor) -> PaddedInputs:
    num_heads, head_dim = q.shape[1], q.shape[2]
    batch = len(tree_sizes)
    max_tree = max(tree_sizes)
    max_kv = max(p + t for p, t in zip(prefix_lens, tree_sizes))
    q_pad = q.new_zeros(batch, num_heads, max_tree, head_dim)
    k_pad = q.new_zeros(batch, num_heads, max_kv, head_dim)
    v_pad = q.new_zeros(batch, num_heads, max_kv, head_dim)
    mask = torch.zeros(batch, 1, max_tree, max_kv, dtype=torch.bool, device=q.device)
    mask[:, :, :, 0] = True  # padded query rows attend to one key instead of none (no NaN)
    offset = 0
    for i, (prefix_len, tree_size) in enumerate(zip(prefix_lens, tree_sizes)):
        kv_len = prefix_len + tree_size
        group = num_heads // k_caches[i].shape[0]
        q_pad[i, :, :tree_size] = q[offset:offset + tree_size].transpose(0, 1)
        k_pad[i, :, :kv_len] = k_caches[i][:, :kv_len].repeat_interleave(group, 0)
        v_pad[i, :, :kv_len] = v_caches[i][:, :kv_len].repeat_interleave(group, 0)
        mask[i, 0, :tree_size] = False
        mask[i, 0, :tree_size, :kv_len] = tree_visibility(prefix_len,
                                                          parents[offset:offset + tree_size])
        offset += tree_size
    return PaddedInputs(q_pad, k_pad, v_pad, mask, list(tree_sizes))


def run_padded(inputs: PaddedInputs, scale: float | None = None) -> torch.Tensor:
    """One SDPA call; returns the padded output [B, H, T_max, D]."""
    return F.scaled_dot_product_attention(inputs.q, inputs.k, inputs.v, attn_mask=inputs.mask,
                                          scale=scale)


def unpad(out_pad: torch.Tensor, tree_sizes: Sequence[int]) -> torch.Tensor:
    """[B, H, T_max, D] -> packed [N, H, D]."""
    return torch.cat([out_pad[i, :, :t].transpose(0, 1) for i, t in enumerate(tree_sizes)])


@dataclass
class LoopInputs:
    queries: list[torch.Tensor]  # [1, H, T_i, D] each
    keys: list[torch.Tensor]  # [1, KVH, L_i+T_i, D] views of the caches
    values: list[torch.Tensor]
    masks: list[torch.Tensor]  # [T_i, L_i+T_i] bool


def build_loop_inputs(q: torch.Tensor, k_caches: Sequence[torch.Tensor],
                      v_caches: Sequence[torch.Tensor], prefix_lens: Sequence[int],
                      tree_sizes: Sequence[int], parents: torch.Tensor) -> LoopInputs:
    inputs = LoopInputs([], [], [], [])
    offset = 0
    for i, (prefix_len, tree_size) in enumerate(zip(prefix_lens, tree_sizes)):
        kv_len = prefix_len + tree_size
        inputs.queries.append(q[offset:offset + tree_size].transpose(0, 1).unsqueeze(0).contiguous())
        inputs.keys.append(k_caches[i][:, :kv_len].unsqueeze(0))
        inputs.values.append(v_caches[i][:, :kv_len].unsqueeze(0))
        inputs.masks.append(tree_visibility(prefix_len, parents[offset:offset + tree_size]))
        offset += tree_size
    return inputs


def run_loop(inputs: LoopInputs, scale: float | None = None) -> list[torch.Tensor]:
    """One SDPA call per request (grouped-query attention); outputs [1, H, T_i, D]."""
    return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=True)
            for q, k, v, m in zip(inputs.queries, inputs.keys, inputs.values, inputs.masks)]


def loop_output(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Per-request outputs -> packed [N, H, D]."""
    return torch.cat([o[0].transpose(0, 1) for o in outputs])
