"""Structured outputs: the grammar-masked target, with and without speculation.

On a tiny model with a byte-level tokenizer (the kind llguidance reads): the masks a tree's rows
get equal a fresh matcher's along each node's path; greedy constrained output equals an
independent reference loop (transformers logits, llguidance's own mask, argmax) with no draft,
an n-gram draft, and draft-model chains and trees; sampled constrained output matches the exact
masked distribution (chi-square); the draft's pruning drops only what is exact to drop.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from services.common.constraint import Constraints, allowed_tokens, apply_masks
from services.common.grammar import Grammar
from services.common.loading import load_model
from services.common.sampling import SamplingParams, make_generator, warp_probs
from services.common.sequence import Sequence
from services.common.tree import DraftTree
from services.common.worker import WorkItem
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import ProposeWork
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.unit.test_distribution import assert_matches

V = 288
MERGES = ('{"', '":', "ab", "cd", "bc")
GRAMMARS = [
    Grammar("regex", "(ab|cd|x)+[0-9]{2}"),
    Grammar("json_schema", json.dumps({"type": "object", "properties": {"ab": {"type": "integer"},
                                                                       "cd": {"type": "boolean"}},
                                       "required": ["ab", "cd"], "additionalProperties": False})),
    Grammar("choice", json.dumps(["abc", "abd", "cd"])),
    Grammar("lark", 'start: item ("," item)*\nitem: "ab" | "cd" | /[0-9]/'),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory, home):
    root = tmp_path_factory.mktemp("structured")
    target = tiny.make_checkpoint(root / "target", vocab_size=V, seed=31, merges=MERGES)
    draft = tiny.make_checkpoint(root / "draft", vocab_size=V, seed=32, merges=MERGES, noise_from=target,
                                 noise_std=0.08)
    return load_model(str(target)), load_model(str(draft)), tiny.hf_model(target)


@pytest.fixture(scope="module")
def llg_tokenizer(models):
    return llguidance.hf.from_tokenizer(models[0].tokenizer, n_vocab=V, eos_token=tiny.EOS_ID)


def fresh(llg_tokenizer, grammar: Grammar, tokens: list[int]):
    """An independent matcher after `tokens`."""
    m = llguidance.LLMatcher(llg_tokenizer, grammar.engine_form(), log_level=0)
    assert m.consume_tokens(tokens), m.get_error()
    return m


def allowed(matcher) -> torch.Tensor:
    """[V] bool from llguidance's byte-per-token mask."""
    return torch.tensor(list(matcher.compute_logit_bias()[:V])) > 0


def reference_greedy(hf, llg_tokenizer, grammar: Grammar, prompt: list[int], max_new: int) -> list[int]:
    """Plain constrained greedy decoding, computed without our engine: the whole sequence through
    transformers every token, refused tokens at -inf, argmax."""
    m = llguidance.LLMatcher(llg_tokenizer, grammar.engine_form(), log_level=0)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            token = int(logits.masked_fill(~allowed(m), float("-inf")).argmax())
            out.append(token)
            assert m.consume_token(token)
            if token == tiny.EOS_ID:
                break
    return out


def prompt_ids(models, text="abcd xy abcd 12 abcd") -> list[int]:
    return models[0].tokenizer.encode(text)


def constraint_for(models, grammar: Grammar, committed: list[int]):
    target = models[0]
    grammars = Constraints(target.tokenizer, V, (tiny.EOS_ID,))
    seq = Sequence("r", SamplingParams(grammar=Grammar(grammar.kind, grammar.source, start=2)), None,
                   tokens=[5, 6] + committed)
    return grammars.of(seq), seq, grammars


def test_tree_rows_equal_a_fresh_matcher_along_each_path(models, llg_tokenizer):
    g = GRAMMARS[0]
    tok = models[0].tokenizer
    ab, cd, x, nine = (tok.convert_tokens_to_ids(t) for t in ("ab", "cd", "x", "9"))
    # root -> ab -> cd -> 9 ; root -> x ; root -> 9 (refused: a digit first) -> ab (below a refused node)
    tree = DraftTree([ab, cd, nine, x, nine, ab], [-1, 0, 1, -1, -1, 4], [[t] for t in (ab, cd, nine, x, nine, ab)],
                     [[1.0]] * 6)
    c, _, _ = constraint_for(models, g, [])
    masks, ok = c.rows(tree)
    assert ok == [True, True, True, True, False, False]
    paths = {0: [], 1: [ab], 2: [ab, cd], 3: [ab, cd, nine], 4: [x]}  # row -> the path to it
    for row, path in paths.items():
        want = allowed(fresh(llg_tokenizer, g, path))
        got = apply_masks(torch.zeros(1, V), masks[row:row + 1])[0] == 0
        assert torch.equal(got, want), f"row {row}"
    assert bool((masks[5:] == -1).all()), "rows below a refused node stay unmasked"


