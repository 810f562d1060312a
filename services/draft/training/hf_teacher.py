"""Teacher data on a CUDA machine: transformers' batched `generate` answers the prompts, then one
teacher-forced pass per batch records the head's layers and the top-k log-probabilities, as the
same Samples that teacher.generate makes on the CPU. Our engine's forward loops over requests in
every layer, which a GPU pays for in kernel launches; this path makes many more answers than two
cores can, for the head's data-size question.

Positions follow teacher.Sample: states for every position fed (all but the last token), a
top-k row for every answer token (the distribution at the position before it)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from services.draft.training.teacher import Sample

log = logging.getLogger(__name__)


def load(ckpt: Path, device: str):
    """The target as a transformers model in float32 (the CPU engine's dequantized weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()


@torch.inference_mode()
def generate(model, prompts: list[list[int]], temperatures: list[float], eos_ids: tuple[int, ...],
             max_tokens: int, top_k: int = 32, batch: int = 256, seed: int = 0,
             state_layers: tuple[int, ...] = (), pad_id: int = 0) -> list[Sample]:
    """Answer every prompt (greedy at temperature 0, else sampled at that temperature with top-p
    0.95); prompts of one temperature and similar length share a batch."""
    torch.manual_seed(seed)
    groups: dict[float, list[int]] = {}
    for i, t in enumerate(temperatures):
        groups.setdefault(t, []).append(i)
    done: dict[int, Sample] = {}
    started, tokens = time.monotonic(), 0
    for temperature, members in sorted(groups.items()):
        members.sort(key=lambda i: len(prompts[i]))
        for s in range(0, len(members), batch):
            idx = members[s : s + batch]
            answers = _answer(model, [prompts[i] for i in idx], temperature, eos_ids, max_tokens, pad_id)
            for i, sample in zip(idx, _record(model, [prompts[i] for i in idx], answers, top_k, state_layers)):
                done[i] = sample
                tokens += len(sample.ids) - sample.prompt_len
            log.info("hf teacher: %d/%d answered, %d tokens, %.0f tokens/s", len(done), len(prompts),
                     tokens, tokens / (time.monotonic() - started))
    return [done[i] for i in range(len(prompts))]


def _answer(model, prompts: list[list[int]], temperature: float, eos_ids, max_tokens: int,
            pad_id: int) -> list[list[int]]:
    """Left-padded batched generate; each answer ends at (and keeps) its first end-of-sequence id."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0) if temperature > 0 \
        else dict(do_sample=False)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                         eos_token_id=list(eos_ids), pad_token_id=pad_id, **sampling)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


def _record(model, prompts, answers, top_k: int, state_layers, rows: int = 32) -> list[Sample]:
    """Teacher-forced passes over prompt + answer, `rows` sequences at a time (the logits of a
    pass are rows x length x vocab floats)."""
    return [s for i in range(0, len(prompts), rows)
            for s in _record_rows(model, prompts[i : i + rows], answers[i : i + rows], top_k, state_layers)]


def _record_rows(model, prompts, answers, top_k: int, state_layers) -> list[Sample]:
    """One pass, right-padded (padding never precedes a real token): the layers' states at every
    position fed and the top-k at the answer's positions."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    captured: dict[int, torch.Tensor] = {}
    # a hook on each layer: transformers' last hidden state is after the final norm, not the residual
    hooks = [model.model.layers[layer].register_forward_hook(
        lambda _m, _in, out, layer=layer: captured.__setitem__(layer, out[0] if isinstance(out, tuple) else out))
        for layer in state_layers]
    try:
        out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    # [B, T, layers * hidden]
    states = torch.cat([captured[layer] for layer in state_layers], -1) if state_layers else None
    samples = []
    for r, (p, a) in enumerate(zip(prompts, answers)):
        n = len(p) + len(a)
        logp = out.logits[r, len(p) - 1 : n - 1].float().log_softmax(-1)  # [answer, vocab]
        top_logp, top_ids = torch.topk(logp, top_k, dim=-1)
        st = states[r, : n - 1].to(torch.float16).cpu() if states is not None else None
        samples.append(Sample(p + a, len(p), top_ids.to(torch.int32).cpu(), top_logp.to(torch.float16).cpu(), st))
    return samples
