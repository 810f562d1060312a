"""RateLimiter: requests per period and tokens per period, per principal, shared in Redis.

Every gateway replica asks the same Redis, so a limit holds across replicas. Each admission is
ONE atomic Lua script that decides both limits together: a refused request changes nothing, an
admitted one is charged to both. The clock is Redis's (TIME), so replicas with skewed clocks
agree.

The algorithm is GCRA (the "generic cell rate algorithm", a token bucket stored as one
timestamp): a limit of N per period P emits one unit every T = P / N and tolerates a burst of N.
The key holds the theoretical arrival time `tat`; a request costing c units is admitted when
`max(tat, now) + c*T - P <= now`, which stores the new tat; otherwise it may be retried after
exactly the difference. So with a fresh bucket the first N requests pass and the N+1-th is
refused with Retry-After = T (exact at the boundary); over any interval of length W at most
N + W / T units pass (the burst, then the steady rate).

Token accounting: a request is charged `prompt tokens + max_tokens` when it is admitted (what it
may consume at most, as OpenAI's limits count it); nothing is refunded when it stops earlier, so
clients should send a max_tokens close to what they need. A request that needs more tokens than
the whole limit can never pass and is refused without a Retry-After.

With Redis unreachable the limiter fails open (the request passes unchecked) or, configured so,
closed (503); either way `redis_errors` counts the failed calls, a warning is logged at most once
per `log_interval`, and Redis is not asked again for `backoff` seconds.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

KEY_PREFIX = "specserve:ratelimit"
_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
          "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([a-z]+)\s*")

# KEYS: one bucket per limit. ARGV: per limit, (interval T in microseconds, period P in
# microseconds, cost in units). Returns {1, 0, 0} when admitted (every bucket charged), else
# {0, index of the limit furthest from admitting, microseconds until it would}.
GCRA_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tats = {}
local worst, which = 0, 0
for i = 1, #KEYS do
  local interval, period, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local new_tat = tat + interval * cost
  local wait = new_tat - period - now
  if wait > worst then worst, which = wait, i end
  tats[i] = new_tat
end
if which > 0 then return {0, which, math.ceil(worst)} end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%.0f', tats[i]), 'PX', math.ceil((tats[i] - now) / 1000) + 1)
end
return {1, 0, 0}
"""
GCRA_SHA = hashlib.sha1(GCRA_LUA.encode()).hexdigest()


@dataclass(frozen=True)
class Rate:
    """A limit of `limit` units per `period` seconds, written like `10/s`, `20000/m`, `5/10s`."""

    limit: int
    period: float
    text: str = ""

    @classmethod
    def parse(cls, text: str | None, param: str) -> "Rate | None":
        """`N/UNIT` or `N/<number>UNIT` with UNIT s, m, h or d; unset, empty or "off" = None."""
        if text is None or text.strip().lower() in ("", "off", "none", "0"):
            return None
        m = _RATE.fullmatch(text.lower())
        if not m or m.group(3) not in _UNITS:
            raise ValueError(f"{param}: {text!r} is not a rate like 10/s, 20000/m, 5/10s or 1000/h")
        limit, count = int(m.group(1)), float(m.group(2) or 1)
        period = count * _UNITS[m.group(3)]
        if limit < 1 or period <= 0:
            raise ValueError(f"{param}: {text!r} must allow at least 1 per a positive period")
        return cls(limit, period, text.strip())

    @property
    def interval_us(self) -> float:
        return self.period * 1e6 / self.limit

    def per(self) -> str:
        if self.period in (1.0, 60.0, 3600.0, 86400.0):
            return {1.0: "second", 60.0: "minute", 3600.0: "hour", 86400.0: "day"}[self.period]
        return f"{self.period:g} seconds"