def test_follow_rolls_back_to_changed_committed_tokens(models, llg_tokenizer):
    g = GRAMMARS[0]
    tok = models[0].tokenizer
    ab, cd, x = (tok.convert_tokens_to_ids(t) for t in ("ab", "cd", "x"))
    c, seq, grammars = constraint_for(models, g, [ab, cd, cd])
    seq.tokens[3:] = [x, ab]  # a resync: the committed tokens after the first output token changed
    assert grammars.of(seq) is c
    assert c.consumed == [ab, x, ab]
    masks, _ = c.rows(DraftTree())
    want = allowed(fresh(llg_tokenizer, g, [ab, x, ab]))
    assert torch.equal(apply_masks(torch.zeros(1, V), masks)[0] == 0, want)


def test_pruning_drops_only_what_is_exact_to_drop(models):
    g = GRAMMARS[0]
    tok = models[0].tokenizer
    ab, cd, nine, x = (tok.convert_tokens_to_ids(t) for t in ("ab", "cd", "9", "x"))
    # 9 first is refused; its q is a point mass on it, so dropping it is exact at any temperature.
    tree = DraftTree([nine, ab, cd], [-1, -1, 1], [[nine], [ab], [cd]], [[1.0], [1.0], [1.0]])
    c, _, _ = constraint_for(models, g, [])
    for greedy in (True, False):
        pruned = c.prune(tree, greedy)
        assert pruned.tokens == [ab, cd] and pruned.parents == [-1, 0]
    mixed = DraftTree([nine, ab], [-1, 0], [[nine, x], [ab]], [[0.5, 0.5], [1.0]])  # q has mass on x
    assert c.prune(mixed, greedy=True).tokens == []
    kept = c.prune(mixed, greedy=False)  # 9 stays (its rejection shapes the residual); its child goes
    assert kept.tokens == [nine] and kept.parents == [-1]


@pytest.mark.parametrize("grammar", GRAMMARS, ids=[g.kind for g in GRAMMARS])
@pytest.mark.parametrize("kind,k,tree_size", [("none", 0, None), ("ngram", 4, 8), ("model", 3, None),
                                              ("model", 3, 8), ("head", 3, 8)])
def test_greedy_constrained_output_equals_plain_constrained_decoding(models, llg_tokenizer, grammar, kind, k,
                                                                      tree_size):
    target, draft, hf = models
    proposer = {"none": lambda: None, "ngram": NgramProposer, "model": lambda: ModelProposer(draft.model, V),
                "head": lambda: tiny.head_proposer(target, tiny.make_head(target))}[kind]()
    engine = Engine(target, proposer, StepConfig(draft_length=k, tree_size=tree_size), warm_up=False)
    prompts = [prompt_ids(models), prompt_ids(models, '{"ab": 1, "cd": true} ab,cd,7 abd')]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=24, grammar=grammar, logprobs=2))
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == reference_greedy(hf, llg_tokenizer, grammar, prompt, 24)
    if kind == "model":  # it drafts from its masked distribution: the target accepts some
        assert sum(r.stats.accepted for r in reqs) > 0
    assert not engine.held_requests()


def test_forced_tokens_continue_the_first_path(models, llg_tokenizer):
    """Each forced token is the only one an independent matcher allows; the chain stops where
    the grammar offers a choice, at the depth, or after the end token of a complete grammar."""
    tok = models[0].tokenizer
    c, _, _ = constraint_for(models, GRAMMARS[1], [])
    chain = c.extend_forced(DraftTree(), 8)
    assert chain.parents == list(range(-1, len(chain) - 1)) and chain.q_probs == [[1.0]] * len(chain)
    assert tok.decode(chain.tokens) == '{"ab": '
    for i in range(len(chain) + 1):
        assert int(allowed(fresh(llg_tokenizer, GRAMMARS[1], chain.tokens[:i])).sum()) == (1 if i < len(chain) else 11)
    one = tok.encode('{"ab": 1')  # a drafted path: the grammar forces what follows it
    tree = DraftTree(one, list(range(-1, len(one) - 1)), [[t] for t in one], [[1.0]] * len(one))
    longer = c.extend_forced(tree, len(one) + 8)
    assert longer.tokens[:len(one)] == one and len(tree) == len(one)  # the proposer's tree is left as it was
    assert tok.decode(longer.tokens[len(one):]) == ""  # a digit may follow: nothing forced yet
    done = tok.encode('{"ab": 1, "cd": true}')
    tree = DraftTree(done, list(range(-1, len(done) - 1)), [[t] for t in done], [[1.0]] * len(done))
    assert c.extend_forced(tree, len(done) + 3).tokens[len(done):] == [tiny.EOS_ID]
    assert len(c.extend_forced(DraftTree(), 2)) == 2
    assert c.consumed == [] and int(allowed(fresh(llg_tokenizer, GRAMMARS[1], [])).sum()) == 1  # rolled back


