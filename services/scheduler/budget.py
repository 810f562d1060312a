"""The step's token budget (chunked prefill): how many prompt tokens may join a step beside the
running requests' decode and draft-tree rows (plain Python, no torch).

Two limits, either or both (vLLM's `max_num_batched_tokens` is the first):

- `max_step_tokens`: the rows of one verify forward, at most. Decode rows (one per running
  request plus its tree's nodes) come first; prompts fill what is left, in chunks.
- `target_itl_ms`: while requests decode, a step's prompt rows are those the step's time has room
  for: (target - the time drafting took - the decode rows' verify time) / the ms a prompt token
  costs. Both come from one fit of every step's verify ms, `ms = a + b * decode rows + c * prompt
  rows` (latency.py's exponentially weighted least squares, so it follows the machine). Nothing
  decoding: no inter-token latency to protect, so no limit from it.

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

from dataclasses import dataclass, field

from services.scheduler.latency import LinearFit

MIN_CHUNK = 16  # prompt tokens a step takes at least while prompts wait
DEFAULT_TARGET_ITL_MS = 200.0
# Verify ms = [1, decode rows, prompt rows] . w; the prior only matters until the first steps.
PRIOR = (20.0, 2.0, 2.0)
DECAY = 0.99  # per step: the fit follows the last few hundred steps


@dataclass
class StepBudget:
    max_step_tokens: int = 0  # 0: no row limit
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS  # 0: no time limit
    fit: LinearFit = field(default_factory=lambda: LinearFit(PRIOR, decay=DECAY))

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
        return self.fit.predict((1.0, float(decode_rows), 0.0))

    @property
    def token_ms(self) -> float:
        return max(self.fit.weights[2], 1e-3)

    def tree_rows(self, decoding: int, prompts_wait: bool) -> int | None:
        """Draft-tree nodes the step may verify in all (None: no limit): the row limit less a row
        per decoding request and, while prompts wait, MIN_CHUNK for them."""
        if not self.max_step_tokens:
            return None
        return max(0, self.max_step_tokens - decoding - (MIN_CHUNK if prompts_wait else 0))

    def prompt_rows(self, decode_rows: int, decoding: int, spent_ms: float = 0.0, waiting: int = 1) -> int | None:
        """Prompt tokens the step may take (None: no limit) after `decode_rows` rows of `decoding`
        requests, with `spent_ms` of it spent drafting and `waiting` prompts still joining."""
        rows = None
        if self.max_step_tokens:
            rows = max(0, self.max_step_tokens - decode_rows)
        if self.target_itl_ms and decoding:
            decode, per = spent_ms + self.decode_ms(decode_rows), self.token_ms
            share = decode * max(1.0, waiting / decoding)  # see the module docstring
            timed = max(MIN_CHUNK, int((self.target_itl_ms - decode) / per), int(share / per))
            rows = timed if rows is None else min(rows, timed)
        return rows

    def observe(self, verify_ms: float, decode_rows: int, prompt_rows: int) -> None:
        """Learn from a step's verify time and its rows."""
        self.fit.observe((1.0, float(decode_rows), float(prompt_rows)), verify_ms)
