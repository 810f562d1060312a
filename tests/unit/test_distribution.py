"""Temperature > 0: the engine samples exactly the target's distribution, whatever the draft.

On a tiny model with an 8-token vocabulary, the empirical distribution of the first three
generated tokens over 20,000 seeded samples is compared with the exact distribution, computed by
enumerating all 512 continuations with transformers (chi-square, p > 1e-3).
"""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.common import cpu_kernels
from services.common.kv_cache import KVCache
from services.common.loading import load_model
from services.common.sampling import SamplingParams, warp_probs
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.slim import SlimHead
from services.draft.slim_guard import GuardConfig, SlimGuard
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny

V = 8
SAMPLES = 20000
PROMPT = [3, 4, 5, 6, 3, 4, 5]  # repetitive, so the n-gram proposer finds matches


@pytest.fixture(scope="module")
def models(tmp_path_factory, home):
    root = tmp_path_factory.mktemp("dist")
    target = tiny.make_checkpoint(root / "target", vocab_size=V, seed=21, init_std=0.2)
    close = tiny.make_checkpoint(root / "close", vocab_size=V, seed=22, noise_from=target, noise_std=0.1)
    bad = tiny.make_checkpoint(root / "random", vocab_size=V, seed=23, init_std=0.5)
    # head size 32, which the feature head's native kernels (head.cpp's chains) take
    wide = tiny.make_checkpoint(root / "wide", vocab_size=V, seed=25, init_std=0.2, hidden=64, heads=2, kv_heads=1)
    return {"target": load_model(str(target)), "close": load_model(str(close)),
            "random": load_model(str(bad)), "hf": tiny.hf_model(target),
            "wide": load_model(str(wide)), "hf-wide": tiny.hf_model(wide)}


def exact_distribution(hf, params: SamplingParams) -> np.ndarray:
    """P(x1, x2, x3) over all V**3 continuations of PROMPT, float64."""
    joint = np.zeros((V, V, V))
    with torch.no_grad():
        def dist(prefix):
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:].double()
            return warp_probs(logits, params.temperature, params.top_k, params.top_p)[0].double().numpy()
        p1 = dist(())
        for a in range(V):
            p2 = dist((a,))
            for b in range(V):
                joint[a, b] = p1[a] * p2[b] * dist((a, b))
    return joint


SLIM_KEPT = torch.tensor([2, 3, 4, 5])  # SlimSpec at ratio 0.5: q = 0 on ids 0, 1, 6, 7


def make_proposer(models, kind):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramProposer(max_ngram=2)
    if kind == "head-wide":  # on the native kernels where they are built: head.cpp drafts the chains
        proposer = tiny.head_proposer(models["wide"], tiny.make_head(models["wide"], seed=24))
        assert proposer.head.native is not None or not cpu_kernels.available()
        return proposer
    if kind.startswith("head"):  # the feature head, untrained (from the target's last layer)
        kept = SLIM_KEPT if kind == "head-slim" else None
        return tiny.head_proposer(models["target"], tiny.make_head(models["target"], kept=kept, seed=24))
    draft = models["close" if kind.startswith("close") else "random"].model
    if kind == "close-slim":  # the slim head always
        return ModelProposer(draft, V, slim=SlimHead.build(draft, SLIM_KEPT))
    if kind == "close-slim-guard":  # a guard that keeps switching between the slim and full heads
        guard = SlimGuard(GuardConfig(points=0.0, calibration_tokens=4, window_tokens=8, min_tokens=4))
        return ModelProposer(draft, V, slim=SlimHead.build(draft, SLIM_KEPT), guard=guard)
    return ModelProposer(draft, V)


def run_engine(models, proposer_kind, k, tree_size, params) -> np.ndarray:
    target = models["wide" if proposer_kind == "head-wide" else "target"]
    chunked = proposer_kind.endswith("-chunked")  # prompts join in chunks of a 1003-row step budget
    proposer = make_proposer(models, proposer_kind.removesuffix("-chunked"))
    engine = Engine(target, proposer, StepConfig(draft_length=k, tree_size=tree_size, max_batch=1000,
                                                 max_step_tokens=1003 if chunked else 0))
    return sample_joint(engine, params)


def sample_joint(engine: Engine, params: SamplingParams) -> tuple[np.ndarray, list]:
    """SAMPLES seeded requests of PROMPT: the joint counts [V, V, V] of their first 3 tokens, and the requests."""
    reqs = [engine.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": s}))
            for s in range(SAMPLES)]
    while engine.has_work():
        engine.step()
    counts = np.zeros((V, V, V))
    for r in reqs:
        assert len(r.output_ids) == params.max_tokens
        counts[tuple(r.output_ids[:3])] += 1
    return counts, reqs


