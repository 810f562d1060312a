"""SlimSpec quality guard: falls back to the full LM head when the slim head's acceptance drops.

Policy only (no torch): the proposer reports, per finished draft tree, how many tokens it drafted,
how many the verifier accepted, and which head drafted them. The guard runs in three modes:

    calibrating  the full head drafts until `calibration_tokens` drafted tokens give its
                 acceptance rate (the calibrated full-head rate); then slim
    slim         the slim head drafts; over a rolling window of its last `window_tokens` drafted
                 tokens, once `min_tokens` are in, a rate more than `points` percentage points
                 below the calibrated rate switches to fallback (logged and counted)
    fallback     the full head drafts again and recalibrates the full-head rate over
                 `calibration_tokens` x 2^(consecutive fallbacks - 1) tokens (capped at
                 `max_backoff`), then switches back to slim

A slim window that stays within the allowed drop resets the backoff.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

CALIBRATING, SLIM, FALLBACK = "calibrating", "slim", "fallback"


@dataclass(frozen=True)
class GuardConfig:
    points: float = 5.0  # allowed acceptance-rate drop of the slim head, in percentage points
    calibration_tokens: int = 256  # full-head drafted tokens per (re)calibration
    window_tokens: int = 512  # rolling window of slim-head drafted tokens
    min_tokens: int = 128  # slim drafted tokens needed before the window is judged
    max_backoff: int = 8  # recalibration length grows up to this factor after repeated fallbacks

    def validate(self) -> None:
        if not 0.0 <= self.points <= 100.0:
            raise ValueError(f"slim guard points must be in [0, 100], got {self.points!r}")
        for name in ("calibration_tokens", "window_tokens", "min_tokens", "max_backoff"):
            if getattr(self, name) < 1:
                raise ValueError(f"slim guard {name} must be >= 1, got {getattr(self, name)!r}")
        if self.min_tokens > self.window_tokens:
            raise ValueError(f"slim guard min_tokens ({self.min_tokens}) must not exceed "
                             f"window_tokens ({self.window_tokens})")


class SlimGuard:
    def __init__(self, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        self.config.validate()
        self.mode = CALIBRATING
        self.full_rate: float | None = None  # the calibrated full-head acceptance rate
        self.fallbacks = 0  # switches from slim to full (the metric)
        self.recoveries = 0  # switches back to slim after a recalibration
        self._calib = [0, 0]  # drafted, accepted with the full head in this calibration
        self._window: deque[tuple[int, int]] = deque()  # (drafted, accepted) of slim trees
        self._window_sum = [0, 0]
        self._backoff = 1  # the next recalibration lasts calibration_tokens x this
        self._consecutive = 0  # fallbacks without a healthy slim window in between

    def use_slim(self) -> bool:
        return self.mode == SLIM

    def slim_rate(self) -> float | None:
        """The slim head's rolling acceptance rate (None before any slim tree)."""
        drafted, accepted = self._window_sum
        return accepted / drafted if drafted else None

    def observe(self, drafted: int, accepted: int, slim: bool) -> None:
        """One finished draft tree: `drafted` nodes, `accepted` of them accepted, drafted by the
        slim head (slim=True) or the full head."""
        if drafted <= 0:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, drafted={drafted}], got {accepted}")
        if slim:
            if self.mode == SLIM:
                self._observe_slim(drafted, accepted)
            return
        if self.mode in (CALIBRATING, FALLBACK):
            self._calib[0] += drafted
            self._calib[1] += accepted
            if self._calib[0] >= self.config.calibration_tokens * self._backoff:
                self._finish_calibration()

    def _finish_calibration(self) -> None:
        drafted, accepted = self._calib
        self.full_rate = accepted / drafted
        if self.mode == FALLBACK:
            self.recoveries += 1
            log.info("SlimSpec guard: recalibrated the full head at %.1f%% acceptance; back to the slim head",
                     100 * self.full_rate)
        self.mode = SLIM
        self._calib = [0, 0]
        self._window.clear()
        self._window_sum = [0, 0]

    def _observe_slim(self, drafted: int, accepted: int) -> None:
        cfg = self.config
        self._window.append((drafted, accepted))
        self._window_sum[0] += drafted
        self._window_sum[1] += accepted
        while self._window_sum[0] - self._window[0][0] >= cfg.window_tokens:
            d, a = self._window.popleft()
            self._window_sum[0] -= d
            self._window_sum[1] -= a
        if self._window_sum[0] < cfg.min_tokens:
            return
        rate = self.slim_rate()
        if rate < self.full_rate - cfg.points / 100.0:
            self.fallbacks += 1
            log.warning("SlimSpec guard: slim-head acceptance %.1f%% is more than %.1f points below the "
                        "full head's %.1f%%; switching to the full head (fallback %d)",
                        100 * rate, cfg.points, 100 * self.full_rate, self.fallbacks)
            self.mode = FALLBACK
            self._calib = [0, 0]
            self._consecutive += 1
            self._backoff = min(cfg.max_backoff, 2 ** (self._consecutive - 1))
        elif self._window_sum[0] >= cfg.window_tokens:
            self._consecutive = 0  # a full window within bounds: the slim head is healthy

    def state(self) -> dict:
        return {"mode": self.mode, "full_rate": self.full_rate, "slim_rate": self.slim_rate(),
                "fallbacks": self.fallbacks, "recoveries": self.recoveries}
