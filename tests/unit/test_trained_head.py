"""The committed feature head (models/head): under 40 MB, checked against the default target's
vocabulary, keeps the output exactly the target's, and agrees with the target far more often
than the same head untrained."""

from pathlib import Path

import pytest

from services.common.loading import load_weights
from services.common.sampling import SamplingParams
from services.draft.factory import build_proposer
from services.draft.feature_head import FeatureHead, init_from_target
from services.draft.head_proposer import HeadProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine

HEAD_DIR = Path(__file__).resolve().parents[2] / "models" / "head"
PROMPTS = ["Explain how a refrigerator keeps food cold, in a short paragraph.",
           "Write a short poem about the ocean at night.",
           "What were the main causes of the French Revolution?",
           "Write a Python function that checks whether a word is a palindrome."]
MAX_NEW = 48
# The first committed head's first draft token was accepted 0.20 of the time on these prompts (greedy,
# k = 1; 2026-12-02); the same head untrained accepts none.
ACCEPTANCE_FLOOR = 0.08


def run(target, proposer, prompt_ids) -> float:
    """The first draft token's acceptance rate (k = 1) over the prompts, after checking the
    output is the target's greedy decoding."""
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    plain = Engine(target, None, StepConfig(draft_length=0), warm_up=False).generate(prompt_ids, params)
    reqs = Engine(target, proposer, StepConfig(draft_length=1), warm_up=False).generate(prompt_ids, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    return sum(r.stats.accepted for r in reqs) / sum(r.stats.drafted for r in reqs)


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    from services.common.prompt import encode_prompt

    return [encode_prompt(default_model.tokenizer, p, chat=True) for p in PROMPTS]


def test_committed_head_is_small_lossless_and_trained(default_model, prompt_ids):
    assert sum(f.stat().st_size for f in HEAD_DIR.iterdir()) < 40e6
    proposer = build_proposer(str(HEAD_DIR), default_model)  # checks the vocabulary digest
    assert isinstance(proposer, HeadProposer) and proposer.feature_layers == (2, 15, 27)
    rate = run(default_model, proposer, prompt_ids)
    untrained = FeatureHead(proposer.head.config)
    init_from_target(untrained, load_weights(default_model.path), default_model.config.num_layers,
                     proposer.head.d2t)
    baseline = run(default_model, HeadProposer(untrained, proposer.embed, proposer.vocab_size), prompt_ids)
    assert rate > ACCEPTANCE_FLOOR > baseline
