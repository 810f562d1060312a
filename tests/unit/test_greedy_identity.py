"""Temperature 0: the engine's output is the target's own greedy decoding, whatever the draft."""

import json
import random

import pytest
import torch

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.slim import SlimHead, kept_ids
from services.draft.slim_guard import GuardConfig, SlimGuard
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from services.scheduler.observers import StepLogObserver
from services.scheduler.request import Request
from tests import tiny

MAX_NEW = 40


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft)), tiny.hf_model(tiny_target)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    out = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (3, 9, 17)]
    out.append([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # repetitive: n-gram matches from the start
    return out


def assert_same_or_near_tie(hf, prompt, ours, ref):
    """Equal, or diverging only where the target's top-2 logits are within 1e-3."""
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b) if any(
        a != b for a, b in zip(ours, ref)) else min(len(ours), len(ref))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-3, f"diverged at output token {i} with a top-2 gap of {gap}: {ours} vs {ref}"


def slim_head(target, draft, hf, prompts, ratio=0.3):
    """SlimSpec on the tiny draft: keeps the ids the target generates most on the prompts."""
    outputs = [t for p in prompts for t in tiny.hf_greedy(hf, p, MAX_NEW)]
    counts = torch.bincount(torch.tensor(outputs), minlength=target.config.vocab_size).numpy()
    return SlimHead.build(draft.model, kept_ids(counts, ratio, target.config.vocab_size))


def make_proposer(kind, target, draft, slim=None):
    if kind == "slim":  # the slim head always
        return ModelProposer(draft.model, target.config.vocab_size, slim=slim)
    if kind == "slim-guard":  # a guard that switches between the slim and full heads within the run
        guard = SlimGuard(GuardConfig(points=0.0, calibration_tokens=4, window_tokens=8, min_tokens=4))
        return ModelProposer(draft.model, target.config.vocab_size, slim=slim, guard=guard)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramProposer()
    if kind == "self":
        return ModelProposer(target.model, target.config.vocab_size)
    return ModelProposer(draft.model, target.config.vocab_size)


CASES = [("none", 0, None), ("ngram", 4, None), ("ngram", 3, 8), ("self", 5, None), ("self", 3, 7),
         ("model", 1, None), ("model", 4, None), ("model", 2, 6), ("model", 4, 12), ("model", 6, 24),
         ("slim", 4, None), ("slim", 3, 9), ("slim-guard", 4, None), ("slim-guard", 2, 6)]


@pytest.mark.parametrize("kind,k,tree_size", CASES)
def test_engine_equals_hf_greedy(models, prompts, kind, k, tree_size):
    target, draft, hf = models
    slim = slim_head(target, draft, hf, prompts) if kind.startswith("slim") else None
    engine = Engine(target, make_proposer(kind, target, draft, slim),
                    StepConfig(draft_length=k, tree_size=tree_size, max_batch=3))
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))  # 4 prompts, batches of 3
    for prompt, req in zip(prompts, reqs):
        ref = tiny.hf_greedy(hf, prompt, MAX_NEW)
        assert_same_or_near_tie(hf, prompt, req.output_ids, ref)
    if kind in ("self", "model", "slim", "slim-guard"):
        steps = sum(r.stats.steps for r in reqs)
        assert steps < sum(len(r.output_ids) for r in reqs), "speculation never accepted anything"
    assert not engine.held_requests()  # every worker freed every finished request


@pytest.mark.parametrize("kind,k,tree_size", [("self", 8, None), ("self", 4, 10), ("ngram", 6, 12)])
def test_eos_in_the_middle_of_a_step(models, prompts, kind, k, tree_size):
    target, draft, hf = models
    prompt = prompts[1]
    free = tiny.hf_greedy(hf, prompt, 20, eos=None)
    eos = free[5]  # make the 6th generated token the end of sequence
    engine = Engine(target, make_proposer(kind, target, draft), StepConfig(draft_length=k, tree_size=tree_size))
    engine.core.target.eos_token_ids = (eos,)
    req = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    assert req.output_ids == free[: free.index(eos) + 1]
    assert req.finish_reason == "stop"
    if kind == "self":
        assert req.stats.steps <= 2  # the EOS arrived inside a step that accepted more


def test_stop_string_in_the_middle_of_a_step(models, prompts):
    target, _, hf = models
    prompt = prompts[2]
    free = tiny.hf_greedy(hf, prompt, 24, eos=None)
    tok = target.tokenizer
    stop = tok.decode(free[6:8])  # two words, e.g. "w12 w40"
    full = tok.decode(free)
    engine = Engine(target, ModelProposer(target.model, target.config.vocab_size), StepConfig(draft_length=8))
    req = engine.generate([prompt], SamplingParams(max_tokens=24, stop=(stop,)))[0]
    assert req.text == full[: full.index(stop)]
    assert stop not in req.text
    assert req.output_ids == free[: len(req.output_ids)] and len(req.output_ids) < 24
    assert req.finish_reason == "stop"


