"""Logprobs: each output token's log-probability under the request's sampling distribution, from
the verify forward that committed it. They are the target's own (checked against HF's forward
over the whole output), and speculation returns exactly what plain decoding returns."""

import pytest
import torch

from services.common.loading import load_model
from services.common.sampling import SamplingParams, warp_probs
from services.draft.model_proposer import ModelProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny

PROMPT = [5, 9, 14, 5, 9, 22, 31]
GREEDY = dict(max_tokens=14, logprobs=5)
SAMPLED = dict(max_tokens=14, temperature=0.8, top_k=20, top_p=0.9, seed=11, logprobs=5)
DRAFTS = {"plain": (0, None), "chain": (3, 3), "tree": (3, 6)}


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(str(tiny_target)), load_model(str(tiny_draft)), tiny.hf_model(tiny_target)


def run(models, draft: str, **params):
    target, draft_model, _ = models
    k, tree = DRAFTS[draft]
    proposer = ModelProposer(draft_model.model, target.config.vocab_size) if k else None
    engine = Engine(target, proposer, StepConfig(draft_length=k, tree_size=tree), warm_up=False)
    return engine.generate([PROMPT], SamplingParams(**params))[0]


def reference(hf, output: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(output), vocab]: HF's log-probabilities of each output position, warped as sampled."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1].float()
    if params.greedy:
        return torch.log_softmax(logits, -1)
    return warp_probs(logits, params.temperature, params.top_k, params.top_p).log()


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_token_s_logprob_is_the_target_s_under_the_request_s_distribution(models, draft, sampling):
    req = run(models, draft, **sampling)
    params = SamplingParams(**sampling)
    ref = reference(models[2], req.output_ids, params)
    assert [t.token_id for t in req.logprobs] == req.output_ids and len(req.output_ids) == 14
    for j, (tok, lp) in enumerate(zip(req.output_ids, req.logprobs)):
        assert lp.logprob == pytest.approx(float(ref[j, tok]), abs=1e-4)
        finite = int(torch.isfinite(ref[j]).sum())
        want = ref[j].topk(min(5, finite))
        assert [i for i, _ in lp.top] == want.indices.tolist()  # most likely first, masked ones left out
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("draft", ["chain", "tree"])
def test_speculation_returns_plain_decoding_s_tokens_and_logprobs(models, draft):
    plain, spec = run(models, "plain", **GREEDY), run(models, draft, **GREEDY)
    assert spec.stats.accepted > 0  # the draft did get tokens accepted
    assert spec.output_ids == plain.output_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


def test_no_logprobs_unless_asked_and_none_past_a_stop(models):
    assert run(models, "chain", max_tokens=8).logprobs == []
    req = run(models, "chain", max_tokens=14, logprobs=0)
    assert all(t.top == [] for t in req.logprobs) and len(req.logprobs) == 14
    cut = run(models, "chain", max_tokens=5, logprobs=2)  # the step's last verdict overshoots max_tokens
    assert [t.token_id for t in cut.logprobs] == cut.output_ids and len(cut.output_ids) == 5


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad).validate()
