"""Teacher data: the target answers the training prompts (continuous batching with the lean
forward and its KV caches) and records, for every generated position, its top-k next-token
log-probabilities: the distillation target, with no second teacher-forced pass. For a
feature-level head it also records the residual stream of a few layers at every position fed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.llama import Chunk, LlamaModel
from services.common.sampling import warp_probs

log = logging.getLogger(__name__)


@dataclass
class Sample:
    ids: list[int]  # prompt + response
    prompt_len: int
    top_ids: torch.Tensor  # [response_len, k] int32: the target's top-k at positions prompt_len-1 ..
    top_logp: torch.Tensor  # [response_len, k] float16: their log-probabilities
    # [len(ids) - 1, layers * hidden] float16: the states of every position fed to the target
    # (all but the last token); None when no layers were asked
    states: torch.Tensor | None = None


@dataclass
class _Running:
    index: int
    prompt: list[int]
    cache: object
    temperature: float
    generator: torch.Generator
    out: list[int]
    rows_ids: list[torch.Tensor]
    rows_logp: list[torch.Tensor]
    states: list[torch.Tensor] = field(default_factory=list)  # [fed, layers * hidden] per forward

    def sample(self) -> Sample:
        states = torch.cat(self.states)[: len(self.prompt) + len(self.out) - 1] if self.states else None
        return Sample(self.prompt + self.out, len(self.prompt), torch.stack(self.rows_ids),
                      torch.stack(self.rows_logp), states)


def generate(model: LlamaModel, prompts: list[list[int]], temperatures: list[float], eos_ids: tuple[int, ...],
             max_tokens: int, top_k: int = 32, batch: int = 16, seed: int = 0,
             deadline: float | None = None, state_layers: tuple[int, ...] = (),
             on_sample: Callable[[int, Sample], None] | None = None,
             enough: Callable[[], bool] | None = None) -> list[Sample]:
    """Answer every prompt (greedy at temperature 0, else sampled with top_p 0.95); stops early
    when time.monotonic() passes `deadline`, keeping the answers so far. `state_layers`: record
    those layers' states; `on_sample(prompt index, sample)` is called as each answer finishes;
    once `enough()` is true no more prompts start (the running ones finish)."""
    queue = list(range(len(prompts)))
    running: list[_Running] = []
    done: dict[int, Sample] = {}
    tokens_out, started = 0, time.monotonic()
    while queue or running:
        if deadline is not None and time.monotonic() > deadline:
            for r in running:  # answers cut short are still the target's text: keep them
                if r.out:
                    done[r.index] = r.sample()
                    if on_sample is not None:
                        on_sample(r.index, done[r.index])
            log.warning("teacher deadline reached: %d of %d prompts answered (%d cut short)",
                        len(done), len(prompts), len(running))
            break
        if queue and enough is not None and enough():
            queue.clear()
        if not queue and not running:
            break
        while queue and len(running) < batch:
            i = queue.pop(0)
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            running.append(_Running(i, prompts[i], model.new_cache(len(prompts[i]) + max_tokens + 1),
                                    temperatures[i], g, [], [], []))
        chunks = []
        for r in running:
            if not r.out:  # prefill the prompt; logits of its last position only
                chunks.append(Chunk(r.cache, r.prompt, list(range(-1, len(r.prompt) - 1)),
                                    logits_from=len(r.prompt) - 1))
            else:
                chunks.append(Chunk(r.cache, [r.out[-1]], [-1], logits_from=0))
        logits, states = model.forward_states(chunks, state_layers)
        logits = torch.cat(logits)  # [batch, vocab]
        logp = logits.log_softmax(-1)
        top_logp, top_ids = torch.topk(logp, top_k, dim=-1)  # [batch, k]
        still = []
        for row, r in enumerate(running):
            if states:
                r.states.append(states[row].to(torch.float16))
            if r.temperature == 0.0:
                tok = int(top_ids[row, 0])
            else:
                probs = warp_probs(logits[row : row + 1], r.temperature, 0, 0.95)[0]
                tok = int(torch.multinomial(probs, 1, generator=r.generator))
            r.out.append(tok)
            r.rows_ids.append(top_ids[row].to(torch.int32))
            r.rows_logp.append(top_logp[row].to(torch.float16))
            tokens_out += 1
            if tok in eos_ids or len(r.out) >= max_tokens:
                done[r.index] = r.sample()
                if on_sample is not None:
                    on_sample(r.index, done[r.index])
                if len(done) % 16 == 0:
                    rate = tokens_out / (time.monotonic() - started)
                    log.info("teacher: %d/%d answered, %d tokens, %.0f tokens/s", len(done),
                             len(prompts), tokens_out, rate)
            else:
                still.append(r)
        running = still
    return [done[i] for i in sorted(done)]
