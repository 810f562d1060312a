"""Build the proposer named on the command line or in the configuration."""

from __future__ import annotations

from services.common.loading import LoadedModel, load_model
from services.common.vocab import check_same_vocabulary
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import Proposer

DRAFT_CHOICES = "none | ngram | self | PATH (a draft checkpoint sharing the target's tokenizer)"


def build_proposer(draft: str, target: LoadedModel, device: str = "cpu",
                   dtype: str | None = None) -> Proposer | None:
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramProposer()
    if draft == "self":  # the target drafts for itself: every draft token is accepted
        return ModelProposer(target.model, target.config.vocab_size)
    loaded = load_model(draft, device=device, dtype=dtype)
    check_same_vocabulary(target.tokenizer, loaded.tokenizer, target.name, loaded.name)
    return ModelProposer(loaded.model, target.config.vocab_size)