def assert_matches(counts: np.ndarray, joint: np.ndarray):
    """Sampled counts against exact probabilities (same shape): chi-square over the bins expecting
    at least 5, the rest pooled, and nothing sampled where the probability is 0."""
    expected = joint.ravel() * counts.sum()
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0, "sampled a continuation of target probability 0"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = chisquare(obs, exp * obs.sum() / exp.sum())
    assert stat.pvalue > 1e-3, f"chi-square p = {stat.pvalue:.2e} over {len(obs)} bins"


CASES = [
    ("close", 2, None, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),  # chain
    ("close", 2, 5, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),  # tree
    ("close", 2, 4, SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True)),
    ("random", 3, 6, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),  # bad draft
    ("random", 2, None, SamplingParams(max_tokens=3, temperature=1.2, top_p=0.7, ignore_eos=True)),
    ("ngram", 2, 4, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),  # point-mass q
    # SlimSpec: q is zero outside the kept ids, the output distribution is still the target's
    ("close-slim", 2, 5, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),
    ("close-slim-guard", 2, None, SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9,
                                                 ignore_eos=True)),
    # the feature head: drafts from the target's states (from the second step on)
    ("head", 2, None, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),
    ("head", 2, 5, SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True)),
    ("head-slim", 2, 4, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),
    # chains of 2 (5 tokens asked: the second step drafts 2) from head.cpp, on a target it takes
    ("head-wide", 2, 2, SamplingParams(max_tokens=5, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True)),
    # chunked prefill: chunk boundaries anywhere in the prompt, trees cut to the step's budget
    ("head-chunked", 2, 4, SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True)),
]


@pytest.mark.parametrize("kind,k,tree_size,params", CASES)
def test_first_three_tokens_match_the_exact_distribution(models, kind, k, tree_size, params):
    counts, reqs = run_engine(models, kind, k, tree_size, params)
    assert_matches(counts, exact_distribution(models["hf-wide" if kind == "head-wide" else "hf"], params))
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    assert drafted > 0 and 0 < accepted < drafted  # both accept and reject paths were exercised


def test_slim_proposals_stay_in_the_kept_ids(models):
    """With the slim head, every drafted token and every id of its q is a kept id."""
    proposer = make_proposer(models, "close-slim")
    engine = Engine(models["target"], proposer, StepConfig(draft_length=3, tree_size=6))
    seen = []
    original = proposer.propose
    proposer.propose = lambda items: [seen.append(t) or t for t in original(items)]
    engine.generate([PROMPT] * 4, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    kept = set(SLIM_KEPT.tolist())
    nodes = [(tok, ids) for t in seen for tok, ids in zip(t.tokens, t.q_ids)]
    assert nodes and all(tok in kept and set(ids) <= kept for tok, ids in nodes)


def test_the_guard_exercised_both_heads(models):
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    proposer = make_proposer(models, "close-slim-guard")
    # Whole prompts: a request joining in chunks does not draft its first step, and with 3 tokens
    # each the guard would see too few drafts to calibrate both heads.
    engine = Engine(models["target"], proposer, StepConfig(draft_length=2, max_batch=50, target_itl_ms=0))
    for s in range(400):
        engine.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": s}))
    while engine.has_work():
        engine.step()
    state = proposer.slim_state()
    assert state["full_rate"] is not None and state["slim_rate"] is not None


def test_same_seed_same_tokens(models):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = Engine(models["target"], ModelProposer(models["close"].model, V), StepConfig(3, 6))
        outs.append(engine.generate([PROMPT], params)[0].output_ids)
    assert outs[0] == outs[1]


def test_samples_that_copy_the_prompt_s_kv_match_the_exact_distribution(models, monkeypatch):
    """n = 4 samples per prompt (the OpenAI `n`): the followers' workers copy the prompt's KV from
    the first sample's (Sequence.share_prefix), and join whole under a row budget."""
    forks = []
    fork = KVCache.fork
    monkeypatch.setattr(KVCache, "fork", lambda self, n, room: forks.append(n) or fork(self, n, room))
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    engine = Engine(models["target"], make_proposer(models, "close"),
                    StepConfig(draft_length=2, tree_size=5, max_batch=1000, max_step_tokens=1003))
    reqs = [engine.core.submit(f"g{s // 4}#{s % 4}", PROMPT, SamplingParams(**{**params.__dict__, "seed": s}),
                               follows=f"g{s // 4}#0" if s % 4 else None) for s in range(SAMPLES)]
    while engine.has_work():
        engine.step()
    counts = np.zeros((V, V, V))
    for r in reqs:
        counts[tuple(r.output_ids)] += 1
    assert_matches(counts, exact_distribution(models["hf"], params))
    assert sum(r.stats.accepted for r in reqs) > 0
    # the verifier copies at least the prompt but its last token for every follower (the draft
    # takes them a step later, when here their first sample has finished its 3 tokens)
    assert sum(n >= len(PROMPT) - 1 for n in forks) >= 3 * (SAMPLES // 4)
