"""Sampling parameters and the target distribution they define.

The distribution a request samples from is: logits / temperature, then top-k, then top-p (the
order of Hugging Face's warpers), then softmax. Temperature 0 means greedy (argmax). Speculative
decoding reproduces exactly this distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.grammar import Grammar

MAX_LOGPROBS = 20  # most likely alternatives a request may ask for with each token's logprob


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: each token's logprob and n alternatives
    grammar: Grammar | None = None  # structured output: the output stays inside this grammar

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range parameter."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.grammar is not None:
            self.grammar.validate()


def make_generator(seed: int | None, stream: int) -> torch.Generator:
    """A CPU generator for one random stream of one request (stream 0: draft, 1: verifier)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return g


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [n, vocab] -> probs [n, vocab] float32 of the sampling distribution (temperature > 0)."""
    x = logits.float() / temperature
    if not bool(torch.isfinite(x).all()):
        # A temperature so small (below ~1e-37) that logits / T overflows: softmax would give NaN
        # (inf - inf). Dividing after subtracting each row's max is the same distribution (the
        # limit: the argmax, ties shared) without the overflow.
        x = logits.float()
        x = (x - x.amax(-1, keepdim=True)) / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does (the first token is always kept).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator))
