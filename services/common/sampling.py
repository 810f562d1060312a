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
        x = _nucleus(x, top_p)
    return x.softmax(-1)


NUCLEUS_FIRST = 64  # top-p looks among a row's 64 most likely tokens first, 8x more while short


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """x [n, vocab] with -inf outside each row's nucleus: its tokens from the most likely on, while
    the mass before each stays below top_p (the first is always kept). Rather than sort the whole
    vocabulary (what made sampling slow), it is found among the top k tokens, k grown until their
    mass reaches top_p in every row (no later token can be kept then)."""
    vocab = x.shape[-1]
    p = x.softmax(-1)
    k = min(NUCLEUS_FIRST, vocab)
    while True:
        top_x, idx = torch.topk(x, k, dim=-1)  # [n, k], most likely first
        top_prob = p.gather(-1, idx)
        mass = top_prob.cumsum(-1)
        if k == vocab or bool((mass[:, -1] >= top_p).all()):
            break
        k = min(vocab, 8 * k)
    kept = torch.where(mass - top_prob < top_p, top_x, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, idx, kept)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [vocab] (any non-negative weights): the first whose cumulative
    weight exceeds a uniform draw over the total, so a zero weight is never drawn (one cumsum and a
    binary search: torch.multinomial does far more work over a large vocabulary)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    return i if i < len(probs) else int(probs.nonzero()[-1])  # u rounded up to the total