def test_forced_stretches_cost_no_step_of_their_own(models):
    target, _, _ = models
    grammar = Grammar("regex", "abcdabcdxyzxyz[0-9]")
    prompt = prompt_ids(models, "hello there")  # nothing for the n-gram to match
    params = SamplingParams(max_tokens=24, grammar=grammar)
    plain = Engine(target, None, StepConfig(draft_length=0), warm_up=False).generate([prompt], params)[0]
    spec = Engine(target, NgramProposer(), StepConfig(draft_length=4), warm_up=False).generate([prompt], params)[0]
    assert spec.output_ids == plain.output_ids and plain.stats.steps == len(plain.output_ids)
    assert spec.stats.steps <= len(spec.output_ids) // 3, (spec.stats.steps, len(spec.output_ids))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_past_the_grammar_s_end_only_end_tokens_follow(models, temperature):
    """ignore_eos: once the grammar has ended, every draft and the verifier agree on end tokens."""
    target, draft, _ = models
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=4, grammar=GRAMMARS[2])
    outs = []
    for proposer, k, tree_size in ((None, 0, None), (NgramProposer(), 4, 8), (ModelProposer(draft.model, V), 3, 6)):
        engine = Engine(target, proposer, StepConfig(draft_length=k, tree_size=tree_size), warm_up=False)
        out = engine.generate([prompt_ids(models)], params)[0].output_ids
        end = out.index(tiny.EOS_ID)
        assert 0 < end < 11 and out[end:] == [tiny.EOS_ID] * (12 - end)
        outs.append(out)
    if temperature == 0:
        assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_draft_proposes_only_what_the_grammar_allows(models, temperature):
    target, draft, _ = models
    grammars = Constraints(target.tokenizer, V, (tiny.EOS_ID,))
    work = ProposeWork(ModelProposer(draft.model, V), grammars)
    prompt = prompt_ids(models)
    params = SamplingParams(temperature=temperature, seed=1, grammar=Grammar("json_schema", GRAMMARS[1].source,
                                                                             start=len(prompt)))
    seq = Sequence("r", params, make_generator(1, 0) if temperature else None, tokens=list(prompt))
    tree = work.run([(seq, WorkItem("r", 0, prompt, draft_length=4, tree_size=12))])[0]
    assert max(tree.depths()) == 4  # forced stretches give one child: only allowed tokens have q > 0
    _, ok = seq.constraint.rows(tree)
    assert all(ok)
    for ids, parent in zip(tree.q_ids, tree.parents):  # q itself lies inside the grammar
        masks = seq.constraint.path_masks(tree, [parent])
        assert all(allowed_tokens(masks, V)[0, ids])


def test_constrained_logprobs_are_the_same_with_and_without_a_draft(models):
    target, draft, _ = models
    params = SamplingParams(max_tokens=16, grammar=GRAMMARS[1], logprobs=3)
    runs = [Engine(target, p, StepConfig(draft_length=k, tree_size=t), warm_up=False).generate(
        [prompt_ids(models)], params)[0] for p, k, t in ((None, 0, None), (ModelProposer(draft.model, V), 3, 8))]
    plain, spec = (r.logprobs for r in runs)
    assert [t.token_id for t in plain] == [t.token_id for t in spec]
    for a, b in zip(plain, spec):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert all(np.isfinite(v) for _, v in a.top), "a refused token listed as an alternative"


SAMPLES = 6000
CHI_GRAMMAR = Grammar("regex", "[abcx]{1,3}")


