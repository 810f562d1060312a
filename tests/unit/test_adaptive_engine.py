"""The adaptive draft length in the in-process engine: still lossless, and it stops drafting when
drafting cannot pay."""

import json

import pytest
import torch

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft import model_proposer
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from services.scheduler.latency import LatencyModel
from services.scheduler.observers import StepLogObserver
from tests import tiny
from tests.unit import test_distribution as dist

MAX_NEW = 40


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft)), tiny.hf_model(tiny_target)


def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 12)] + [[5, 6, 7, 8] * 3]


@pytest.mark.parametrize("kind,tree_size", [("model", None), ("model", 8), ("ngram", None)])
def test_adaptive_engine_equals_hf_greedy(models, kind, tree_size):
    target, draft, hf = models
    proposer = ModelProposer(draft.model, target.config.vocab_size) if kind == "model" else NgramProposer()
    engine = Engine(target, proposer, StepConfig(draft_length="adaptive", tree_size=tree_size, max_batch=2))
    ps = prompts()
    reqs = engine.generate(ps, SamplingParams(max_tokens=MAX_NEW))
    for prompt, req in zip(ps, reqs):
        assert req.output_ids == tiny.hf_greedy(hf, prompt, MAX_NEW)
    assert engine.controller.latency.verify.samples > 0  # warm-up and steps were measured
    assert not engine.held_requests()
    assert not engine.controller.accept  # finished requests are forgotten


@pytest.mark.parametrize("tree_size", [None, 6])
def test_adaptive_engine_samples_the_target_distribution(tmp_path_factory, home, tree_size):
    """k changes from step to step (chosen from past outcomes only) and trees are trimmed to
    their confident nodes, and every step stays an exact sample: the joint distribution of three
    tokens matches the target's (chi-square)."""
    root = tmp_path_factory.mktemp("adaptive-dist")
    target_dir = tiny.make_checkpoint(root / "target", vocab_size=dist.V, seed=21, init_std=0.2)
    close_dir = tiny.make_checkpoint(root / "close", vocab_size=dist.V, seed=22, noise_from=target_dir, noise_std=0.1)
    target, close = load_model(str(target_dir)), load_model(str(close_dir))
    params = SamplingParams(max_tokens=3, temperature=0.9, top_p=0.95, ignore_eos=True)
    engine = Engine(target, ModelProposer(close.model, dist.V),
                    StepConfig(draft_length="adaptive", min_draft_length=1, max_draft_length=3, max_batch=1000,
                                 tree_size=tree_size))
    counts, reqs = dist.sample_joint(engine, params)
    assert sum(r.stats.drafted for r in reqs) >= dist.SAMPLES  # it did speculate
    # A draft model's sampled tokens are verified as proposed: trimming them by their own q
    # would bias the output (services/scheduler/trim.py).
    assert engine.controller.kept_nodes == engine.controller.proposed_nodes > 0
    dist.assert_matches(counts, dist.exact_distribution(tiny.hf_model(target_dir), params))


def test_adaptive_stops_drafting_a_draft_that_is_never_right(models, monkeypatch):
    """A draft that proposes the target's least likely tokens is never accepted: after a probe or
    two the controller decodes plainly, re-probing only rarely."""
    target, _, _ = models
    vocab = target.config.vocab_size
    proposer = ModelProposer(target.model, vocab)
    monkeypatch.setattr(model_proposer, "distributions", lambda works, logits, *_: [
        (-lg[:, :vocab].float()).softmax(-1).topk(4, dim=-1) for lg in logits])
    engine = Engine(target, proposer, StepConfig(draft_length="adaptive", max_draft_length=4), warm_up=False)
    # Drafting pays at the prior (alpha 0.5) under this latency law, and not at alpha 0.
    engine.controller.latency = LatencyModel(verify_prior=(10.0, 0.0, 2.0), draft_prior=(0.0, 0.0, 0.5, 0.5))
    req = engine.generate([prompts()[1]], SamplingParams(max_tokens=80, ignore_eos=True))[0]
    assert req.stats.accepted == 0
    assert 1 <= req.stats.drafted <= 12  # it did try, then mostly decoded plainly
    assert len(req.output_ids) == 80


def test_trimmed_ngram_trees_sample_the_target_distribution(tmp_path_factory, home):
    """The n-gram's point-mass proposals are trimmed by their confidence (a function of the
    context), some nodes kept and some cut, and the output is still exactly the target's."""
    root = tmp_path_factory.mktemp("trim-dist")
    target_dir = tiny.make_checkpoint(root / "target", vocab_size=dist.V, seed=21, init_std=0.2)
    target = load_model(str(target_dir))
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    engine = Engine(target, NgramProposer(max_ngram=2, min_ngram=1),
                    StepConfig(draft_length="adaptive", min_draft_length=1, max_draft_length=2, tree_size=4,
                                 max_batch=200), warm_up=False)
    # A verify cost per node that makes only some nodes pay (its large fixed part makes the real
    # drafting time negligible, so the cut does not depend on this machine's speed).
    engine.controller.latency = LatencyModel(verify_prior=(200.0, 0.0, 0.5), draft_prior=(0.0, 0.0, 0.0, 0.0))
    engine.controller.latency.verify.observe = lambda *a: None  # hold the cost law fixed
    counts, reqs = dist.sample_joint(engine, params)
    c = engine.controller
    assert 0 < c.kept_nodes < c.proposed_nodes
    assert 0 < sum(r.stats.accepted for r in reqs) < sum(r.stats.drafted for r in reqs)
    dist.assert_matches(counts, dist.exact_distribution(tiny.hf_model(target_dir), params))


def test_prefill_steps_stay_out_of_the_latency_model(models):
    """A request's first step runs its prompt: its time would read as a costly step with few draft
    nodes. The engine keeps it out of the fit, and learns from the decode steps after it."""
    target, _, _ = models
    # No warm-up: every sample the fit has comes from the steps below.
    engine = Engine(target, NgramProposer(), StepConfig(draft_length="adaptive"), warm_up=False)
    fit = engine.controller.latency.verify
    req = engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=6))
    engine.step()  # the prefill
    assert fit.samples == 0
    while not req.finished:
        engine.step()
    assert fit.samples == req.stats.steps - 1


def test_the_step_log_has_a_line_per_step_and_every_token_committed(models, tmp_path):
    """`--step-log`: one JSON line per step; the tokens its lines say were committed are the
    requests' outputs, and the steps that planned say what the plan predicted."""
    target, _, _ = models
    engine = Engine(target, NgramProposer(min_ngram=1), StepConfig(draft_length="adaptive", max_batch=2), warm_up=False)
    log = StepLogObserver(str(tmp_path / "steps.jsonl"))
    engine.core.observers.append(log)
    reqs = engine.generate(prompts(), SamplingParams(max_tokens=24))
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(engine.core.steps))
    assert sum(r[3] for line in lines for r in line["requests"]) == sum(len(r.output_ids) for r in reqs)
    assert all(line["verify_ms"] > 0 and 1 <= line["batch"] <= 2 for line in lines)
    assert all(0 < line["verify_compute_ms"] <= line["verify_ms"] for line in lines)  # the workers' own part
    assert all(0 <= line["draft_compute_ms"] <= line["draft_ms"] for line in lines)
    assert any(line["draft_compute_ms"] > 0 for line in lines)
    planned = [line for line in lines if line["planned_ms"] is not None]
    assert planned and all(line["planned_tokens"] >= 1 for line in planned)