def test_default_model_greedy_identity(default_model):
    """The real default model with n-gram and self drafts, chain and tree, against HF generate."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model.path, dtype=torch.float32).eval()
    tok = default_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat after me: the quick brown fox "
                                       "jumps over the lazy dog. The quick brown fox jumps over the lazy dog."}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    for proposer, k, tree_size in [(NgramProposer(), 4, None), (NgramProposer(), 4, 10),
                                   (ModelProposer(default_model.model, 49152), 3, 6)]:
        engine = Engine(default_model, proposer, StepConfig(draft_length=k, tree_size=tree_size))
        req = engine.generate([prompt], SamplingParams(max_tokens=32))[0]
        assert_same_or_near_tie(hf, prompt, req.output_ids, ref[: len(req.output_ids)] if req.finish_reason == "stop" else ref)
        assert req.stats.steps < len(req.output_ids)


def test_a_draft_with_a_shorter_context_stops_drafting(tmp_path, models):
    target, _, hf = models
    short = load_model(str(tiny.make_checkpoint(tmp_path / "short-draft", seed=3, max_positions=16)))
    engine = Engine(target, ModelProposer(short.model, target.config.vocab_size), StepConfig(draft_length=4))
    prompt = [5, 6, 7, 8, 9]
    req = engine.generate([prompt], SamplingParams(max_tokens=30))[0]
    assert_same_or_near_tie(hf, prompt, req.output_ids, tiny.hf_greedy(hf, prompt, 30))
    assert len(req.output_ids) == 30 or req.finish_reason == "stop"


def ends_in_a_repeat(context: list[int], m: int) -> bool:
    """Whether the last m tokens of `context` occurred earlier in it."""
    return len(context) > m and any(context[i : i + m] == context[-m:] for i in range(len(context) - m))


def assert_asked_only_where_the_end_recurs(lines: list[dict], prompts: list[list[int]], outputs: list[list[int]],
                                           max_tokens: int, m: int = NgramProposer().min_match) -> None:
    """Step-log lines of requests run one after another (one request a line): after its prompt's
    step, each step gave the n-gram draft a k exactly where the request's last m tokens had
    occurred earlier in it (and it may still emit two tokens); both kinds of step occur."""
    lines = iter(lines)
    asked = skipped = 0
    for prompt, output in zip(prompts, outputs):
        done = 0
        (_, _, _, committed), = next(lines)["requests"]  # the prompt's step
        done += committed
        while done < len(output):
            (k, _, _, committed), = next(lines)["requests"]
            context = prompt + output[:done]
            recurs = ends_in_a_repeat(context, m) and max_tokens - done > 1
            assert (k > 0) == recurs, (prompt, done, k)
            asked, skipped = asked + recurs, skipped + (not recurs)
            done += committed
    assert asked and skipped


@pytest.mark.parametrize("draft_length", [4, "adaptive"])
def test_a_lookup_draft_is_asked_only_where_the_end_of_the_request_recurs(models, prompts, tmp_path, draft_length):
    """The n-gram finds nothing unless the request's last 2 tokens occurred before: the step does
    not ask it then (through the services that is a round trip saved), and the output is unchanged."""
    target, _, hf = models
    config = StepConfig(draft_length=draft_length, min_draft_length=1)  # adaptive: every step that may, drafts
    engine = Engine(target, NgramProposer(), config, warm_up=False)
    log = StepLogObserver(str(tmp_path / "steps.jsonl"))
    engine.core.observers.append(log)
    outputs = [engine.generate([p], SamplingParams(max_tokens=MAX_NEW))[0].output_ids for p in prompts]
    log.close()
    for prompt, output in zip(prompts, outputs):
        assert_same_or_near_tie(hf, prompt, output, tiny.hf_greedy(hf, prompt, MAX_NEW))
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert_asked_only_where_the_end_recurs(lines, prompts, outputs, MAX_NEW)


def test_recurs_marks_where_the_ngram_lookup_finds_a_match():
    """`Request.recurs(m)`, kept up to date token by token, says where an n-gram lookup whose
    shortest n is m proposes anything at all."""
    rng = random.Random(3)
    for m in (1, 2, 3):
        lookup = NgramProposer(max_ngram=3, min_ngram=m)
        assert lookup.min_match == m
        for _ in range(200):
            req = Request("r", [rng.randrange(6) for _ in range(rng.randint(1, 4))], SamplingParams(max_tokens=64),
                          None, (), 4, 4)
            for _ in range(rng.randint(1, 12)):
                assert req.recurs(m) == (len(lookup.tree(req.tokens, 4, 4)) > 0), (m, req.tokens)
                req.output_ids.extend(rng.randrange(8) for _ in range(rng.randint(1, 3)))
