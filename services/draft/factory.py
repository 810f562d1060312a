"""Build the proposer named on the command line or in the configuration."""

from __future__ import annotations

import logging
from pathlib import Path

from services.common.loading import LoadedModel, load_model
from services.common.vocab import check_same_vocabulary
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import Proposer
from services.draft.slim import build_slim_head, validate_ratio
from services.draft.slim_guard import GuardConfig, SlimGuard

log = logging.getLogger(__name__)

DRAFT_CHOICES = ("default (the committed draft for the default target) | none | ngram | self | "
                 "PATH (a draft checkpoint sharing the target's tokenizer)")
# The distilled draft for SmolLM2-135M-Instruct, committed with the code (scripts/train_draft.py).
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parents[2] / "models" / "draft"
DEFAULT_COMPRESSION_RATIO = 0.2
DEFAULT_GUARD_POINTS = 5.0


def _is_default_target(target: LoadedModel) -> bool:
    if target.name == "default":
        return True
    try:
        from services.common.loading import resolve_checkpoint

        return Path(target.path).resolve() == resolve_checkpoint("default").resolve()
    except (FileNotFoundError, OSError):
        return False


def resolve_draft_spec(draft: str, target: LoadedModel) -> str:
    """`default` -> the committed draft's directory for the default target, `ngram` for any other
    target (the committed draft only shares SmolLM2's tokenizer); anything else unchanged."""
    if draft != "default":
        return draft
    if not _is_default_target(target):
        log.warning("--draft default: the committed draft belongs to the default target, not %r; "
                    "using the n-gram proposer", target.name)
        return "ngram"
    if not any(DEFAULT_DRAFT_DIR.glob("*.gguf")):
        raise FileNotFoundError(f"the default draft is missing from {DEFAULT_DRAFT_DIR}: run `make draft` "
                                "or pass --draft ngram")
    return str(DEFAULT_DRAFT_DIR)


def build_proposer(draft: str, target: LoadedModel, device: str = "cpu", dtype: str | None = None,
                   compression_ratio: float = 1.0, guard_points: float | None = DEFAULT_GUARD_POINTS) -> Proposer | None:
    """compression_ratio: SlimSpec's kept fraction of the vocabulary for a model draft (1.0 = the
    full head); guard_points: the quality guard's allowed acceptance drop (None = no guard)."""
    compression_ratio = validate_ratio(compression_ratio)
    draft = resolve_draft_spec(draft, target)
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramProposer()
    if draft == "self":  # the target drafts for itself: every draft token is accepted
        if target.model is None:
            target = load_model(target.name, device=device, dtype=dtype)
        loaded = target
    else:
        loaded = load_model(draft, device=device, dtype=dtype)
        check_same_vocabulary(target.tokenizer, loaded.tokenizer, target.name, loaded.name)
    slim = build_slim_head(loaded, target, compression_ratio)
    guard = SlimGuard(GuardConfig(points=float(guard_points))) if slim is not None and guard_points is not None else None
    if slim is not None:
        log.info("SlimSpec: draft head keeps %d of %d ids (ratio %.2f), guard %s", slim.kept.numel(),
                 target.config.vocab_size, compression_ratio,
                 "off" if guard is None else f"{guard.config.points} points")
    return ModelProposer(loaded.model, target.config.vocab_size, slim=slim, guard=guard)
