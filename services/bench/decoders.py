"""The decoders a speculative benchmark times side by side: this engine (plain, or with a draft at
each draft length), the Hugging Face peers on the same weights (`generate`, assisted generation
with the same draft model, prompt lookup) and llama.cpp on the same GGUF file (services/bench/llamacpp.py).

Every decoder turns one prompt into output token ids with the same stopping rule: at most
max_tokens tokens, ending at the first EOS (included). Each names its `baseline`, the plain decoder
of the same engine, against which its speedup is measured.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.loading import (LoadedModel, gguf_file, load_model, resolve_checkpoint, resolve_device,
                                     resolve_dtype)
from services.common.sampling import SamplingParams
from services.draft.factory import HYBRID_SUFFIX, build_proposer
from services.draft.feature_head import is_head_checkpoint
from services.draft.proposer import Proposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH

OURS, HF, LLAMACPP = "specserve", "hf", "llamacpp"
PLAIN, HF_PLAIN, LLAMACPP_PLAIN = "plain", "hf_generate", "llamacpp_plain"
PEERS = (HF, LLAMACPP)  # the peer engines `bench spec --peers` may name
DEFAULT_PEER_K = 4  # the peers' draft length when every engine configuration is adaptive


@dataclass
class Decoded:
    token_ids: list[int]
    elapsed_s: float  # wall time of the whole request, prefill included
    steps: int  # target forwards (one per step; = tokens for plain decoding)
    drafted: int | None  # draft tokens proposed; None where the engine does not report it
    accepted: int | None  # draft tokens accepted; None likewise


class PeerError(RuntimeError):
    """A peer's tool failed on one prompt: the benchmark records it as an error and goes on."""


class Decoder(ABC):
    name: str
    engine: str  # OURS or a peer (HF, LLAMACPP)
    baseline: str  # the same engine's plain decoder
    draft: str  # none, ngram, self, a checkpoint path, or prompt_lookup
    draft_length: int | str | None
    warms_up = True  # runs once untimed before the benchmark (allocations, lazy initialisation)

    @abstractmethod
    def decode(self, prompt_ids: list[int], params: SamplingParams) -> Decoded:
        """Decode one prompt; the output tokens and what it took."""

    @property
    def reference(self) -> str:
        """The decoder whose greedy tokens this one must reproduce: the plain decoder on the same
        weights (native GGUF weights and their float32 dequantization round differently)."""
        return self.baseline

    def describe(self) -> dict:
        return {"name": self.name, "engine": self.engine, "baseline": self.baseline, "draft": self.draft,
                "draft_length": self.draft_length, "reference": self.reference}


class EngineDecoder(Decoder):
    """This engine in-process (the step the scheduler service runs: services/scheduler/core.py),
    one request at a time; its latency warm-up runs when it is built, not in a timed decode."""

    engine = OURS
    baseline = PLAIN

    def __init__(self, name: str, target: LoadedModel, proposer: Proposer | None, draft: str,
                 draft_length: int | str, tree_size: int | None = None,
                 max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH, reference: str | None = None):
        self.name, self.draft, self.draft_length = name, draft, draft_length
        self._reference = reference or PLAIN
        try:
            config = StepConfig(draft_length=draft_length, tree_size=tree_size, max_draft_length=max_draft_length)
            self._engine = Engine(target, proposer, config, draft_name=draft)
        except TypeError as e:  # a StepConfig that takes integers only
            raise ValueError(f"--draft-length {draft_length!r}: this engine does not accept it ({e})") from None

    def decode(self, prompt_ids: list[int], params: SamplingParams) -> Decoded:
        t0 = time.perf_counter()
        req = self._engine.generate([prompt_ids], params)[0]
        elapsed = time.perf_counter() - t0
        return Decoded(list(req.output_ids), elapsed, req.stats.steps, req.stats.drafted, req.stats.accepted)

    @property
    def reference(self) -> str:
        return self._reference