class RateLimiter:
    """Requests and tokens per principal, decided in Redis (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, requests: Rate | None = None, tokens: Rate | None = None,
                 fail_closed: bool = False, backoff: float = 1.0, log_interval: float = 30.0,
                 prefix: str = KEY_PREFIX):
        self.client = client
        self.requests = requests
        self.tokens = tokens
        self.fail_closed = fail_closed
        self.backoff = backoff
        self.log_interval = log_interval
        self.prefix = prefix
        self.rejections: Counter[str] = Counter()  # refusals by limit: "requests", "tokens"
        self.redis_errors = 0  # failed Redis calls
        self.unchecked = 0  # admissions decided without Redis (failed open or closed)
        self._down_until = 0.0
        self._last_log = float("-inf")
        self._errors_since_log = 0

    @classmethod
    def from_url(cls, url: str, requests: Rate | None, tokens: Rate | None, **kw) -> "RateLimiter":
        """A limiter on the Redis at `url`, with short timeouts and no client-side retries (the
        limiter's own backoff decides when Redis is asked again)."""
        client = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5,
                                         retry=Retry(NoBackoff(), 0), retry_on_error=[])
        return cls(client, requests, tokens, **kw)

    @classmethod
    def from_args(cls, args) -> "RateLimiter | None":
        """From the gateway options (--rate-limit, --token-limit, --rate-limit-on-redis-error,
        --redis-url); None when no limit is set."""
        requests = Rate.parse(getattr(args, "rate_limit", None), "--rate-limit")
        tokens = Rate.parse(getattr(args, "token_limit", None), "--token-limit")
        if requests is None and tokens is None:
            return None
        mode = (getattr(args, "rate_limit_on_redis_error", None) or "open").strip().lower()
        if mode not in ("open", "closed"):
            raise ValueError(f"--rate-limit-on-redis-error must be open or closed, got {mode!r}")
        url = getattr(args, "redis_url", None)
        if not url:
            raise ValueError("--rate-limit and --token-limit keep their counters in Redis: set "
                             "--redis-url (REDIS_URL)")
        return cls.from_url(url, requests, tokens, fail_closed=mode == "closed")

    def describe(self) -> str:
        limits = [f"{r.limit} {n} per {r.per()}" for n, r in (("requests", self.requests),
                                                              ("tokens", self.tokens)) if r]
        return ", ".join(limits) + f" (fail {'closed' if self.fail_closed else 'open'} without Redis)"

    @property
    def enabled(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def keys(self, subject: str) -> dict[str, str]:
        """The Redis key of each limit of a subject ({subject} is a Redis Cluster hash tag, so
        the script's keys share a slot)."""
        return {name: f"{self.prefix}:{{{subject}}}:{name}" for name in ("requests", "tokens")}

    async def admit(self, subject: str, tokens: int, tokens_param: str = "max_tokens") -> None:
        """Charge one request of `tokens` tokens to `subject`, or raise a 429 ApiError with the
        seconds to wait (503 when Redis is down and the limiter fails closed)."""
        limits = [(name, rate, cost) for name, rate, cost in
                  (("requests", self.requests, 1), ("tokens", self.tokens, tokens)) if rate is not None]
        if not limits:
            return
        if self.tokens is not None and tokens > self.tokens.limit:
            self.rejections["tokens"] += 1
            raise ApiError(429, f"this request needs {tokens} tokens (prompt + {tokens_param}), more "
                           f"than the limit of {self.tokens.limit} tokens per {self.tokens.per()}; "
                           f"lower {tokens_param}", param=tokens_param, code="tokens_exceed_limit")
        if time.monotonic() < self._down_until:
            return self._unavailable(None)
        keys = self.keys(subject)
        argv: list[str] = []
        for _, rate, cost in limits:
            argv += [repr(rate.interval_us), repr(rate.period * 1e6), str(cost)]
        try:
            allowed, which, wait_us = await self._run([keys[name] for name, _, _ in limits], argv)
        except (RedisError, OSError) as e:
            self.redis_errors += 1
            self._down_until = time.monotonic() + self.backoff
            return self._unavailable(e)
        if allowed:
            return
        name, rate, _ = limits[int(which) - 1]
        self.rejections[name] += 1
        what = "requests" if name == "requests" else "tokens"
        raise ApiError(429, f"rate limit reached: {rate.limit} {what} per {rate.per()}; retry after "
                       f"{int(wait_us) / 1e6:.3f} s", code=f"rate_limit_{name}",
                       retry_after=int(wait_us) / 1e6)

    async def _run(self, keys: list[str], argv: list[str]):
        """The script by its digest (EVALSHA), loading it with EVAL when Redis lacks it."""
        try:
            return await self.client.evalsha(GCRA_SHA, len(keys), *keys, *argv)
        except NoScriptError:
            return await self.client.eval(GCRA_LUA, len(keys), *keys, *argv)

    def _unavailable(self, error: Exception | None) -> None:
        self.unchecked += 1
        self._errors_since_log += error is not None
        now = time.monotonic()
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            log.warning("Redis is unreachable for rate limits (%d failed calls since the last report; "
                        "last: %s); failing %s", self._errors_since_log, error or "backing off",
                        "closed (503)" if self.fail_closed else "open (requests pass unchecked)")
            self._errors_since_log = 0
        if self.fail_closed:
            raise ApiError(503, "the rate limiter is unavailable; retry later",
                           code="rate_limiter_unavailable", retry_after=self.backoff)

    async def close(self) -> None:
        await self.client.aclose()
