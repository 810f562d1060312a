"""Tree-attention reference vs a naive per-node loop, input validation, and kernel selection."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services import kernels
from services.kernels import select_tree_attention
from services.kernels.reference import ancestor_mask, tree_attention_reference
from services.kernels.validation import check_tree_attention_inputs


# ---------------------------------------------------------------- helpers


def naive_tree_attention(q, k_caches, v_caches, prefix_lens, tree_sizes, parents, scale=None):
    """One node at a time, in float64: gather prefix + ancestor chain, softmax, weighted sum."""
    _, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)  # [N, H, D]
    offset = 0
    for i, (prefix_len, tree_size) in enumerate(zip(prefix_lens, tree_sizes)):
        group = num_heads // k_caches[i].shape[0]
        for j in range(tree_size):
            visible = list(range(prefix_len))
            node = j
            while node >= 0:
                visible.append(prefix_len + node)
                node = int(parents[offset + node])
            idx = torch.tensor(visible)
            keys = k_caches[i][:, idx].double().repeat_interleave(group, 0)  # [H, V, D]
            values = v_caches[i][:, idx].double().repeat_interleave(group, 0)  # [H, V, D]
            scores = torch.einsum("hvd,hd->hv", keys, q[offset + j].double()) * scale
            out[offset + j] = torch.einsum("hv,hvd->hd", scores.softmax(-1), values).to(q.dtype)
        offset += tree_size
    return out


def tree_parents(kind: str, size: int, gen: torch.Generator) -> list[int]:
    """Local parent indices of one tree of `size` nodes."""
    if kind == "chain":  # a causal prefill
        return [j - 1 for j in range(size)]
    if kind == "binary":  # full binary tree, breadth first
        return [(j - 1) // 2 if j else -1 for j in range(size)]
    if kind == "star":  # a forest of roots: every node sees only the prefix and itself
        return [-1] * size
    if kind == "random":  # random forest: parent uniformly among earlier nodes or the prefix
        return [int(torch.randint(-1, j, (1,), generator=gen)) if j else -1 for j in range(size)]
    raise AssertionError(kind)


def make_batch(requests, num_heads, num_kv_heads, head_dim, dtype, *, seed=0, slack=5,
               garbage=None):
    """requests: [(prefix_len, tree_size, kind)]. Caches are strided [KVH, C, D] views of one
    [B, C_max, KVH, D] buffer (heads not outermost), rows past L+T filled with `garbage`."""
    gen = torch.Generator().manual_seed(seed)
    prefix_lens = [r[0] for r in requests]
    tree_sizes = [r[1] for r in requests]
    capacity = max(p + t for p, t in zip(prefix_lens, tree_sizes)) + slack
    shape = (len(requests), capacity, num_kv_heads, head_dim)
    k_store = torch.randn(shape, generator=gen).to(dtype)
    v_store = torch.randn(shape, generator=gen).to(dtype)
    if garbage is not None:
        for i, (p, t) in enumerate(zip(prefix_lens, tree_sizes)):
            k_store[i, p + t:] = garbage
            v_store[i, p + t:] = garbage
    k_caches = [k_store[i].transpose(0, 1) for i in range(len(requests))]  # [KVH, C, D] views
    v_caches = [v_store[i].transpose(0, 1) for i in range(len(requests))]
    parents = torch.tensor(
        [p for (_, t, kind) in requests for p in tree_parents(kind, t, gen)], dtype=torch.int64)
    q = torch.randn(sum(tree_sizes), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_caches, v_caches, prefix_lens, tree_sizes, parents


RAGGED = [(0, 5, "chain"), (1, 1, "chain"), (7, 15, "binary"), (13, 11, "random"),
          (3, 6, "star"), (20, 9, "random")]


# ---------------------------------------------------------------- reference semantics


def test_ancestor_mask_small_tree():
    #      prefix
    #      /    \
    #     0      3
    #    / \
    #   1   2
    #       |
    #       4
    mask = ancestor_mask(torch.tensor([-1, 0, 0, -1, 2]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_ancestor_mask_deep_chain_and_wide_tree():
    chain = ancestor_mask(torch.arange(-1, 255))  # depth 255 needs every pointer-jumping round
    assert torch.equal(chain, torch.ones(256, 256, dtype=torch.bool).tril())
    binary = ancestor_mask(torch.tensor([(j - 1) // 2 if j else -1 for j in range(200)]))
    assert int(binary[199].sum()) == 8  # 199 -> 99 -> 49 -> 24 -> 11 -> 5 -> 2 -> 0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_matches_naive_fp32(num_heads, num_kv_heads, head_dim):
    batch = make_batch(RAGGED, num_heads, num_kv_heads, head_dim, torch.float32, seed=head_dim)
    out = tree_attention_reference(*batch)
    assert out.dtype == torch.float32 and out.shape == batch[0].shape
    torch.testing.assert_close(out, naive_tree_attention(*batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_matches_naive_bf16(num_heads, num_kv_heads):
    batch = make_batch(RAGGED, num_heads, num_kv_heads, 64, torch.bfloat16, seed=3)
    out = tree_attention_reference(*batch)
    assert out.dtype == torch.bfloat16
    expected = naive_tree_attention(*batch)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_reference_custom_scale():
    batch = make_batch(RAGGED[:3], 4, 2, 64, torch.float32, seed=11)
    out = tree_attention_reference(*batch, scale=0.3)
    torch.testing.assert_close(out, naive_tree_attention(*batch, scale=0.3), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, tree_attention_reference(*batch), atol=1e-3)


@pytest.mark.parametrize("garbage", [float("nan"), 1e30])
def test_reference_ignores_rows_past_the_tree(garbage):
    clean = make_batch(RAGGED, 8, 2, 64, torch.float32, seed=5, slack=7)
    dirty = make_batch(RAGGED, 8, 2, 64, torch.float32, seed=5, slack=7, garbage=garbage)
    out = tree_attention_reference(*dirty)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, tree_attention_reference(*clean), atol=0, rtol=0)


def test_chain_without_prefix_is_causal_attention():
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = make_batch(
        [(0, 12, "chain")], 4, 4, 64, torch.float32, seed=7)
    out = tree_attention_reference(q, k_caches, v_caches, prefix_lens, tree_sizes, parents)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_caches[0][:, :12], v_caches[0][:, :12], is_causal=True)  # [H, T, D]
    torch.testing.assert_close(out, expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_single_node_trees_are_plain_decoding():
    requests = [(9, 1, "chain"), (1, 1, "chain"), (0, 1, "chain"), (30, 1, "chain")]
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = make_batch(
        requests, 8, 2, 128, torch.float32, seed=9)
    out = tree_attention_reference(q, k_caches, v_caches, prefix_lens, tree_sizes, parents)
    for i, prefix_len in enumerate(prefix_lens):  # node i sees its prefix and itself: no mask
        keys = k_caches[i][:, :prefix_len + 1].repeat_interleave(4, 0)  # [H, L+1, D]
        values = v_caches[i][:, :prefix_len + 1].repeat_interleave(4, 0)
        expected = F.scaled_dot_product_attention(q[i][:, None], keys, values)  # [H, 1, D]
        torch.testing.assert_close(out[i], expected[:, 0], atol=1e-5, rtol=1e-5)


def test_root_sees_only_prefix_and_itself():
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = make_batch(
        [(4, 3, "star")], 2, 2, 64, torch.float32, seed=13)
    out = tree_attention_reference(q, k_caches, v_caches, prefix_lens, tree_sizes, parents)
    for node in range(3):  # changing a sibling's K/V must not move this node's output
        k_other = [k_caches[0].clone()]
        k_other[0][:, 4 + (node + 1) % 3] += 100.0
        moved = tree_attention_reference(q, k_other, v_caches, prefix_lens, tree_sizes, parents)
        torch.testing.assert_close(moved[node], out[node], atol=0, rtol=0)
        assert not torch.allclose(moved[(node + 1) % 3], out[(node + 1) % 3])


def test_reference_accepts_tensor_lengths_and_int32_parents():
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = make_batch(
        RAGGED, 4, 2, 64, torch.float32, seed=17)
    out = tree_attention_reference(q, k_caches, v_caches, torch.tensor(prefix_lens),
                                   torch.tensor(tree_sizes, dtype=torch.int32),
                                   parents.to(torch.int32))
    torch.testing.assert_close(out, naive_tree_attention(q, k_caches, v_caches, prefix_lens,
                                                         tree_sizes, parents), atol=1e-5, rtol=1e-5)


def test_empty_tree_in_batch():
    requests = [(3, 4, "random"), (5, 0, "chain"), (2, 2, "chain")]
    batch = make_batch(requests, 4, 4, 64, torch.float32, seed=19)
    torch.testing.assert_close(tree_attention_reference(*batch), naive_tree_attention(*batch),
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- validation


def _kernel_batch():
    return list(make_batch([(5, 3, "random"), (2, 4, "chain")], 8, 2, 64, torch.float16, seed=23))


def _replace_cache(idx, which, tensor_fn):
    def mutate(args):
        caches = list(args[which])
        caches[idx] = tensor_fn(caches[idx])
        args[which] = caches
    return mutate


def _set(position, value_fn):
    def mutate(args):
        args[position] = value_fn(args[position])
    return mutate


def _both(*mutators):
    def mutate(args):
        for mutator in mutators:
            mutator(args)
    return mutate


BAD_INPUTS = {
    "q_not_3d": (_set(0, lambda q: q[0]), "q:"),
    "q_fp32": (_set(0, lambda q: q.float()), "q: expected dtype torch.float16 or torch.bfloat16"),
    "q_head_dim_96": (_set(0, lambda q: torch.zeros(7, 8, 96, dtype=q.dtype)), "q: head_dim"),
    "q_not_contiguous": (_set(0, lambda q: q.transpose(0, 1).contiguous().transpose(0, 1)),
                         "q: expected a contiguous"),
    "k_dtype": (_replace_cache(1, 1, lambda c: c.float()),
                "k_caches[1]: expected dtype torch.float16 like q, got torch.float32"),
    "v_head_dim": (_replace_cache(0, 2, lambda c: c[..., :32]), "v_caches[0]: expected head_dim"),
    "k_kv_heads": (_replace_cache(1, 1, lambda c: c[:1]), "k_caches[1]: expected 2 kv heads"),
    "v_capacity": (_replace_cache(1, 2, lambda c: c[:, :5]), "v_caches[1]: capacity 5"),
    "k_last_dim_strided": (_replace_cache(0, 1, lambda c: c.transpose(1, 2).contiguous()
                                          .transpose(1, 2)), "k_caches[0]: the last dim"),
    "k_row_stride_unaligned": (_replace_cache(
        0, 1, lambda c: torch.zeros(2, 9, 68, dtype=c.dtype)[..., :64]), "k_caches[0]: head and row"),
    "k_not_tensor": (_replace_cache(0, 1, lambda c: c.numpy()), "k_caches[0]: expected a torch"),
    "k_count": (_set(1, lambda caches: caches[:1]), "k_caches: expected 2 tensors"),
    "v_not_list": (_set(2, lambda caches: caches[0]), "v_caches: expected a list"),
    "gqa_ratio": (_both(_set(1, lambda c: [x.repeat(2, 1, 1)[:3] for x in c]),
                        _set(2, lambda c: [x.repeat(2, 1, 1)[:3] for x in c])),
                  "k_caches[0]: q has 8 heads, not a multiple of 3"),
    "prefix_negative": (_set(3, lambda p: [-1, 2]), "prefix_lens[0]: must be >= 0"),
    "prefix_float": (_set(3, lambda p: [5.0, 2]), "prefix_lens[0]: expected an int"),
    "tree_count": (_set(4, lambda t: [3, 4, 0]), "tree_sizes: expected 2 entries"),
    "tree_sum": (_set(4, lambda t: [3, 3]), "tree_sizes: they sum to 6"),
    "tree_too_big": (_both(_set(0, lambda q: torch.zeros(257 + 3, 8, 64, dtype=q.dtype)),
                           _set(4, lambda t: [3, 257])), "tree_sizes[1]: at most 256"),
    "parents_dtype": (_set(5, lambda p: p.float()), "parents: expected dtype"),
    "parents_shape": (_set(5, lambda p: p[:-1]), "parents: expected shape (7,)"),
    "parents_not_earlier": (_set(5, lambda p: torch.tensor([-1, 0, 2, -1, 0, 1, 2])),
                            "parents[2]: expected -1 or an index < 2"),
    "parents_below_minus_one": (_set(5, lambda p: torch.tensor([-1, 0, 1, -1, 0, 1, -2])),
                                "parents[6]"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_kernel_validation_names_the_argument(case):
    mutate, message = BAD_INPUTS[case]
    args = _kernel_batch()
    check_tree_attention_inputs(*args, for_kernel=True, require_cuda=False)  # valid as built
    mutate(args)
    with pytest.raises(ValueError) as err:
        check_tree_attention_inputs(*args, for_kernel=True, require_cuda=False)
    assert message in str(err.value)


def test_kernel_validation_requires_cuda_tensors():
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        check_tree_attention_inputs(*_kernel_batch(), for_kernel=True, require_cuda=True)


def test_reference_validation_allows_what_only_the_kernel_limits():
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = make_batch(
        [(2, 300, "random")], 3, 1, 40, torch.float32, seed=29)  # fp32, D=40, T=300
    k_caches = [k_caches[0].transpose(1, 2).contiguous().transpose(1, 2)]  # strided last dim
    out = tree_attention_reference(q, k_caches, v_caches, prefix_lens, tree_sizes, parents)
    assert out.shape == (300, 3, 40) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="parents"):
        tree_attention_reference(q, k_caches, v_caches, prefix_lens, tree_sizes, parents.flip(0))


# ---------------------------------------------------------------- selection


def test_select_returns_reference_on_cpu():
    assert select_tree_attention(torch.device("cpu")) is tree_attention_reference


def test_select_returns_reference_on_cuda_without_cupy(monkeypatch):
    import services.kernels.tree_attention as wrapper

    monkeypatch.setattr(wrapper, "cupy_available", lambda: False)
    assert select_tree_attention(torch.device("cuda")) is tree_attention_reference
    assert kernels.kernel_available() is False


def test_select_returns_kernel_on_cuda_with_cupy(monkeypatch):
    import services.kernels.tree_attention as wrapper

    monkeypatch.setattr(wrapper, "cupy_available", lambda: True)
    assert select_tree_attention(torch.device("cuda", 0)) is wrapper.tree_attention_cuda
