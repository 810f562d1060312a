"""The mma kernel's index math, emulated on the CPU (services/kernels/mma_emulator.py), vs the
reference.

The emulator transcribes tree_attention_mma with the PTX fragment layouts; these cases cover
multiple row tiles per (request, kv head), a node index >= 128 (third bitset word), more KV tiles
than pipeline stages, GQA groups of 1/2/3, head_dim 64/128, both cache layouts, empty prefixes,
single-node trees and NaN garbage rows past L+T.
"""

from __future__ import annotations

import pytest
import torch

from services.kernels.mma_emulator import emulate_tree_attention_mma
from services.kernels.reference import tree_attention_reference


def _random_tree(size: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, j, (1,), generator=gen)) if j else -1 for j in range(size)]


def _inputs(prefix_lens, parent_lists, num_heads, num_kv_heads, dim, dtype, heads_outer, seed):
    gen = torch.Generator().manual_seed(seed)
    tree_sizes = [len(p) for p in parent_lists]
    batch, capacity = len(tree_sizes), max(p + t for p, t in zip(prefix_lens, tree_sizes)) + 5
    shape = (batch, num_kv_heads, capacity, dim) if heads_outer else (batch, capacity, num_kv_heads, dim)
    k_store = torch.randn(shape, generator=gen).to(dtype)
    v_store = torch.randn(shape, generator=gen).to(dtype)
    k_caches = [k_store[i] if heads_outer else k_store[i].transpose(0, 1) for i in range(batch)]
    v_caches = [v_store[i] if heads_outer else v_store[i].transpose(0, 1) for i in range(batch)]
    for k, v, p, t in zip(k_caches, v_caches, prefix_lens, tree_sizes):
        k[:, p + t:] = float("nan")
        v[:, p + t:] = float("nan")
    parents = torch.tensor([x for p in parent_lists for x in p])
    q = torch.randn(sum(tree_sizes), num_heads, dim, generator=gen).to(dtype) * 2
    return q, k_caches, v_caches, prefix_lens, tree_sizes, parents


GEN = torch.Generator().manual_seed(0)
CASES = {
    "gqa2_chain_and_forest": ([0, 70], [[j - 1 for j in range(20)], [-1, 0, -1]], 4, 2, 64,
                              torch.bfloat16, True),
    "mha_decode_and_tree": ([1, 130], [_random_tree(40, GEN), [-1]], 3, 3, 64, torch.float16,
                            False),
    "two_row_tiles": ([5], [_random_tree(70, GEN)], 2, 1, 64, torch.float16, True),
    "gqa3_d128_binary": ([64, 0], [[(j - 1) // 2 if j else -1 for j in range(6)],
                                   _random_tree(33, GEN)], 6, 2, 128, torch.bfloat16, False),
    "node_128_plus_and_stage_wrap": ([200], [_random_tree(140, GEN)], 1, 1, 64, torch.bfloat16,
                                     True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_mma_kernel_matches_reference(case):
    prefix_lens, parent_lists, heads, kv_heads, dim, dtype, heads_outer = CASES[case]
    inputs = _inputs(prefix_lens, parent_lists, heads, kv_heads, dim, dtype, heads_outer,
                     seed=len(case))
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = inputs
    ref = tree_attention_reference(q.double(), [k.double() for k in k_caches],
                                   [v.double() for v in v_caches], prefix_lens, tree_sizes, parents)
    out = emulate_tree_attention_mma(*inputs)
    assert out.dtype == dtype and not torch.isnan(out).any()
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err
