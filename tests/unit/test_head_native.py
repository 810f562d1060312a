"""The feature head served on the native CPU kernels: its weights rounded to blocks, its linears
on the target's kernels, and head.cpp's draft forward and chains (greedy and sampled) computing
what the torch ops and the level-by-level path compute."""

import pytest
import torch
from scipy.stats import chisquare

from services.common import cpu_kernels
from services.common.hidden_states import HiddenStates
from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.common.sequence import Sequence
from services.draft import tree_growth
from services.draft.proposer import ProposeItem
from tests import tiny
from tests.tiny import target_states

NATIVE = pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built here")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_a_float_weight_rounds_to_blocks_within_half_a_step(kind):
    """BlockTensor.quantize (the served head's weights): every value within half a quantization
    step of its block, and the blocks decode as the file's own do."""
    from services.common.gguf_blocks import BlockTensor

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    w[0, :32] = 0.0  # an all-zero block: d = 0, decoded exactly
    block = BlockTensor.quantize(w, kind)
    assert block.kind == kind and block.shape == (40, 96)
    _, scale, low = block.decode()
    err = (block.dequantize() - w).abs().view(40, 3, 32)
    bound = 0.5 * scale + (1e-3 * low.abs() if low is not None else 1e-7)  # [40, 3]; Q4_1: m's float16 rounding
    assert (err <= bound[..., None]).all()
    assert torch.equal(block.dequantize()[0, :32], torch.zeros(32))
    with pytest.raises(ValueError, match="Q8_0 or Q4_1"):
        BlockTensor.quantize(w, "Q5_K")


@NATIVE
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_the_served_head_routes_multiply_by_the_rounded_weights(kind):
    """A served head's linear on the native kernels: x times the rounded weights (q4 rounds the
    activations to int8 per block too), outputs past a tile's 16 sliced off."""
    from services.common.gguf_blocks import BlockTensor
    from services.draft.feature_head import _block_route

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 96, generator=gen) * 0.05, torch.randn(3, 96, generator=gen)
    y = _block_route(w, kind)[1](x)
    want = x @ BlockTensor.quantize(w, "Q8_0" if kind == "q8" else "Q4_1").dequantize().T
    assert y.shape == (3, 40)
    tol = 1e-5 if kind == "q8" else 2e-2  # q4: int8 activations per block of 32
    assert (y - want).abs().max() <= tol * want.abs().max()


@NATIVE
def test_the_native_head_drafts_what_the_torch_ops_draft(tmp_path):
    """The served head in one head.cpp call (its norms, projection, decoder layer and LM head on the
    target's kernels, attention.cpp over the tree's visible slots) computes what the torch ops
    (SDPA with the mask) compute."""
    # attention.cpp takes head sizes in multiples of 32
    target = load_model(str(tiny.make_checkpoint(tmp_path / "wide", seed=4, hidden=64, heads=2, kv_heads=1)))
    ids = list(range(5, 17))
    states = target_states(target, ids).half()
    runs = []
    for native in (True, False):
        proposer = tiny.head_proposer(target, tiny.make_head(target))
        assert proposer.head.native is not None
        if not native:
            proposer.head.native = None
        seq = Sequence("r", SamplingParams(max_tokens=4), None, tokens=list(ids))
        tree = proposer.propose([ProposeItem(seq, 3, 9, [HiddenStates(0, states[:11])])])[0]
        runs.append((tree.tokens, tree.parents, seq.scratch.out, torch.stack(seq.scratch.node_out)))
    (tok_a, par_a, out_a, nodes_a), (tok_b, par_b, out_b, nodes_b) = runs
    assert len(tok_a) > 3 and tok_a == tok_b and par_a == par_b  # a tree, not a chain
    assert torch.allclose(out_a, out_b, atol=1e-4) and torch.allclose(nodes_a, nodes_b, atol=1e-4)


