"""SlimSpec: a reduced-vocabulary LM head for the draft.

The draft scores only the `compression_ratio` fraction of the vocabulary the target uses most
(counted on text the target generated), so its head matmul shrinks by that factor. Proposals put
q = 0 outside the kept ids; the verifier's rejection sampling only needs q to be exact, so the
output stays exactly the target's (greedy identity and sampling distribution unchanged).

Works with any draft model: the frequency table is read, in order, from the draft's own
directory (`slimspec-token-counts.npy`, shipped with the default draft), from the cache under
`$SPECSERVE_HOME/slimspec/` keyed by the sha256 of the draft's and target's weight manifests, or
counted once by letting the target answer the calibration prompts, then cached there.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.llama import LlamaModel

log = logging.getLogger(__name__)

COUNTS_NAME = "slimspec-token-counts.npy"
CALIBRATION_PROMPTS = 32
CALIBRATION_TOKENS = 128


def validate_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"compression_ratio must be in (0, 1] (1.0 = full head), got {ratio!r}")
    return ratio


def kept_ids(counts: np.ndarray, ratio: float, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ids the slim head keeps: `always` (e.g. EOS), then the most frequent ids (ties: lower
    id) up to round(ratio * vocab_size) in all. Returns [kept] int64."""
    n = max(1, min(vocab_size, round(validate_ratio(ratio) * vocab_size)))
    counts = np.asarray(counts, dtype=np.int64)[:vocab_size]
    if counts.shape[0] < vocab_size:
        counts = np.pad(counts, (0, vocab_size - counts.shape[0]))
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    keep = [i for i in dict.fromkeys(always) if 0 <= i < vocab_size]
    seen = set(keep)
    for i in order.tolist():
        if len(keep) >= n:
            break
        if i not in seen:
            keep.append(i)
            seen.add(i)
    return torch.tensor(keep, dtype=torch.long)


@dataclass
class SlimHead:
    """The draft with its head cut to `kept`: `model` shares every layer (and so the KV cache
    layout) with the full draft; its logits are [rows, len(kept)], column j = target id kept[j]."""

    kept: torch.Tensor  # [kept] int64 target ids
    model: LlamaModel

    @property
    def ratio(self) -> float:
        return self.kept.numel() / self.model.config.vocab_size

    @classmethod
    def build(cls, model: LlamaModel, kept: torch.Tensor) -> "SlimHead":
        slim = copy.copy(model)  # shallow: layers, RoPE tables and caches stay shared
        # [kept, hidden]: the rows of the (possibly tied) head for the kept ids, contiguous
        slim.lm_head = model.matmul.weight(model.head_rows(kept).contiguous())
        return cls(kept.to(model.device), slim)


def _manifest_digest(ckpt: Path) -> str:
    from services.common.loading import manifest_path
    from services.common.manifest import check_manifest

    path = manifest_path(ckpt)
    check_manifest(ckpt, path)  # written on load already; this only ensures it exists
    return json.dumps(json.loads(path.read_text())["sha256"], sort_keys=True)


def counts_key(draft_path: Path, target_path: Path) -> str:
    """The cache key of a draft's frequency table: sha256 of both weight manifests."""
    h = hashlib.sha256()
    h.update(_manifest_digest(draft_path).encode())
    h.update(_manifest_digest(target_path).encode())
    return h.hexdigest()[:24]


def _shipped_counts(draft_spec: str) -> Path | None:
    path = Path(draft_spec).expanduser()
    folder = path.parent if path.is_file() else path
    candidate = folder / COUNTS_NAME
    return candidate if candidate.is_file() else None


def count_target_tokens(target, prompts: int = CALIBRATION_PROMPTS, max_tokens: int = CALIBRATION_TOKENS) -> np.ndarray:
    """How often the target generates each token id answering the calibration prompts (greedy)."""
    from services.draft.training.prompts import make_prompts
    from services.draft.training.teacher import generate

    model = target.model
    if model is None:  # a draft service loads the target without weights: load them for this once
        from services.common.loading import load_model

        model = load_model(str(target.path)).model
    tok = target.tokenizer
    encoded = []
    for p in make_prompts(prompts, seed=7919):
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(p, add_special_tokens=False)["input_ids"]
        encoded.append(ids[-(model.config.max_positions - max_tokens - 1):])
    samples = generate(model, encoded, [0.0] * len(encoded), target.config.eos_token_ids, max_tokens, top_k=1)
    counts = np.zeros(target.config.vocab_size, dtype=np.int64)
    for s in samples:
        np.add.at(counts, np.asarray(s.ids[s.prompt_len:], dtype=np.int64), 1)
    return counts


def load_counts(draft, target) -> np.ndarray:
    """The token frequency table for this draft (see the module docstring for the lookup order)."""
    shipped = _shipped_counts(draft.name)
    if shipped is not None:
        return np.load(shipped)
    from services.common.loading import specserve_home

    cache = specserve_home() / "slimspec" / f"{counts_key(draft.path, target.path)}.npy"
    if cache.exists():
        return np.load(cache)
    log.info("SlimSpec: counting the target's tokens on %d calibration prompts (once; cached in %s)",
             CALIBRATION_PROMPTS, cache)
    counts = count_target_tokens(target)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.stem + f".tmp{os.getpid()}.npy")
    np.save(tmp, counts)
    tmp.replace(cache)
    return counts


def build_slim_head(draft, target, ratio: float) -> SlimHead | None:
    """SlimSpec for a loaded draft: None at ratio 1.0 (the full head)."""
    if validate_ratio(ratio) >= 1.0:
        return None
    vocab = target.config.vocab_size
    kept = kept_ids(load_counts(draft, target), ratio, vocab, tuple(target.config.eos_token_ids))
    return SlimHead.build(draft.model, kept)
