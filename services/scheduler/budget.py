"""The step's token budget (chunked prefill): how many prompt tokens may join a step beside the
running requests' decode and draft-tree rows (plain Python, no torch).

Two limits, either or both (vLLM's `max_num_batched_tokens` is the first):

- `max_step_tokens`: the rows of one verify forward, at most. Decode rows (one per running
  request plus its tree's nodes) come first; prompts fill what is left, in chunks.
- `target_itl_ms`: while requests decode, a step's prompt rows are those the step's time has room
  for: target - the time drafting took - the decode rows' verify time - a margin, spent on prompt
  tokens at what they cost where the chunk starts. Both come from one fit of every step's verify
  ms, `ms = a + b * decode rows + c * prompt rows + d * the sum of their positions / 1000`
  (latency.py's exponentially weighted least squares, so it follows the machine): a prompt row
  attends to the prompt before it, so a chunk late in a long prompt costs more a token than the
  first (BENCHMARKS.md, "Load with chunked prefill"). The margin is what the fit's predictions
  for steps with prompt rows have recently fallen short by (their decayed mean + 1.5 standard
  deviations), so the target holds for most steps, not on average. Nothing decoding: no
  inter-token latency to protect, so no limit from it.

Prompts always get at least half of a step: past half the target (a slow machine, a full batch)
they take the tokens the decode rows' own time buys, so a step is at most max(target, twice the
decode) instead of a prompt trickling in for dozens of steps while its batch slot idles
(measured: a floor of 16 tokens a step cut output tokens/s at 16 streams to 0.58x of whole
prompts). When prompts outnumber the streams decoding (a burst arriving at a quiet server) they
get the decode time once per stream they outnumber it by: the few streams' latency is not worth
the many prompts' wait. And at least MIN_CHUNK prompt tokens while prompts wait (when the row
limit leaves room).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.scheduler.latency import LinearFit

MIN_CHUNK = 16  # prompt tokens a step takes at least while prompts wait
DEFAULT_TARGET_ITL_MS = 200.0
# Verify ms = [1, decode rows, prompt rows, their positions' sum / 1000] . w; the prior only
# matters until the first steps.
PRIOR = (20.0, 2.0, 2.0, 0.0)
DECAY = 0.99  # per step: the fit follows the last few hundred steps
MISS_DECAY = 0.95  # per step with prompt rows: the margin follows the last few dozen
MISS_SPREAD = 1.5  # standard deviations of the recent shortfalls the margin adds to their mean


def positions(start: int, rows: int) -> float:
    """The position sum of `rows` prompt rows from `start` on, in thousands (the fit's feature)."""
    return rows * (2 * start + rows - 1) / 2000


@dataclass
class StepBudget:
    max_step_tokens: int = 0  # 0: no row limit
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS  # 0: no time limit
    fit: LinearFit = field(default_factory=lambda: LinearFit(PRIOR, decay=DECAY))
    misses: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decayed count, sum, sum of squares

    def validate(self, max_batch: int) -> None:
        if self.max_step_tokens < 0:
            raise ValueError(f"max_step_tokens must be >= 0, got {self.max_step_tokens}")
        if self.max_step_tokens and self.max_step_tokens < max_batch:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be at least max_batch ({max_batch}): "
                             "every running request needs a row per step")
        if self.target_itl_ms < 0:
            raise ValueError(f"target_itl_ms must be >= 0, got {self.target_itl_ms}")

    def limited(self, decoding: int) -> bool:
        """Whether a step with `decoding` requests decoding limits its prompt rows at all."""
        return bool(self.max_step_tokens) or (bool(self.target_itl_ms) and decoding > 0)

    def decode_ms(self, decode_rows: int) -> float:
        return self.fit.predict((1.0, float(decode_rows), 0.0, 0.0))

    @property
    def token_ms(self) -> float:
        return max(self.fit.weights[2], 1e-3)

    @property
    def margin_ms(self) -> float:
        """How much steps with prompt rows recently ran past their prediction (0 when they did not)."""
        n, total, squares = self.misses
        if n < 1.0:
            return 0.0
        mean = total / n
        return max(0.0, mean + MISS_SPREAD * math.sqrt(max(0.0, squares / n - mean * mean)))

    def rows_within(self, ms: float, start: int) -> int:
        """Prompt rows from position `start` on whose predicted verify time fits in `ms`: the n
        with n * (c + d * start / 1000) + d * n * (n - 1) / 2000 <= ms."""
        c, d = self.token_ms, self.fit.weights[3]
        linear = c + d * (start - 0.5) / 1000
        if d <= 1e-9:
            return max(0, int(ms / linear))
        quad = d / 2000
        return max(0, int((math.sqrt(linear * linear + 4 * quad * ms) - linear) / (2 * quad)))

    def tree_rows(self, decoding: int, prompts_wait: bool) -> int | None:
        """Draft-tree nodes the step may verify in all (None: no limit): the row limit less a row
        per decoding request and, while prompts wait, MIN_CHUNK for them."""
        if not self.max_step_tokens:
            return None
        return max(0, self.max_step_tokens - decoding - (MIN_CHUNK if prompts_wait else 0))

    def prompt_rows(self, decode_rows: int, decoding: int, spent_ms: float = 0.0, waiting: int = 1,
                    start: int = 0) -> int | None:
        """Prompt tokens the step may take (None: no limit) after `decode_rows` rows of `decoding`
        requests, with `spent_ms` of it spent drafting, `waiting` prompts still joining and the
        first chunk starting at position `start` of its prompt."""
        rows = None
        if self.max_step_tokens:
            rows = max(0, self.max_step_tokens - decode_rows)
        if self.target_itl_ms and decoding:
            decode = spent_ms + self.decode_ms(decode_rows)
            share = decode * max(1.0, waiting / decoding)  # see the module docstring
            room = max(self.target_itl_ms - self.margin_ms - decode, share)
            timed = max(MIN_CHUNK, self.rows_within(room, start))
            rows = timed if rows is None else min(rows, timed)
        return rows

    def observe(self, verify_ms: float, decode_rows: int, prompt_rows: int, prompt_positions: float = 0.0) -> None:
        """Learn from a step's verify time and its rows (`prompt_positions`: `positions` summed
        over its chunks); a step with prompt rows first counts how far it ran past its prediction."""
        x = (1.0, float(decode_rows), float(prompt_rows), prompt_positions)
        if prompt_rows:
            miss = verify_ms - self.fit.predict(x)
            n, total, squares = self.misses
            self.misses = [n * MISS_DECAY + 1, total * MISS_DECAY + miss, squares * MISS_DECAY + miss * miss]
        self.fit.observe(x, verify_ms)