@NATIVE
@pytest.mark.parametrize("mass", [0.0, 0.1])
def test_greedy_chains_in_one_kernel_call_draft_what_the_levels_draft(tmp_path, monkeypatch, mass):
    """Greedy chains go to head.cpp in one head_chain call for every request (the committed rows,
    then a row per level); they draft the tokens, the confidences and the stops (min_level_mass)
    of the level-by-level path, for requests of different depths in one call."""
    target = load_model(str(tiny.make_checkpoint(tmp_path / "wide", seed=4, hidden=64, heads=2, kv_heads=1)))
    head = tiny.make_head(target)
    ids = list(range(5, 17))
    states = target_states(target, ids).half()
    runs = []
    for chained in (True, False):
        proposer = tiny.head_proposer(target, head)
        proposer.min_level_mass = mass
        if chained:  # the level path must not run
            monkeypatch.setattr(proposer, "_grow", lambda works: pytest.fail("drafted level by level"))
        else:
            monkeypatch.setattr(proposer, "_chains", lambda live, fed: None)
        seqs = [Sequence(r, SamplingParams(max_tokens=4), None, tokens=list(ids[:n])) for r, n in (("a", 10), ("b", 7))]
        steps = []
        for end_a, end_b in ((10, 7), (12, 9)):  # a second step: the chain's rows rolled back first
            seqs[0].tokens, seqs[1].tokens = list(ids[:end_a]), list(ids[:end_b])
            fresh = 0 if end_a == 10 else 1  # the positions the step committed since the last
            items = [ProposeItem(seqs[0], 4, 4, [HiddenStates(fresh and 9, states[fresh and 9 : end_a - 1])]),
                     ProposeItem(seqs[1], 2, 2, [HiddenStates(fresh and 6, states[fresh and 6 : end_b - 1])])]
            trees = proposer.propose(items)
            steps.append([(t.tokens, t.parents, t.confidence, s.scratch.slots, s.scratch.last)
                          for t, s in zip(trees, seqs)])
        runs.append(steps)
        monkeypatch.undo()
    for step_a, step_b in zip(*runs):
        for (tok_a, par_a, conf_a, *st_a), (tok_b, par_b, conf_b, *st_b) in zip(step_a, step_b):
            assert tok_a == tok_b and par_a == par_b and st_a == st_b
            assert conf_a == pytest.approx(conf_b, rel=1e-5)
    depths = [len(tok) for step in runs[0] for tok, *_ in step]
    # without a floor every chain is as deep as asked; with one, request a's stop early
    assert min(depths) >= 1 and (depths == [4, 2, 4, 2] if mass == 0.0 else max(depths[0], depths[2]) < 4)


@NATIVE
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.7), (5, 1.0)])
def test_sampled_chains_in_one_kernel_call_draw_from_the_levels_q(tmp_path, monkeypatch, top_k, top_p):
    """Sampled chains go to head.cpp too (head_chain): each level's q is the level path's
    (temperature, top-k, top-p over the draft vocabulary, then its 32 most likely ids), given the
    same tokens before it, and the drawn tokens follow that q (chi-square over fresh seeds)."""
    target = load_model(str(tiny.make_checkpoint(tmp_path / "wide", seed=4, hidden=64, heads=2, kv_heads=1)))
    head = tiny.make_head(target)
    ids = list(range(5, 17))
    states = target_states(target, ids).half()
    params = SamplingParams(max_tokens=4, temperature=1.5, top_k=top_k, top_p=top_p, seed=1)

    def draft(proposer, seed):
        seq = Sequence("r", params, torch.Generator().manual_seed(seed), tokens=list(ids))
        return proposer.propose([ProposeItem(seq, 3, 3, [HiddenStates(0, states[:-1])])])[0]

    chained = tiny.head_proposer(target, head)
    monkeypatch.setattr(chained, "_grow", lambda works: pytest.fail("drafted level by level"))
    tree = draft(chained, 0)
    assert tree.is_chain() and len(tree) == 3
    levels = tiny.head_proposer(target, head)
    monkeypatch.setattr(levels, "_chains", lambda live, fed: None)
    # The level path draws the chain's tokens, so that its q's contexts are the chain's.
    level_ids = []  # each level's q ids, as grow receives them

    def grow(w, vals, q_ids, *args, **kwargs):
        level_ids.append(q_ids[0].tolist())
        return tree_growth.grow(w, vals, q_ids, *args, **kwargs)

    def the_chains_token(vals, n, **kwargs):
        return torch.tensor([level_ids[-1].index(tree.tokens[len(level_ids) - 1])])

    monkeypatch.setattr("services.draft.head_proposer.grow", grow)
    monkeypatch.setattr(tree_growth.torch, "multinomial", the_chains_token)
    ref = draft(levels, 0)
    assert ref.tokens == tree.tokens
    for d in range(3):
        got, want = dict(zip(tree.q_ids[d], tree.q_probs[d])), dict(zip(ref.q_ids[d], ref.q_probs[d]))
        assert set(got) == set(want) and len(got) <= (top_k or 32)
        assert all(abs(got[t] - want[t]) < 1e-5 for t in got)
    monkeypatch.undo()
    # the first level's draws over fresh seeds follow its q
    chained = tiny.head_proposer(target, head)
    q = dict(zip(tree.q_ids[0], tree.q_probs[0]))
    top = sorted(q, key=q.get, reverse=True)[:4]
    counts = dict.fromkeys(top + [-1], 0)
    for seed in range(1, 601):
        tok = draft(chained, seed).tokens[0]
        counts[tok if tok in top else -1] += 1
    expected = [q[t] for t in top] + [1.0 - sum(q[t] for t in top)]
    obs, exp = zip(*[(counts[t], 600 * e) for t, e in zip(top + [-1], expected) if 600 * e >= 5])
    assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue > 1e-3
