"""SlimSpec: the kept-id selection, the slim head's logits, the frequency table's lookup and cache,
and the quality guard's policy on simulated acceptance streams."""

import numpy as np
import pytest
import torch

from services.common.llama import Chunk
from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft import slim as slim_mod
from services.draft.factory import build_proposer
from services.draft.model_proposer import ModelProposer
from services.draft.slim import COUNTS_NAME, SlimHead, counts_key, kept_ids, load_counts
from services.draft.slim_guard import CALIBRATING, FALLBACK, SLIM, GuardConfig, SlimGuard
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine

# ---- kept ids ---------------------------------------------------------------------------------


def test_kept_ids_are_the_most_frequent_plus_eos():
    counts = np.array([0, 5, 0, 9, 1, 7, 3, 0, 2, 8])
    kept = kept_ids(counts, 0.3, 10, always=(2,))
    assert sorted(kept.tolist()) == [2, 3, 9]  # EOS (2), then counts 9 and 8
    assert kept_ids(counts, 0.5, 10).tolist() == [3, 9, 5, 1, 6]
    assert len(kept_ids(counts, 1.0, 10)) == 10


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_a_bad_ratio_is_refused_by_name(ratio):
    with pytest.raises(ValueError, match="compression_ratio"):
        kept_ids(np.ones(10), ratio, 10)


# ---- the slim head ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft))


def test_slim_logits_are_the_full_logits_of_the_kept_ids(tiny_models):
    _, draft = tiny_models
    kept = torch.tensor([7, 3, 40, 2, 11])
    slim = SlimHead.build(draft.model, kept)
    tokens = [5, 9, 12, 30]
    full = draft.model.forward([Chunk(draft.model.new_cache(8), tokens, [-1, 0, 1, 2], 0)])[0]
    small = slim.model.forward([Chunk(draft.model.new_cache(8), tokens, [-1, 0, 1, 2], 0)])[0]
    assert small.shape == (4, 5)  # [rows, kept]
    torch.testing.assert_close(small, full[:, kept], rtol=1e-5, atol=1e-5)
    assert slim.model.layers is draft.model.layers  # the same layers: one KV cache serves both heads


# ---- the frequency table ----------------------------------------------------------------------


def test_counts_are_computed_from_the_target_once_then_cached(tiny_models, home):
    target, draft = tiny_models
    cache = home / "slimspec" / f"{counts_key(draft.path, target.path)}.npy"
    cache.unlink(missing_ok=True)  # other tests may have counted this pair already
    first = load_counts(draft, target)
    assert first.shape == (target.config.vocab_size,) and first.sum() > 0
    assert cache.is_file()
    np.save(cache, np.arange(target.config.vocab_size))  # a later load reads the cache
    assert load_counts(draft, target).tolist() == list(range(target.config.vocab_size))
    cache.unlink()


def test_counts_shipped_next_to_the_draft_win(tiny_models, tiny_draft, tmp_path):
    import shutil

    target, _ = tiny_models
    copy = tmp_path / "draft"
    shutil.copytree(tiny_draft, copy)
    counts = np.zeros(target.config.vocab_size, dtype=np.int64)
    counts[[10, 20, 30]] = [3, 2, 1]
    np.save(copy / COUNTS_NAME, counts)
    proposer = build_proposer(str(copy), target, compression_ratio=0.05)  # round(0.05 * 64) = 3 ids
    assert sorted(proposer.slim.kept.tolist()) == [2, 10, 20]  # EOS first, then the most frequent


def test_counts_are_counted_on_target_generated_tokens(tiny_models):
    target, _ = tiny_models
    counts = slim_mod.count_target_tokens(target, prompts=4, max_tokens=8)
    assert 0 < counts.sum() <= 4 * 8


# ---- the guard policy on simulated acceptance streams ------------------------------------------


def feed(guard, n, rate, slim, tokens=4):
    """n trees of `tokens` drafted tokens each, accepted at `rate` on average (deterministic)."""
    acc = 0.0
    for _ in range(n):
        acc += rate * tokens
        a = int(acc + 1e-9)
        acc -= a
        guard.observe(tokens, a, slim)


