"""Chunked prefill (services/scheduler/budget.py, core.py): prompts join over several steps within
a per-step token budget, and the tokens are exactly those of whole-prompt prefill."""

import math
import random

import pytest
import torch

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.common.sequence import Sequences
from services.common.tree import DraftTree
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.scheduler.budget import MIN_CHUNK, StepBudget, positions
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from services.verifier.verifier import Verifier, VerifyItem
from tests import tiny

WHOLE = dict(max_step_tokens=0, target_itl_ms=0)  # every prompt joins whole


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    out = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (23, 5, 41, 12, 30)]
    out.append([5, 6, 7, 8] * 6)  # repetitive: the n-gram drafts from its prompt
    return out


def rows_per_forward(engine: Engine) -> list[int]:
    """Record the rows of every verify forward the engine runs."""
    rows, model = [], engine.verifier.model
    original = model.forward_states

    def spy(chunks, layers):
        rows.append(sum(len(ch.tokens) for ch in chunks))
        return original(chunks, layers)

    model.forward_states = spy
    return rows


def proposer(kind, models):
    target, draft = models
    return {"none": lambda: None, "ngram": NgramProposer,
            "model": lambda: ModelProposer(draft.model, target.config.vocab_size),
            "head": lambda: tiny.head_proposer(target, tiny.make_head(target, seed=3))}[kind]()


def run(models, kind, prompts, params, **config):
    engine = Engine(models[0], proposer(kind, models), StepConfig(**{"draft_length": 3, "max_batch": 3, **config}),
                    warm_up=False)
    rows = rows_per_forward(engine)
    reqs = engine.generate(prompts, params)
    assert not engine.held_requests()
    return reqs, rows


@pytest.mark.parametrize("kind,budget,tree_size", [("none", 3, None), ("ngram", 7, 8), ("model", 4, None),
                                                   ("model", 13, 6), ("head", 5, 5)])
def test_chunked_and_whole_prefill_give_the_same_tokens(models, prompts, kind, budget, tree_size):
    """Greedy, 6 prompts over 3 batch slots: later prompts join while others decode, in chunks of
    a budget that puts their boundaries anywhere; no forward exceeds the budget."""
    params = SamplingParams(max_tokens=24)
    whole, _ = run(models, kind, prompts, params, tree_size=tree_size, **WHOLE)
    chunked, rows = run(models, kind, prompts, params, tree_size=tree_size, max_step_tokens=budget)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]
    assert max(rows) <= budget
    assert sum(r.stats.steps for r in chunked) > 0


def test_chunked_sampling_gives_the_same_tokens(models, prompts):
    """T > 0 with a seed: prompt chunks draw nothing from the verifier's random stream, so plain
    decoding gives the very same tokens (with a draft, trees cut to the budget draw differently:
    test_distribution.py checks the distribution)."""
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=4)
    whole, _ = run(models, "none", prompts, params, **WHOLE)
    chunked, _ = run(models, "none", prompts, params, max_step_tokens=6)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]


@pytest.mark.parametrize("length,budget", [(41, 8), (40, 8), (9, 16), (23, 3)])
def test_a_lone_prompt_prefills_in_ceil_len_over_budget_steps(models, length, budget):
    prompt = [3 + i % 50 for i in range(length)]
    engine = Engine(models[0], None, StepConfig(draft_length=0, max_batch=3, max_step_tokens=budget), warm_up=False)
    rows = rows_per_forward(engine)
    req = engine.add_request(prompt, SamplingParams(max_tokens=3))
    steps = 0
    while not req.output_ids:
        engine.step()
        steps += 1
    assert steps == math.ceil(length / budget)
    assert rows == [budget] * (steps - 1) + [length - budget * (steps - 1)]


