"""The lean forward against transformers, and tree attention against plain causal forwards."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.llama import Chunk
from services.common.loading import load_model
from services.common.matmul import SMALL_ROWS_ENV, pick_small_rows
from services.common.tree import DraftTree, forest_parents
from tests import tiny


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def causal(n: int) -> list[int]:
    return list(range(-1, n - 1))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tmp_path, home, model_type):
    path = tiny.make_checkpoint(tmp_path / model_type, model_type=model_type, seed=3)
    lm, hf = load_model(str(path)), tiny.hf_model(path)
    ids = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = lm.model.new_cache(8)  # too small on purpose: must grow
    ours = lm.model.forward([Chunk(cache, ids[:30], causal(30), 0)])[0]
    ours2 = lm.model.forward([Chunk(cache, ids[30:], causal(10), 0)])[0]  # continues from the cache
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(torch.cat([ours, ours2]), ref) < 1e-4


SMALL = 3  # the route step the next test sets, as a 2-core Xeon's tuning chose


@pytest.mark.parametrize("rows", [1, SMALL, SMALL + 1, 16])
def test_both_matmul_routes_match_transformers(tmp_path, home, rows):
    """Chunks of a few rows take F.linear, longer ones oneDNN's blocked weights: both agree with HF."""
    path = tiny.make_checkpoint(tmp_path / "m", model_type="llama", seed=5)
    lm, hf = load_model(str(path)), tiny.hf_model(path)
    if torch.backends.mkldnn.is_available():
        assert lm.model.lm_head.packed is not None  # the blocked route exists and is exercised
        lm.model.matmul.small_rows = SMALL
    ids = torch.randint(3, 64, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = lm.model.new_cache(64)
    ours = [lm.model.forward([Chunk(cache, ids[i : i + rows], causal(len(ids[i : i + rows])), 0)])[0]
            for i in range(0, len(ids), rows)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(torch.cat(ours), ref) < 1e-4


def test_default_model_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model.path, dtype=torch.float32).eval()
    ids = default_model.tokenizer("Speculative decoding verifies a whole draft in one forward pass.")["input_ids"]
    out = default_model.model.forward([Chunk(default_model.model.new_cache(64), ids, causal(len(ids)), 0)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(out, ref) < 1e-4


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    tree = DraftTree()
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        tree.add(int(torch.randint(3, 64, (1,), generator=gen)), parent, [], [])
    return tree


def path_of(node: int, parents: list[int]) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_tree_nodes_see_exactly_their_ancestors(tiny_target):
    """Each tree node's logits equal a causal forward of prefix + its path (batched with a second
    sequence of another length, to check packing)."""
    lm, hf = load_model(str(tiny_target)), tiny.hf_model(tiny_target)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 64, (12,), generator=gen).tolist()
    other = torch.randint(3, 64, (5,), generator=gen).tolist()
    tree = random_tree(15, gen)
    c1, c2 = lm.model.new_cache(32), lm.model.new_cache(32)
    lm.model.forward([Chunk(c1, prefix[:-2], causal(10), 9), Chunk(c2, other, causal(5), 4)])
    pending = prefix[-2:]  # two committed tokens not yet cached, then the tree
    logits = lm.model.forward([Chunk(c1, pending + tree.tokens, forest_parents(2, tree), 1),
                               Chunk(c2, [7], [-1], 0)])
    for node in range(len(tree)):
        seq = prefix + [tree.tokens[i] for i in path_of(node, tree.parents)]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1]
        assert rel_err(logits[0][node + 1], ref) < 1e-4, f"node {node}"
    with torch.no_grad():
        ref_root = hf(torch.tensor([prefix])).logits[0, -1]
        ref_other = hf(torch.tensor([other + [7]])).logits[0, -1]
    assert rel_err(logits[0][0], ref_root) < 1e-4
    assert rel_err(logits[1][0], ref_other) < 1e-4


def test_tree_fed_level_by_level_equals_one_shot(tiny_target):
    """The draft feeds tree levels in separate forwards (tree_start); results must not change."""
    lm = load_model(str(tiny_target))
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 64, (9,), generator=gen).tolist()
    tree = DraftTree()
    for tok, parent in [(5, -1), (6, -1), (7, 0), (8, 0), (9, 1), (10, 2), (11, 4)]:
        tree.add(tok, parent, [], [])
    one = lm.model.new_cache(32)
    lm.model.forward([Chunk(one, prefix, causal(9), 8)])
    full = lm.model.forward([Chunk(one, tree.tokens, tree.parents, 0)])[0]
    lev = lm.model.new_cache(32)
    lm.model.forward([Chunk(lev, prefix, causal(9), 8)])
    a = lm.model.forward([Chunk(lev, tree.tokens[:2], tree.parents[:2], 0, tree_start=9)])[0]
    b = lm.model.forward([Chunk(lev, tree.tokens[2:5], tree.parents[:5], 0, tree_start=9)])[0]
    c = lm.model.forward([Chunk(lev, tree.tokens[5:], tree.parents, 0, tree_start=9)])[0]
    assert rel_err(torch.cat([a, b, c]), full) < 1e-5


