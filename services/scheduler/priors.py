"""The acceptance priors in Redis: per model pair and request class, shared by every scheduler.

`Priors` is what seeds a new request's acceptance estimate (acceptance.py: `Acceptance`) with
the per-depth rates of its class (`AcceptanceStats`), and it is where every step's outcome goes.
Per step and request the scheduler records (`StepRecord`), for each draft depth the path reached
(depth d - 1 accepted, d within the request's draft length), whether the depth-d token was
accepted; plus tree size and draft and verify latency. Counts go to time buckets per model pair and
request class, so old data fades: a reader weighs bucket b by 0.5 ** (age / half_life). Records are
summed and sent in the background at most every FLUSH_INTERVAL_S (one pipeline: the summed
counters, then the class's buckets read back), not once per step: a step every few tens of
milliseconds would otherwise cost a Redis round trip and thirty bucket reads each, on the cores the
verifier needs. A Redis outage never fails or slows a request (writes are dropped, logged once per
interval, and the priors fall back to this scheduler's own decayed counts).

Keys (hashes of counters; each bucket expires after `keep_buckets` intervals):
    specserve:accept:{pair}:{class}:{bucket}   judged:{d}, accepted:{d}, steps, tree_nodes
    specserve:latency:{pair}                   draft_ms_sum, verify_ms_sum, steps
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services.scheduler.acceptance import AcceptanceStats, depth_outcomes

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 30.0
FLUSH_INTERVAL_S = 0.25


@dataclass
class StepRecord:
    request_class: str
    k: int  # the draft length it was given this step (0 = none)
    accepted: int  # accepted path length
    nodes: int  # tree size
    draft_ms: float
    verify_ms: float


class Priors:
    """The acceptance priors of one model pair: this scheduler's own counts per request class,
    and the counts every scheduler of the pair shares in Redis (read back after each write)."""

    def __init__(self, redis_url: str | None, pair: str, bucket_s: float = 60.0, half_life_s: float = 600.0,
                 keep_buckets: int = 30, local_decay: float = 0.999, clock=time.time):
        self.pair = pair
        self.bucket_s, self.half_life_s, self.keep_buckets = bucket_s, half_life_s, keep_buckets
        self.clock = clock
        self.client = None
        if redis_url:
            import redis.asyncio as redis

            self.client = redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.local: dict[str, AcceptanceStats] = {}  # this scheduler's own counts, decayed per record
        self.local_decay = local_decay
        self.shared: dict[str, AcceptanceStats] = {}  # read back from Redis after each write
        self._pending: list[StepRecord] = []
        self._last_error_log = 0.0
        self._task: asyncio.Task | None = None
        self._last_flush = float("-inf")  # time.monotonic() of the last flush
        self.redis_errors = 0

    def record(self, rec: StepRecord) -> None:
        stats = self.local.setdefault(rec.request_class, AcceptanceStats())
        stats.scale(self.local_decay)
        stats.add(rec.k, rec.accepted)
        if self.client is not None:
            self._pending.append(rec)

    def stats(self, request_class: str = "default") -> AcceptanceStats:
        shared = self.shared.get(request_class)
        return shared if shared is not None else self.local.get(request_class, AcceptanceStats())

    def priors(self, request_class: str, max_depth: int) -> list[float | None]:
        """Per-depth acceptance for a new request of this class (None where too little is known)."""
        return self.stats(request_class).rates(max_depth)

    def flush(self) -> None:
        """Send pending records in the background: one writer task at a time, which writes at
        most once per FLUSH_INTERVAL_S and ends when nothing is pending."""
        if self.client is None or not self._pending or (self._task and not self._task.done()):
            return
        self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending:
            wait = self._last_flush + FLUSH_INTERVAL_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # records of the steps meanwhile join this write
            self._last_flush = time.monotonic()
            batch, self._pending = self._pending, []
            await self._write(batch)

    def _key(self, request_class: str, bucket: int) -> str:
        return f"specserve:accept:{self.pair}:{request_class}:{bucket}"

    async def _write(self, batch: list[StepRecord]) -> None:
        try:
            now = self.clock()
            bucket = int(now // self.bucket_s)
            ttl = int(self.bucket_s * self.keep_buckets)
            pipe = self.client.pipeline(transaction=False)
            lkey = f"specserve:latency:{self.pair}"
            classes = sorted({rec.request_class for rec in batch})
            for cls, counts in _summed(batch).items():
                akey = self._key(cls, bucket)
                for name, value in counts.items():
                    pipe.hincrby(akey, name, value)
                pipe.expire(akey, ttl)
            pipe.hincrbyfloat(lkey, "draft_ms_sum", sum(rec.draft_ms for rec in batch))
            pipe.hincrbyfloat(lkey, "verify_ms_sum", sum(rec.verify_ms for rec in batch))
            pipe.hincrby(lkey, "steps", len(batch))
            reads = [(cls, b) for cls in classes for b in range(bucket - self.keep_buckets + 1, bucket + 1)]
            for cls, b in reads:
                pipe.hgetall(self._key(cls, b))
            results = await asyncio.wait_for(pipe.execute(), timeout=1.0)
            fresh: dict[str, AcceptanceStats] = {cls: AcceptanceStats() for cls in classes}
            for (cls, b), raw in zip(reads, results[len(results) - len(reads):]):
                age_s = max(0.0, now - (b + 0.5) * self.bucket_s)
                fresh[cls].merge(_parse(raw), 0.5 ** (age_s / self.half_life_s))
            self.shared.update(fresh)
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


def _summed(batch: list[StepRecord]) -> dict[str, dict[str, int]]:
    """Per request class, the counter increments of a batch of records (judged:{d}, accepted:{d},
    steps, tree_nodes)."""
    out: dict[str, dict[str, int]] = {}
    for rec in batch:
        counts = out.setdefault(rec.request_class, {})
        for d, ok in depth_outcomes(rec.k, rec.accepted):
            counts[f"judged:{d}"] = counts.get(f"judged:{d}", 0) + 1
            if ok:
                counts[f"accepted:{d}"] = counts.get(f"accepted:{d}", 0) + 1
        counts["steps"] = counts.get("steps", 0) + 1
        counts["tree_nodes"] = counts.get("tree_nodes", 0) + rec.nodes
    return out


def _parse(raw: dict) -> AcceptanceStats:
    stats = AcceptanceStats()
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else k
        kind, _, depth = key.partition(":")
        if depth.isdigit() and kind in ("judged", "accepted"):
            getattr(stats, kind)[int(depth)] = float(v)
    return stats