def test_a_prompt_a_decoding_request_holds_costs_only_the_rows_the_verifier_computes(models):
    """A second request with the same 24-token prompt (not a sample of the first: any identical
    question, or a shared system prompt) joins while the first decodes: the verifier copies all
    but its last token, so within 6 rows a step it joins in one step of 2 rows, where counting its
    whole prompt took 4 more steps; its tokens are the first's."""
    prompt = [3 + (7 * i) % 50 for i in range(24)]
    engine = Engine(models[0], None, StepConfig(draft_length=0, max_batch=3, max_step_tokens=6), warm_up=False)
    rows = rows_per_forward(engine)
    first = engine.add_request(prompt, SamplingParams(max_tokens=8))
    while not first.output_ids:
        engine.step()
    assert rows == [6, 6, 6, 6]
    second = engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()
    assert second.output_ids and rows[-1] == 2  # the first's decode row, the second's last prompt token
    while engine.has_work():
        engine.step()
    assert second.output_ids == first.output_ids and max(rows) <= 6


def test_a_model_draft_prefills_in_chunks_too(models, prompts):
    """The draft model takes each prompt chunk the step after the verifier (its KV continues
    across steps), so its forwards stay within the budget too, and the tokens are unchanged."""
    target, draft = models
    prompt = prompts[2] + prompts[4]  # 71 tokens
    want = run(models, "model", [prompt], SamplingParams(max_tokens=16), **WHOLE)[0][0].output_ids
    engine = Engine(target, ModelProposer(draft.model, target.config.vocab_size),
                    StepConfig(draft_length=3, max_batch=3, max_step_tokens=8), warm_up=False)
    rows, original = [], draft.model.forward_states

    def spy(chunks, layers):
        rows.append(sum(len(ch.tokens) for ch in chunks))
        return original(chunks, layers)

    draft.model.forward_states = spy
    try:
        got = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    finally:
        del draft.model.forward_states
    assert got.output_ids == want
    assert max(rows) <= 8 and sum(rows) > len(prompt)


def test_decode_and_tree_rows_come_first_and_prompts_keep_their_order(models):
    """Running requests keep decoding (trees cut to fit) while two long prompts join in turn."""
    target = models[0]
    engine = Engine(target, ModelProposer(models[1].model, target.config.vocab_size),
                    StepConfig(draft_length=4, tree_size=8, max_batch=3, max_step_tokens=24), warm_up=False)
    rows = rows_per_forward(engine)
    first = engine.add_request([4, 5, 6], SamplingParams(max_tokens=30))
    engine.step()  # `first` decodes from now on
    long_a = engine.add_request([3 + i % 40 for i in range(60)], SamplingParams(max_tokens=4))
    long_b = engine.add_request([7 + i % 30 for i in range(60)], SamplingParams(max_tokens=4))
    firsts = {}
    for step in range(1, 12):
        before = len(first.output_ids)
        engine.step()
        assert len(first.output_ids) > before or first.finished  # never stalled by the prompts
        for r in (long_a, long_b):
            if r.output_ids and r.req_id not in firsts:
                firsts[r.req_id] = step
    assert max(rows) <= 24
    assert firsts[long_a.req_id] < firsts[long_b.req_id]  # first come, first served


def test_the_time_budget_learns_the_cost_of_rows_and_floors():
    b = StepBudget(target_itl_ms=200)
    assert b.prompt_rows(0, 0) is None  # nothing decodes: no limit
    for decode_rows, prompt_rows in [(0, 60), (4, 0), (8, 0), (4, 100), (1, 300), (16, 16), (8, 50)] * 3:
        b.observe(10.0 + 5.0 * decode_rows + 1.5 * prompt_rows, decode_rows, prompt_rows)
    assert b.margin_ms > 5  # the prior's first predictions missed
    for _ in range(100):  # and fade from the margin once the fit holds
        b.observe(10.0 + 5.0 * 4 + 1.5 * 50, 4, 50)
    assert b.margin_ms < 2
    assert abs(b.decode_ms(4) - 30.0) < 0.5 and abs(b.token_ms - 1.5) < 0.02
    assert abs(b.prompt_rows(4, 4) - (200 - b.margin_ms - 30) / 1.5) <= 1
    assert abs(b.prompt_rows(4, 4, spent_ms=30.0) - (200 - b.margin_ms - 60) / 1.5) <= 1  # drafting spent part of it
    assert abs(b.prompt_rows(4, 4, spent_ms=120.0) - 150 / 1.5) <= 1  # past half the target: at most doubles
    assert abs(b.prompt_rows(1, 1, spent_ms=105.0, waiting=3) - 3 * 120 / 1.5) <= 2  # a burst: 3 prompts, 1 stream
    for _ in range(200):  # the machine slows down: prompt tokens cost twice as much
        b.observe(10.0 + 5.0 * 8 + 3.0 * 40, 8, 40)
        b.observe(10.0 + 5.0 * 8, 8, 0)
    assert 2.7 < b.token_ms < 3.1  # it follows (the old steps fade at 1% a step)
    capped = StepBudget(max_step_tokens=40, target_itl_ms=200)
    assert capped.prompt_rows(30, 4) == 10  # the row limit binds before the time
    assert capped.tree_rows(4, prompts_wait=True) == 40 - 4 - MIN_CHUNK
    assert StepBudget(target_itl_ms=200).prompt_rows(30, 30, spent_ms=500.0) >= MIN_CHUNK
    with pytest.raises(ValueError, match="max_batch"):
        StepBudget(max_step_tokens=8).validate(max_batch=16)


