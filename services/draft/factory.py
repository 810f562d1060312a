"""Build the proposer named on the command line or in the configuration."""

from __future__ import annotations

import logging
from pathlib import Path

from services.common.loading import LoadedModel, load_model, load_tensor
from services.common.vocab import check_same_vocabulary, check_vocabulary_digest
from services.draft.feature_head import FeatureHead, is_head_checkpoint
from services.draft.head_proposer import HeadProposer
from services.draft.hybrid import HybridProposer
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import Proposer
from services.draft.slim import build_slim_head, validate_ratio
from services.draft.slim_guard import GuardConfig, SlimGuard

log = logging.getLogger(__name__)

DRAFT_CHOICES = ("default (the committed draft for the default target) | none | ngram | self | "
                 "PATH (a draft checkpoint sharing the target's tokenizer, or a feature head's directory) | "
                 "PATH+ngram (a feature head and the n-gram lookup)")
# The distilled draft for SmolLM2-135M-Instruct, committed with the code (scripts/train_draft.py).
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parents[2] / "models" / "draft"
DEFAULT_COMPRESSION_RATIO = 0.2
HYBRID_SUFFIX = "+ngram"  # PATH+ngram: a feature head and the n-gram lookup (services/draft/hybrid.py)
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
                   weight_format: str = "native", compression_ratio: float = 1.0, guard_points: float | None = DEFAULT_GUARD_POINTS) -> Proposer | None:
    """compression_ratio: SlimSpec's kept fraction of the vocabulary for a model draft (1.0 = the
    full head); guard_points: the quality guard's allowed acceptance drop (None = no guard)."""
    compression_ratio = validate_ratio(compression_ratio)
    draft = resolve_draft_spec(draft, target)
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramProposer()
    if is_head_checkpoint(draft):
        return build_head_proposer(draft, target)
    if draft.endswith(HYBRID_SUFFIX) and is_head_checkpoint(draft[: -len(HYBRID_SUFFIX)]):
        return HybridProposer(build_head_proposer(draft[: -len(HYBRID_SUFFIX)], target))
    if draft == "self":  # the target drafts for itself: every draft token is accepted
        if target.model is None:
            target = load_model(target.name, device=device, dtype=dtype, weight_format=weight_format)
        loaded = target
    else:
        loaded = load_model(draft, device=device, dtype=dtype, weight_format=weight_format)
        check_same_vocabulary(target.tokenizer, loaded.tokenizer, target.name, loaded.name)
    slim = build_slim_head(loaded, target, compression_ratio)
    guard = SlimGuard(GuardConfig(points=float(guard_points))) if slim is not None and guard_points is not None else None
    if slim is not None:
        log.info("SlimSpec: draft head keeps %d of %d ids (ratio %.2f), guard %s", slim.kept.numel(),
                 target.config.vocab_size, compression_ratio,
                 "off" if guard is None else f"{guard.config.points} points")
    return ModelProposer(loaded.model, target.config.vocab_size, slim=slim, guard=guard)


def build_head_proposer(path: str, target: LoadedModel) -> HeadProposer:
    """A feature head's directory: checked against the target, run on the target's embedding."""
    head = FeatureHead.load(Path(path))
    c, t = head.config, target.config
    if (c.hidden_size, c.target_vocab) != (t.hidden_size, t.vocab_size) or max(c.target_layers) >= t.num_layers:
        raise ValueError(f"feature head {path!r} was built for another target (hidden {c.hidden_size}, vocab "
                         f"{c.target_vocab}, layers {list(c.target_layers)}) than {target.name!r}")
    check_vocabulary_digest(target.tokenizer, c.vocabulary_digest, target.name, path)
    embed = load_tensor(Path(target.path), "model.embed_tokens.weight")
    log.info("feature head %s: layers %s of the target, %d draft ids", path, list(c.target_layers), c.draft_vocab)
    return HeadProposer(head, embed, t.vocab_size)
