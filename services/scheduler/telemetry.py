"""Acceptance and latency telemetry in Redis, shared by every scheduler of a model pair.

Per step and request: drafted and accepted tokens per tree depth, tree size, draft and verify
latency. Writes are batched per step and sent in the background; a Redis outage never fails or
slows a request (writes are dropped, logged once per interval, and the draft-length rule keeps
its last estimates).

Keys (hashes, counters that only grow; rates are ratios of counters):
    specserve:accept:{pair}   drafted:{depth}, accepted:{depth}, steps, tree_nodes
    specserve:latency:{pair}  draft_ms_sum, verify_ms_sum, steps
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 30.0


@dataclass
class StepRecord:
    depths: list[int]  # depth of every drafted node of one request (1 = first draft token)
    accepted: int  # accepted path length
    draft_ms: float
    verify_ms: float


@dataclass
class AcceptanceStats:
    drafted: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    def rate(self, depth: int) -> float | None:
        """P(the depth-th draft token is accepted | the path reached depth - 1), or None."""
        d = self.drafted.get(depth, 0)
        return self.accepted.get(depth, 0) / d if d >= 20 else None


class Telemetry:
    def __init__(self, redis_url: str | None, pair: str):
        self.pair = pair
        self.client = None
        if redis_url:
            import redis.asyncio as redis

            self.client = redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.local = AcceptanceStats()  # used when Redis is absent or down
        self.shared: AcceptanceStats | None = None
        self._pending: list[StepRecord] = []
        self._last_error_log = 0.0
        self._task: asyncio.Task | None = None
        self.redis_errors = 0

    def record(self, rec: StepRecord) -> None:
        for depth in sorted(set(rec.depths)):
            self.local.drafted[depth] = self.local.drafted.get(depth, 0) + 1
            if depth <= rec.accepted:
                self.local.accepted[depth] = self.local.accepted.get(depth, 0) + 1
        self._pending.append(rec)

    def stats(self) -> AcceptanceStats:
        return self.shared if self.shared is not None else self.local

    def flush(self) -> None:
        """Send pending records in the background (at most one flush in flight)."""
        if self.client is None or not self._pending or (self._task and not self._task.done()):
            return
        batch, self._pending = self._pending, []
        self._task = asyncio.create_task(self._write(batch))

    async def _write(self, batch: list[StepRecord]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            akey, lkey = f"specserve:accept:{self.pair}", f"specserve:latency:{self.pair}"
            for rec in batch:
                for depth in sorted(set(rec.depths)):
                    pipe.hincrby(akey, f"drafted:{depth}", 1)
                    if depth <= rec.accepted:
                        pipe.hincrby(akey, f"accepted:{depth}", 1)
                pipe.hincrby(akey, "steps", 1)
                pipe.hincrby(akey, "tree_nodes", len(rec.depths))
                pipe.hincrbyfloat(lkey, "draft_ms_sum", rec.draft_ms)
                pipe.hincrbyfloat(lkey, "verify_ms_sum", rec.verify_ms)
                pipe.hincrby(lkey, "steps", 1)
            pipe.hgetall(akey)
            results = await asyncio.wait_for(pipe.execute(), timeout=1.0)
            self.shared = _parse(results[-1])
        except Exception as e:  # Redis down or slow: drop this batch, keep serving
            self.redis_errors += 1
            now = time.monotonic()
            if now - self._last_error_log > LOG_INTERVAL_S:
                self._last_error_log = now
                log.warning("telemetry: Redis unavailable (%s); continuing with local estimates", e)

    async def close(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()


def _parse(raw: dict) -> AcceptanceStats:
    stats = AcceptanceStats()
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else k
        kind, _, depth = key.partition(":")
        if depth.isdigit() and kind in ("drafted", "accepted"):
            getattr(stats, kind)[int(depth)] = int(v)
    return stats


def choose_draft_length(stats: AcceptanceStats, max_k: int, min_reach: float = 0.3) -> int:
    """The simple rule: draft as deep as the chance of the path still being accepted there stays
    at least `min_reach` (without data for a depth, assume it pays)."""
    reach, k = 1.0, 0
    for depth in range(1, max_k + 1):
        rate = stats.rate(depth)
        reach *= 1.0 if rate is None else rate
        if reach < min_reach:
            break
        k = depth
    return max(1, k)