def exact_outcomes(hf, llg_tokenizer, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(output) over every constrained output of at most 3 tokens (ended by EOS or the limit)."""
    out: dict[tuple, float] = {}
    with torch.no_grad():
        def walk(prefix: list[int], prob: float) -> None:
            if len(prefix) == params.max_tokens or (prefix and prefix[-1] == tiny.EOS_ID):
                out[tuple(prefix)] = prob
                return
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1:]
            logits = logits.masked_fill(~allowed(fresh(llg_tokenizer, CHI_GRAMMAR, prefix)), float("-inf"))
            p = warp_probs(logits, params.temperature, params.top_k, params.top_p)[0].double()
            for t in torch.nonzero(p).flatten().tolist():
                walk(prefix + [t], prob * float(p[t]))
        walk([], 1.0)
    return out


@pytest.mark.parametrize("kind,k,tree_size", [("model", 2, 5), ("ngram", 3, 6)])
def test_constrained_sampling_matches_the_exact_masked_distribution(models, llg_tokenizer, kind, k, tree_size):
    target, draft, hf = models
    prompt = prompt_ids(models, "abcabxab")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.95, grammar=CHI_GRAMMAR)
    exact = exact_outcomes(hf, llg_tokenizer, prompt, params)
    proposer = ModelProposer(draft.model, V) if kind == "model" else NgramProposer(max_ngram=2)
    engine = Engine(target, proposer, StepConfig(draft_length=k, tree_size=tree_size, max_batch=1000), warm_up=False)
    reqs = [engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": s})) for s in range(SAMPLES)]
    while engine.has_work():
        engine.step()
    counts: dict[tuple, int] = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert set(counts) <= set(exact), f"outputs outside the grammar's support: {set(counts) - set(exact)}"
    keys = list(exact)
    assert_matches(np.array([counts.get(o, 0) for o in keys], dtype=float), np.array([exact[o] for o in keys]))
    assert sum(r.stats.accepted for r in reqs) > 0, "no draft token was ever accepted"


def test_bad_grammars_are_refused_with_the_engine_s_reason(models):
    cases = [(Grammar("yaml", "x"), "grammar kind"), (Grammar("json_schema", "{"), "not valid JSON"),
             (Grammar("json_schema", '{"type": "objekt"}'), "objekt"), (Grammar("regex", "(ab"), "unclosed group"),
             (Grammar("choice", "[]"), "non-empty list"), (Grammar("lark", "start: nothing"), "nothing")]
    grammars = Constraints(models[0].tokenizer, V, (tiny.EOS_ID,))
    for grammar, words in cases:
        with pytest.raises(ValueError, match=words):
            grammars.check(grammar)
    engine = Engine(models[0], None, StepConfig(draft_length=0), warm_up=False)
    with pytest.raises(ValueError, match="unclosed group"):
        engine.add_request([5, 6], SamplingParams(grammar=Grammar("regex", "(ab")))
    assert not engine.has_work()


def test_a_word_level_tokenizer_is_refused_for_grammars(tiny_target):
    target = load_model(str(tiny_target))  # its words have no bytes the engine could spell text with
    engine = Engine(target, None, StepConfig(draft_length=0), warm_up=False)
    with pytest.raises(ValueError, match="tokenizer the grammar engine can read"):
        engine.add_request([5, 6], SamplingParams(grammar=Grammar("regex", "w5")))


def test_the_default_model_answers_in_json_that_follows_the_schema(default_native):
    """The real default model, as served: a JSON schema answer that parses and follows the schema,
    the same with an n-gram draft as without one (or diverging only at a tie of the masked target)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    tok = default_native.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Give the largest city of France and its "
                                       "population as JSON."}], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=40, grammar=Grammar("json_schema", json.dumps(schema)), logprobs=2)
    plain, spec = (Engine(default_native, p, StepConfig(draft_length=k), warm_up=False).generate([ids], params)[0]
                   for p, k in ((None, 0), (NgramProposer(), 4)))
    value = json.loads(tok.decode(plain.output_ids, skip_special_tokens=True))
    assert set(value) == {"city", "population"} and isinstance(value["city"], str) and len(value["city"]) <= 20
    assert type(value["population"]) is int and value["population"] >= 0
    diverged = next((i for i, (a, b) in enumerate(zip(plain.output_ids, spec.output_ids)) if a != b), None)
    if diverged is None:
        assert plain.output_ids == spec.output_ids
    else:
        (_, first), (_, second) = plain.logprobs[diverged].top  # the masked target's two most likely
        assert first - second < 1e-3, f"diverged at output token {diverged} with a gap of {first - second}"