class HFDecoder(Decoder):
    """transformers `generate` on the target's checkpoint; with an assistant model (assisted
    generation) or prompt lookup when given. Counts the target's forward calls as steps."""

    engine = HF
    baseline = HF_PLAIN

    def __init__(self, name: str, model, eos_token_ids: tuple[int, ...], pad_token_id: int, draft: str = "none",
                 assistant=None, prompt_lookup: bool = False, draft_length: int | None = None):
        self.name, self.draft, self.draft_length = name, draft, draft_length
        self.model, self.assistant, self.prompt_lookup = model, assistant, prompt_lookup
        self.eos_token_ids, self.pad_token_id = eos_token_ids, pad_token_id
        self._forwards = 0

        def count(_module, _args):
            self._forwards += 1

        model.register_forward_pre_hook(count)  # several decoders may share the model: each counts

    def _kwargs(self, params: SamplingParams) -> dict:
        kw = dict(max_new_tokens=params.max_tokens, eos_token_id=list(self.eos_token_ids),
                  pad_token_id=self.pad_token_id, do_sample=not params.greedy)
        if not params.greedy:  # the same warpers as ours (temperature, top-k, top-p), nothing else
            kw.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                      repetition_penalty=1.0)
        if self.assistant is not None:  # a fixed draft length, like ours: no schedule, no early stop
            kw.update(assistant_model=self.assistant, num_assistant_tokens=self.draft_length,
                      num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.draft_length
        return kw

    def decode(self, prompt_ids: list[int], params: SamplingParams) -> Decoded:
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)  # [1, prompt]
        kw = self._kwargs(params)
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        self._forwards = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # [1, prompt + new]
        tokens = out[0, len(prompt_ids):].tolist()
        elapsed = time.perf_counter() - t0
        tokens = stop_at_eos(tokens[:params.max_tokens], self.eos_token_ids)
        return Decoded(tokens, elapsed, self._forwards, None, None)


def stop_at_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """Tokens up to and including the first EOS (the engine's stopping rule)."""
    for i, tok in enumerate(tokens):
        if tok in eos_token_ids:
            return tokens[:i + 1]
    return tokens


def parse_draft_lengths(text: str) -> list[int | str]:
    """`4`, `adaptive` or a comma-separated list like `0,2,4,adaptive` (0 = plain decoding)."""
    out: list[int | str] = []
    for part in (p.strip() for p in str(text).split(",")):
        if part == "adaptive":
            value: int | str = part
        else:
            try:
                value = int(part)
            except ValueError:
                value = -1
            if value < 0:
                raise ValueError(f"--draft-length: expected integers >= 0 or 'adaptive', got {part!r}")
        if value not in out:
            out.append(value)
    return out


def _resolve_draft(draft: str, target: LoadedModel) -> str:
    """`default` names the committed draft of the default target: its directory (or ngram for
    another target), so that the HF assistant loads the draft, not the target."""
    try:
        from services.draft.factory import resolve_draft_spec
    except ImportError:  # a factory without a default draft
        return draft
    return resolve_draft_spec(draft, target)


def _draft_label(draft: str) -> str:
    """The configuration's name: its kind, and a checkpoint's folder where that is not the kind's
    own name (two heads side by side: head_k4 and head_head2_k4; head_ngram_k4 and
    head_head2_ngram_k4)."""
    if draft in ("none", "ngram", "self", "default"):
        return "draft" if draft == "default" else draft
    if draft.endswith(HYBRID_SUFFIX):
        return _draft_label(draft.removesuffix(HYBRID_SUFFIX)) + "_ngram"
    kind = "head" if is_head_checkpoint(draft) else "draft"
    folder = Path(draft).name if Path(draft).is_dir() else Path(draft).stem
    return kind if folder == kind else f"{kind}_{folder}"


@dataclass
class DecoderSet:
    decoders: list[Decoder]
    not_applicable: dict[str, str]  # peer name -> why it does not apply to this draft


