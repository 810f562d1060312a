"""attention.cpp: a step's few new rows attending over their KV caches on CPU (native models).

Checked against the tree-attention reference, and for what greedy identity needs of it: a tree
node's output is bitwise the output plain decoding gets for the same keys, whatever the other rows.
"""

from __future__ import annotations

import pytest
import torch

from services.common import cpu_kernels
from services.common.tree import ancestor_mask
from services.kernels.reference import tree_attention_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the CPU kernels do not build here (no g++ or no AVX2/FMA)")

HEADS, KV_HEADS, DIM = 6, 2, 64
CAUSAL = torch.empty(0, dtype=torch.bool)


def rows(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, heads, dim], k, v [n, kv_heads, dim] as views into one qkv matrix, like the model's."""
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM)
    q = qkv[:, : HEADS * DIM].view(n, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(n, KV_HEADS, DIM)
    return q, k, qkv[:, (HEADS + KV_HEADS) * DIM :].view(n, KV_HEADS, DIM)


def cache(prefix: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[kv_heads, capacity, dim] keys and values, the first `prefix` slots filled."""
    k, v = torch.zeros(KV_HEADS, capacity, DIM), torch.zeros(KV_HEADS, capacity, DIM)
    k[:, :prefix], v[:, :prefix] = torch.randn(KV_HEADS, prefix, DIM), torch.randn(KV_HEADS, prefix, DIM)
    return k, v


def attend(q, k, v, caches, offsets, lengths, starts, visible, tree_starts=None):
    out = torch.full_like(q, float("nan"))
    torch.ops.specserve_q.attend_(out, q, k, v, [c[0] for c in caches], [c[1] for c in caches],
                                  offsets, lengths, starts, tree_starts or starts, visible, DIM ** -0.5)
    return out


def test_trees_and_causal_chunks_match_the_reference_and_fill_their_caches():
    torch.manual_seed(0)
    trees = [[-1], [-1, 0, 0, 1, 2, 2, 3], [-1, 0, 1, 2]]  # a decode row, a tree, a causal chunk
    prefixes = [37, 300, 5]
    q, k, v = rows(sum(map(len, trees)))
    caches = [cache(p, p + len(t) + 3) for p, t in zip(prefixes, trees)]
    visible = [CAUSAL, ancestor_mask(trees[1]).contiguous(), CAUSAL]
    offsets = [0, 1, 8]
    out = attend(q, k, v, caches, offsets, [1, 7, 4], prefixes, visible)
    for (kc, vc), off, p, t in zip(caches, offsets, prefixes, trees):  # the new rows were written
        assert torch.equal(kc[:, p : p + len(t)], k[off : off + len(t)].transpose(0, 1))
        assert torch.equal(vc[:, p : p + len(t)], v[off : off + len(t)].transpose(0, 1))
    parents = torch.tensor([x for t in trees for x in t])
    ref = tree_attention_reference(q.contiguous(), [c[0] for c in caches], [c[1] for c in caches],
                                   prefixes, [len(t) for t in trees], parents)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_a_tree_node_gets_bitwise_what_plain_decoding_gets():
    """Node 6 of the tree sees the prefix and nodes 0, 2, 4: decoding those four tokens one at a
    time over the same prefix gives the same output bit for bit, as does the causal chunk."""
    torch.manual_seed(1)
    parents, path = [-1, 0, 0, 1, 2, 3, 4], [0, 2, 4, 6]
    q, k, v = rows(len(parents))
    tree_cache = cache(200, 220)
    tree = attend(q, k, v, [tree_cache], [0], [7], [200], [ancestor_mask(parents).contiguous()])
    plain_cache = (tree_cache[0].clone(), tree_cache[1].clone())
    for i, node in enumerate(path):  # one row at a time, each a decode step
        one = attend(q[node : node + 1], k[node : node + 1], v[node : node + 1], [plain_cache],
                     [0], [1], [200 + i], [CAUSAL])
        assert torch.equal(one[0], tree[node]), node
    chunk_cache = (tree_cache[0].clone(), tree_cache[1].clone())
    chunk = attend(q[path], k[path], v[path], [chunk_cache], [0], [4], [200], [CAUSAL])
    assert torch.equal(chunk, tree[path])


def test_a_chunk_continues_a_tree_cached_by_an_earlier_forward():
    """tree_start before start: slots a draft model's earlier forward of this step cached."""
    torch.manual_seed(2)
    parents = [-1, 0, 0, 1, 2]
    q, k, v = rows(5)
    kc, vc = cache(50, 60)
    whole = attend(q, k, v, [(kc.clone(), vc.clone())], [0], [5], [50], [ancestor_mask(parents).contiguous()])
    attend(q[:3], k[:3], v[:3], [(kc, vc)], [0], [3], [50], [ancestor_mask(parents[:3]).contiguous()])
    later = attend(q[3:], k[3:], v[3:], [(kc, vc)], [0], [2], [53],
                   [ancestor_mask(parents)[3:].contiguous()], tree_starts=[50])
    assert torch.equal(later, whole[3:])


def test_rows_left_to_torch_stay_untouched_and_bad_inputs_are_named():
    torch.manual_seed(3)
    q, k, v = rows(3)
    kc, vc = cache(10, 20)
    out = attend(q, k, v, [(kc, vc)], [1], [2], [10], [CAUSAL])
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    with pytest.raises(RuntimeError, match="chunk 0 does not fit"):
        attend(q, k, v, [(kc, vc)], [0], [3], [18], [CAUSAL])
    with pytest.raises(RuntimeError, match="visible\\[0\\] must be empty or bool"):
        attend(q, k, v, [(kc, vc)], [0], [3], [10], [torch.ones(3, 2, dtype=torch.bool)])
    with pytest.raises(RuntimeError, match="caches must be contiguous float32"):
        attend(q, k, v, [(kc.double(), vc.double())], [0], [3], [10], [CAUSAL])
    with pytest.raises(RuntimeError, match="a causal chunk starts its tree"):
        attend(q, k, v, [(kc, vc)], [0], [3], [10], [CAUSAL], tree_starts=[8])