CFG = GuardConfig(points=5.0, calibration_tokens=100, window_tokens=200, min_tokens=80)


def test_calibrates_with_the_full_head_then_goes_slim():
    g = SlimGuard(CFG)
    assert g.mode == CALIBRATING and not g.use_slim()
    feed(g, 24, 0.6, slim=False)  # 96 tokens: not yet
    assert g.mode == CALIBRATING
    feed(g, 1, 0.6, slim=False)
    assert g.mode == SLIM and g.use_slim() and g.full_rate == pytest.approx(0.6, abs=0.02)


def test_a_small_drop_is_tolerated():
    g = SlimGuard(CFG)
    feed(g, 25, 0.6, slim=False)
    feed(g, 500, 0.57, slim=True)  # 3 points below: within 5
    assert g.mode == SLIM and g.fallbacks == 0


def test_a_large_drop_falls_back_and_counts():
    g = SlimGuard(CFG)
    feed(g, 25, 0.6, slim=False)
    feed(g, 19, 0.40, slim=True)  # 76 tokens: below min_tokens, not judged yet
    assert g.mode == SLIM
    feed(g, 1, 0.40, slim=True)
    assert g.mode == FALLBACK and not g.use_slim() and g.fallbacks == 1


def test_switches_back_after_recalibration_and_backs_off_when_it_recurs():
    g = SlimGuard(CFG)
    feed(g, 25, 0.6, slim=False)
    feed(g, 20, 0.3, slim=True)
    assert g.mode == FALLBACK
    feed(g, 5, 0.3, slim=True)  # late slim trees (drafted before the switch) are ignored
    feed(g, 25, 0.5, slim=False)  # recalibration: 100 full-head tokens at 50%
    assert g.mode == SLIM and g.recoveries == 1 and g.full_rate == pytest.approx(0.5, abs=0.01)
    feed(g, 20, 0.3, slim=True)  # still bad: second fallback, recalibration twice as long
    assert g.mode == FALLBACK and g.fallbacks == 2
    feed(g, 25, 0.5, slim=False)
    assert g.mode == FALLBACK
    feed(g, 25, 0.5, slim=False)
    assert g.mode == SLIM and g.recoveries == 2


def test_the_rolling_window_forgets_old_trees():
    g = SlimGuard(CFG)
    feed(g, 25, 0.6, slim=False)
    feed(g, 50, 0.9, slim=True)  # a good stretch
    feed(g, 50, 0.5, slim=True)  # then 10 points worse: the window (200 tokens) now holds only these
    assert g.mode == FALLBACK and g.fallbacks == 1


@pytest.mark.parametrize("field,value", [("points", -1.0), ("calibration_tokens", 0), ("min_tokens", 1000)])
def test_bad_guard_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SlimGuard(GuardConfig(**{field: value}))


# ---- the guard inside the proposer ------------------------------------------------------------


def test_a_slim_head_that_misses_the_targets_tokens_is_replaced_by_the_full_head(tiny_models):
    """A kept set built from the wrong frequency table: acceptance collapses, the guard switches
    to the full head, and the output is still the target's. (The target drafts for itself, so the
    full head's calibrated rate is 100%.)"""
    target, _ = tiny_models
    draft = target
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23]]
    plain = Engine(target, None, StepConfig(draft_length=0)).generate(prompts, SamplingParams(max_tokens=40))
    produced = {t for r in plain for t in r.output_ids}
    wrong = torch.tensor([t for t in range(3, 64) if t not in produced][:10])
    guard = SlimGuard(GuardConfig(points=10.0, calibration_tokens=16, window_tokens=32, min_tokens=16))
    proposer = ModelProposer(draft.model, target.config.vocab_size, slim=SlimHead.build(draft.model, wrong),
                             guard=guard)
    engine = Engine(target, proposer, StepConfig(draft_length=4, max_batch=3))
    reqs = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    state = proposer.slim_state()
    assert state["fallbacks"] >= 1 and state["full_rate"] == 1.0 and state["slim_rate"] == 0.0, state