def test_keep_accepted_path_then_continue(tiny_target):
    """After KVCache.keep of an accepted path, decoding continues as if the path had been fed."""
    lm, hf = load_model(str(tiny_target)), tiny.hf_model(tiny_target)
    prefix = list(range(3, 13))
    tree = DraftTree()
    for tok, parent in [(20, -1), (21, -1), (22, 1), (23, 1), (24, 3), (25, 0)]:
        tree.add(tok, parent, [], [])
    cache = lm.model.new_cache(16)
    lm.model.forward([Chunk(cache, prefix[:-1], causal(9), 8)])
    lm.model.forward([Chunk(cache, [prefix[-1]] + tree.tokens, forest_parents(1, tree), 0)])
    path = [1, 3, 4]
    cache.keep(10, [10 + i for i in path])
    assert cache.length == 13
    nxt = lm.model.forward([Chunk(cache, [30, 31], causal(2), 0)])[0]
    seq = prefix + [tree.tokens[i] for i in path] + [30, 31]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0, -2:]
    assert rel_err(nxt, ref) < 1e-4


def test_positions_past_the_context_are_refused(tmp_path, home):
    path = tiny.make_checkpoint(tmp_path / "short", max_positions=16)
    lm = load_model(str(path))
    with pytest.raises(ValueError, match="context of 16"):
        lm.model.forward([Chunk(lm.model.new_cache(4), list(range(3, 20)), causal(17), 16)])


def test_tree_attention_backend_is_the_kernel_only_on_cuda(monkeypatch, tiny_target):
    from services import kernels
    from services.kernels.tree_attention import tree_attention_cuda
    from services.common.llama import pick_tree_attention

    lm = load_model(str(tiny_target))
    assert lm.model.tree_attention is None  # CPU: torch SDPA with the reference semantics
    monkeypatch.setattr(kernels, "kernel_available", lambda: True)
    cuda = torch.device("cuda")
    assert pick_tree_attention(cuda, torch.bfloat16, 128) is tree_attention_cuda
    assert pick_tree_attention(cuda, torch.float16, 64) is tree_attention_cuda
    assert pick_tree_attention(cuda, torch.float32, 128) is None  # the kernel takes fp16/bf16
    assert pick_tree_attention(cuda, torch.bfloat16, 96) is None  # nor other head sizes
    assert pick_tree_attention(torch.device("cpu"), torch.bfloat16, 128) is None
    monkeypatch.setattr(kernels, "kernel_available", lambda: False)
    assert pick_tree_attention(cuda, torch.bfloat16, 128) is None  # no CuPy: torch path


def test_the_route_step_is_the_last_row_count_where_f_linear_wins():
    asked = []

    def timings(linear_wins_up_to):
        def at(rows):
            asked.append(rows)
            return (1.0, 2.0) if rows <= linear_wins_up_to else (2.0, 1.0)
        return at

    assert pick_small_rows(timings(3)) == 3 and asked == [1, 2, 3, 4]  # stops at the first loss
    assert pick_small_rows(timings(0)) == 0  # the blocked route from one row on
    assert pick_small_rows(timings(100), max_rows=8) == 8
    # A tie goes to the blocked route; a later win of F.linear after a loss does not count.
    assert pick_small_rows(lambda r: (1.0, 1.0)) == 0
    assert pick_small_rows(lambda r: (1.0, 2.0) if r in (1, 3) else (2.0, 1.0)) == 1


def test_tuning_is_timed_at_load_or_fixed_by_the_environment(tmp_path, home, monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: F.linear is the only route")
    path = tiny.make_checkpoint(tmp_path / "m", model_type="llama", seed=5)
    monkeypatch.setenv("SPECSERVE_MATMUL_SMALL_ROWS", "5")
    assert load_model(str(path)).model.matmul.small_rows == 5
    monkeypatch.delenv("SPECSERVE_MATMUL_SMALL_ROWS")
    assert 0 <= load_model(str(path)).model.matmul.small_rows <= 8


ROPE_CHECK = """
import numpy as np
from services.common.loading import load_model
m = load_model("default").model
c = m.config
ang = np.arange(c.max_positions, dtype=np.float32)[:, None] * c.inv_freq.float().numpy()[None, :]
ang = np.concatenate([ang, ang], -1).astype(np.float64)  # the float32 angles, exactly
for table, f in ((m.cos, np.cos), (m.sin, np.sin)):
    print(np.abs(table.float().numpy() - f(ang) * c.rope_scaling).max())
"""


def test_the_default_models_rope_tables_are_exact_in_every_process(home):
    """MKL's first vector-math call of a process once came out at low accuracy after the matmul
    tuning in about a third of processes (their greedy answers differed): six fresh loads must each
    hold cos and sin within 1e-6 of float64's values at the same float32 angles."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECSERVE_HOME", SMALL_ROWS_ENV)}
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", ROPE_CHECK], env=env, text=True, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for _ in range(6)]
    errors = [[float(x) for x in p.communicate(timeout=300)[0].split()] for p in procs]
    assert all(len(e) == 2 and max(e) < 1e-6 for e in errors), errors