def test_the_budget_prices_a_late_chunk_higher_and_keeps_a_margin_for_its_misses():
    """A prompt row attends to the prompt before it: the fit learns a cost per position, and a
    chunk starting late gets the rows whose predicted time fits (checked by brute force). Steps
    that run past their prediction leave a margin under the target."""
    def ms(dec, rows, start):
        return 10.0 + 5.0 * dec + 1.0 * rows + 0.8 * positions(start, rows)

    def most_rows(start):  # the most rows whose step fits the target, by brute force
        return max(n for n in range(1000) if ms(4, n, start) <= 200 - b.margin_ms)

    b = StepBudget(target_itl_ms=200)
    shapes = [(4, 0, 0), (8, 0, 0), (4, 100, 0), (4, 100, 500), (2, 200, 300), (8, 50, 900), (1, 300, 0)]
    for _ in range(60):
        for dec, rows, start in shapes:
            b.observe(ms(dec, rows, start), dec, rows, positions(start, rows))
    assert b.margin_ms < 2
    early, late = b.prompt_rows(4, 4), b.prompt_rows(4, 4, start=600)
    assert abs(early - most_rows(0)) <= 1 and abs(late - most_rows(600)) <= 1 and late < early - 40
    rng = random.Random(0)
    for _ in range(100):  # steps with prompt rows now run 0-40 ms past what the rows cost
        for dec, rows, start in shapes:
            b.observe(ms(dec, rows, start) + (rng.uniform(0, 40) if rows else 0.0), dec, rows, positions(start, rows))
    assert 10 < b.margin_ms < 40
    no_margin = b.rows_within(200 - b.decode_ms(4), 0)  # what the fit alone would let in
    assert b.prompt_rows(4, 4) == b.rows_within(200 - b.margin_ms - b.decode_ms(4), 0) < no_margin - 5


def test_the_verifier_caches_a_prompt_chunk_and_verifies_nothing(models):
    target = models[0]
    verifier, seqs = Verifier(target.model), Sequences(1)
    prompt = [3 + i % 40 for i in range(30)]
    whole = seqs.update("whole", 0, prompt, SamplingParams())
    want = verifier.verify([VerifyItem(whole, DraftTree())])[0]
    part = seqs.update("part", 0, prompt[:13], SamplingParams())
    got = verifier.verify([VerifyItem(part, DraftTree(), prefill=True)])[0]
    assert got.tokens == [] and part.cache.length == 13
    part = seqs.update("part", 13, prompt[13:], None)
    assert verifier.verify([VerifyItem(part, DraftTree())])[0].tokens == want.tokens
    assert torch.allclose(part.cache.k[:, :, :30], whole.cache.k[:, :, :30], atol=1e-5)
    tree = DraftTree()
    tree.add(5, -1, [5], [1.0])
    with pytest.raises(ValueError, match="prefill chunk"):
        verifier.verify([VerifyItem(seqs.update("bad", 0, prompt[:5], SamplingParams()), tree, prefill=True)])
