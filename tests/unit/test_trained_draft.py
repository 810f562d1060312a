"""The committed default draft (models/draft): an ordinary checkpoint under 40 MB that shares the
default target's vocabulary, keeps the output exactly the target's, and agrees with the target far
more often than a random draft of the same shape."""

import os

import pytest
import torch

from services.common.llama import LlamaModel
from services.common.loading import load_model, load_weights
from services.common.sampling import SamplingParams
from services.common.vocab import check_same_vocabulary
from services.draft.factory import DEFAULT_DRAFT_DIR, build_proposer
from services.draft.model_proposer import ModelProposer
from services.draft.slim import COUNTS_NAME
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine

PROMPT = "Explain how a refrigerator keeps food cold, in a short paragraph."
MAX_NEW = 48
# The committed draft accepts 7 of 164 drafted tokens (0.043) on this prompt (greedy, k = 4); a
# random draft of the same shape accepts none.
ACCEPTANCE_FLOOR = 0.02


@pytest.fixture(scope="module")
def draft(default_model):
    old = os.environ.pop("SPECSERVE_HOME")  # the user's cache, like default_model
    try:
        return load_model(str(DEFAULT_DRAFT_DIR))
    finally:
        os.environ["SPECSERVE_HOME"] = old


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    ids = default_model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                      add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def plain(default_model, prompt_ids):
    return Engine(default_model, None, StepConfig(draft_length=0)).generate(
        [prompt_ids], SamplingParams(max_tokens=MAX_NEW))[0].output_ids


def test_the_committed_draft_is_small_and_documented():
    files = list(DEFAULT_DRAFT_DIR.glob("*.gguf"))
    assert len(files) == 1
    total = sum(p.stat().st_size for p in DEFAULT_DRAFT_DIR.iterdir() if p.is_file())
    assert total <= 40_000_000, f"models/draft holds {total / 1e6:.1f} MB, over 40 MB"
    assert (DEFAULT_DRAFT_DIR / "card.md").is_file() and (DEFAULT_DRAFT_DIR / COUNTS_NAME).is_file()


def test_it_loads_and_shares_the_targets_vocabulary(default_model, draft):
    check_same_vocabulary(default_model.tokenizer, draft.tokenizer, "default", str(DEFAULT_DRAFT_DIR))
    c = draft.config
    assert (c.vocab_size, c.hidden_size, c.tie_word_embeddings) == (49152, 576, True)
    assert c.num_layers < default_model.config.num_layers


def _acceptance(target, model, prompt_ids, plain):
    engine = Engine(target, ModelProposer(model, target.config.vocab_size), StepConfig(draft_length=4))
    req = engine.generate([prompt_ids], SamplingParams(max_tokens=MAX_NEW))[0]
    assert req.output_ids == plain  # lossless whatever the draft
    return req.stats.accepted / req.stats.drafted


def test_acceptance_is_above_a_floor_a_random_draft_cannot_reach(default_model, draft, prompt_ids, plain):
    trained = _acceptance(default_model, draft.model, prompt_ids, plain)
    torch.manual_seed(0)
    weights = {k: torch.randn_like(v) * float(v.float().std()) for k, v in load_weights(draft.path).items()}
    random_draft = LlamaModel(draft.config, weights, torch.device("cpu"), torch.float32)
    random = _acceptance(default_model, random_draft, prompt_ids, plain)
    assert trained > ACCEPTANCE_FLOOR > random, (trained, random)


def test_default_draft_with_slimspec_keeps_the_output(default_model, prompt_ids, plain):
    old = os.environ.pop("SPECSERVE_HOME")
    try:
        proposer = build_proposer("default", default_model, compression_ratio=0.2, guard_points=None)
    finally:
        os.environ["SPECSERVE_HOME"] = old
    assert proposer.slim.kept.numel() == round(0.2 * 49152)
    engine = Engine(default_model, proposer, StepConfig(draft_length=4))
    req = engine.generate([prompt_ids], SamplingParams(max_tokens=MAX_NEW))[0]
    assert req.output_ids == plain
    assert req.stats.accepted > 0
