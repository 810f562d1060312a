"""n samples of one prompt (the OpenAI `n`): the later samples follow the first, start once it
has its first token, and their workers copy the prompt's KV from it instead of computing it again
(Sequence.share_prefix); each sample's tokens are what a request of its own with that seed gives."""

import pytest

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft.model_proposer import ModelProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine

PROMPT = [5, 9, 14, 5, 9, 22, 31, 40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft))


def engine(models) -> Engine:
    target, draft = models
    return Engine(target, ModelProposer(draft.model, target.config.vocab_size),
                  StepConfig(draft_length=3, tree_size=5), warm_up=False)


def record_rows(model, log: list) -> None:
    """Log the rows each forward feeds per sequence (pending tokens + tree nodes)."""
    for name in ("forward", "forward_states"):
        inner = getattr(model, name)

        def wrapped(chunks, *args, _inner=inner, **kwargs):
            log.append([len(c.tokens) for c in chunks])
            return _inner(chunks, *args, **kwargs)

        setattr(model, name, wrapped)


def run_samples(eng: Engine, params: dict, n: int = 3):
    samples = [eng.core.submit(f"r#{i}", PROMPT, SamplingParams(seed=7 + i, **params), follows="r#0" if i else None)
               for i in range(n)]
    while eng.has_work():
        eng.step()
    return samples


def test_later_samples_copy_the_prompt_s_kv(models):
    eng = engine(models)
    rows, draft_rows = [], []
    record_rows(eng.verifier.model, rows)
    record_rows(eng.proposer.model, draft_rows)
    samples = [eng.core.submit(f"r#{i}", PROMPT, SamplingParams(max_tokens=10), follows="r#0" if i else None)
               for i in range(3)]
    eng.step()
    assert [len(s.output_ids) > 0 for s in samples] == [True, False, False]  # the others wait one step
    assert len(rows) == 1 and rows[0][0] >= len(PROMPT)  # the first sample's prompt (and its tree)
    mark = len(draft_rows)
    eng.step()  # the followers join: of their prompt, only the last token is fed (for the root's logits)
    assert len(rows[1]) == 3 and all(n <= 1 + 5 for n in rows[1][1:]), rows[1]  # <= 1 + a tree of 5
    assert all(s.output_ids for s in samples)  # whole, in one step: a copied prompt costs one row
    eng.step()  # the draft takes them a step behind the verifier (they joined while another decoded)
    first = next(r for r in draft_rows[mark:] if len(r) == 3)
    assert first[1:] == [1, 1], draft_rows[mark:]  # their first output token; the prompt was copied
    while eng.has_work():
        eng.step()
    assert eng.held_requests() == []


def test_greedy_samples_are_the_target_s_greedy_output(models):
    alone = engine(models).generate([PROMPT], SamplingParams(max_tokens=12))[0].output_ids
    assert [s.output_ids for s in run_samples(engine(models), dict(max_tokens=12))] == [alone] * 3


def test_sampled_samples_are_reproducible_by_seed(models):
    """A seed's tokens depend on how the steps ran (speculation draws its own random numbers);
    the same n-sample request gives the same samples again, each its own."""
    params = dict(max_tokens=12, temperature=0.9, top_p=0.9)
    first = [s.output_ids for s in run_samples(engine(models), params)]
    again = [s.output_ids for s in run_samples(engine(models), params)]
    assert first == again and len({tuple(t) for t in first}) == 3


def test_a_copied_prompt_joins_whole_within_a_row_budget(models):
    """Chunked prefill prices a follower's prompt at one row (the rest is copied): with 4 rows a
    step the first sample's 12-token prompt takes 3 steps, the followers' then one."""
    target, _ = models
    eng = Engine(target, None, StepConfig(draft_length=0, max_batch=4, max_step_tokens=4), warm_up=False)
    rows = []
    record_rows(eng.verifier.model, rows)
    samples = [eng.core.submit(f"r#{i}", PROMPT, SamplingParams(max_tokens=6), follows="r#0" if i else None)
               for i in range(3)]
    steps = 0
    while not samples[0].output_ids:
        eng.step()
        steps += 1
    assert steps == 3
    eng.step()
    assert all(s.output_ids for s in samples) and rows[-1] == [1, 1, 1]  # the leader's token, the followers' last
    while eng.has_work():
        eng.step()
    assert max(sum(r) for r in rows) <= 4