def build_decoders(target: LoadedModel, draft: str, draft_lengths: list[int | str], tree_size: int | None = None,
                   device: str = "cpu", dtype: str | None = None, peers: tuple[str, ...] = (HF,),
                   max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH, weight_format: str = "native",
                   plain_formats: tuple[str, ...] = ()) -> DecoderSet:
    """This engine plain and with each of `draft` (comma-separated: side by side) at each draft
    length (adaptive: up to `max_draft_length`), on the target as loaded (`weight_format`), plus
    plain decoding on each of `plain_formats` (`plain_float32`: the same GGUF dequantized); with
    HF in `peers`, HF `generate` and the HF peers matching the drafts (assisted generation for a
    draft model, prompt lookup for ngram) at the largest integer draft length; with LLAMACPP,
    llama.cpp's plain decoding on the target's GGUF and its prompt lookup (for ngram) likewise."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers: {unknown[0]!r} is not one of {', '.join(PEERS)}")
    drafts = [_resolve_draft(d.strip(), target) for d in draft.split(",") if d.strip()]
    decoders: list[Decoder] = [EngineDecoder(PLAIN, target, None, "none", 0)]
    for fmt in plain_formats:
        other = load_model(target.name, device=device, dtype=dtype, weight_format=fmt)
        # float32 weights are HF's: its tokens must be generate's (native ones round differently)
        decoders.append(EngineDecoder(f"{PLAIN}_{fmt}", other, None, "none", 0,
                                      reference=HF_PLAIN if HF in peers and fmt == "float32" else f"{PLAIN}_{fmt}"))
    for d in drafts:
        if d != "none":
            decoders.extend(_engine_decoders(target, d, draft_lengths, tree_size, device, dtype, max_draft_length,
                                             weight_format))
    ints = [k for k in draft_lengths if isinstance(k, int) and k > 0]
    k = max(ints) if ints else DEFAULT_PEER_K
    na: dict[str, str] = {}
    if LLAMACPP in peers:
        decoders.extend(_llamacpp_decoders(target, k, "ngram" in drafts, na))
    if HF not in peers:
        return DecoderSet(decoders, na)
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch_dtype).to(dev).eval()
    eos = decoders[0]._engine.eos_token_ids
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]
    decoders.append(HFDecoder(HF_PLAIN, hf, eos, pad))
    assisted, lookup = f"hf_assisted_k{k}", f"hf_prompt_lookup_k{k}"
    if "ngram" in drafts:
        decoders.append(HFDecoder(lookup, hf, eos, pad, "prompt_lookup", prompt_lookup=True, draft_length=k))
    else:
        na["hf_prompt_lookup"] = "runs with --draft ngram"
    model_draft = next((d for d in drafts if _draft_label(d) == "draft"), None)
    if model_draft is not None:
        assistant = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(model_draft), dtype=torch_dtype)
        decoders.append(HFDecoder(assisted, hf, eos, pad, model_draft, assistant=assistant.to(dev).eval(),
                                  draft_length=k))
    else:
        na["hf_assisted"] = "runs with --draft PATH, a draft model checkpoint"
    return DecoderSet(decoders, na)


def _llamacpp_decoders(target: LoadedModel, k: int, ngram: bool, na: dict[str, str]) -> list[Decoder]:
    """llama.cpp's plain decoding on the target's GGUF file, and its prompt lookup at k with ngram."""
    from services.bench.llamacpp import LlamaCppDecoder, lookup_binary

    gguf = gguf_file(target.name)
    if gguf is None:
        raise ValueError(f"--peers llamacpp: the target {target.name!r} is not a GGUF file llama.cpp can read")
    binary, eos = lookup_binary(), target.eos_token_ids
    out = [LlamaCppDecoder(LLAMACPP_PLAIN, gguf, target.tokenizer, eos, 0, binary)]
    if ngram:
        out.append(LlamaCppDecoder(f"llamacpp_lookup_k{k}", gguf, target.tokenizer, eos, k, binary))
    else:
        na["llamacpp_lookup"] = "runs with --draft ngram"
    return out


def _engine_decoders(target: LoadedModel, draft: str, draft_lengths: list[int | str], tree_size: int | None,
                     device: str, dtype: str | None, max_draft_length: int, weight_format: str) -> list[Decoder]:
    """This engine with one draft at each draft length (one proposer: one request at a time)."""
    proposer = build_proposer(draft, target, device=device, dtype=dtype, weight_format=weight_format)
    label, out = _draft_label(draft), []
    for k in draft_lengths:
        if k == 0:
            continue  # that is the plain decoder
        name = f"{label}_k{k}" if k != "adaptive" else f"{label}_adaptive"
        if tree_size is not None:
            name += f"_tree{tree_size}"
        out.append(EngineDecoder(name, target, proposer, draft, k, tree_size, max_draft_length))
    return out
