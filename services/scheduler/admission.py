"""Admission control: a bounded queue and a KV-cache budget for one scheduler.

Every request reserves KV tokens for its whole life: prompt + max_tokens + the largest draft tree
one step may add (tree budget + 1 slots for the tree and its pending token). The verifier (and
the draft) keep that request's KV until it is released, so the reservations of the running
requests bound the KV memory its workers hold for this scheduler.

Rules (plain Python, no torch; the loop keeps its `waiting`/`running` lists in step with this):

- A request whose reservation alone exceeds the budget can never run: ValueError (-> 400,
  naming max_tokens).
- Requests start strictly first come, first served: the head of the queue starts when a batch
  slot is free and its reservation fits; nothing behind it may overtake it, so a stream of small
  requests cannot starve a big one (the price: a big head request can hold the queue until enough
  running requests finish).
- A new request that cannot start at the next step waits, unless `max_waiting` requests already
  wait for capacity: then `Overloaded` (-> RESOURCE_EXHAUSTED / HTTP 429 with Retry-After).
- A reservation is released when the request retires (finished, cancelled, failed).

Retry-After estimates when the requests waiting now will all have started: waiting / running x
the mean time a request holds its slot (an EMA over finished requests). Until one has finished,
a request is assumed to take one step per token of max_tokens (the running requests' mean) at
the recent step time; with no step yet, 1 s. The estimate is clamped to [1, MAX_RETRY_AFTER_S].
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

DEFAULT_KV_BUDGET_TOKENS = 65536  # see README "Overload": ~3 GB of fp32 KV for the default model
DEFAULT_MAX_WAITING = 64
MAX_RETRY_AFTER_S = 60.0
EMA_WEIGHT = 0.2  # weight of the newest observation in the step and service-time averages


class Overloaded(Exception):
    """The scheduler's queue is full; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def reservation(prompt_tokens: int, max_tokens: int, max_tree: int) -> int:
    """KV tokens a request may hold at most: its whole sequence plus one step's tree."""
    return prompt_tokens + max_tokens + max_tree + 1


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


class Admission:
    """The KV reservations of one scheduler's queued and running requests.

    `queued` mirrors the loop's waiting list (FCFS order), `reserved` its running list; `used` is
    the sum of `reserved` and never exceeds `budget_tokens`. `rejections` counts refusals by
    reason: queue_full, exceeds_kv_budget, shutting_down.
    """

    def __init__(self, budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_batch: int = 16, clock: Callable[[], float] = time.monotonic):
        if budget_tokens < 1:
            raise ValueError(f"--kv-budget-tokens must be >= 1, got {budget_tokens}")
        if max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        self.budget_tokens, self.max_waiting, self.max_batch = budget_tokens, max_waiting, max_batch
        self.clock = clock
        self.queued: OrderedDict[str, int] = OrderedDict()  # request id -> tokens, FCFS
        self.reserved: dict[str, int] = {}  # running request id -> tokens
        self.started: dict[str, float] = {}  # running request id -> when it started
        self.max_tokens: dict[str, int] = {}  # queued or running request id -> its max_tokens
        self.used = 0
        self.rejections: Counter[str] = Counter()
        self.step_s: float | None = None  # EMA of a step's wall time
        self.service_s: float | None = None  # EMA of the time a finished request held its slot

    # -- the queue ----------------------------------------------------------------------------
    def _startable(self) -> int:
        """How many queued requests, from the head, could start at the next step."""
        free, slots, n = self.budget_tokens - self.used, self.max_batch - len(self.reserved), 0
        for need in self.queued.values():
            if n >= slots or need > free:
                break
            free -= need
            n += 1
        return n

    def waiting_for_capacity(self) -> int:
        """Queued requests that cannot start at the next step."""
        return len(self.queued) - self._startable()

    def enqueue(self, req_id: str, tokens: int, max_tokens: int) -> None:
        """Queue a request reserving `tokens`; raises ValueError when it can never fit the budget,
        Overloaded when max_waiting requests already wait for capacity and it would wait too."""
        if req_id in self.queued or req_id in self.reserved:
            raise ValueError(f"request id {req_id!r} is already queued")
        if tokens > self.budget_tokens:
            self.rejections["exceeds_kv_budget"] += 1
            raise ValueError(f"max_tokens ({max_tokens}) is too large for this server: the request needs "
                             f"{tokens} KV tokens (prompt + max_tokens + one draft tree), more than the "
                             f"scheduler's budget of {self.budget_tokens} (--kv-budget-tokens)")
        self.queued[req_id] = tokens
        self.max_tokens[req_id] = max_tokens
        waiting = self.waiting_for_capacity()
        if waiting > self.max_waiting:  # it would wait, behind max_waiting others
            del self.queued[req_id], self.max_tokens[req_id]
            self.rejections["queue_full"] += 1
            retry = self.retry_after(waiting - 1)
            raise Overloaded(f"the scheduler is at capacity ({len(self.reserved)} running, {waiting - 1} "
                             f"waiting); retry in {math.ceil(retry)} s", retry)

    def admit(self, req_id: str) -> bool:
        """Start `req_id`, the head of the queue, if a batch slot is free and its reservation
        fits; False otherwise (it stays queued, and so does everyone behind it)."""
        head = next(iter(self.queued), None)
        if head != req_id:
            raise ValueError(f"{req_id!r} is not the head of the queue ({head!r}): requests start in order")
        tokens = self.queued[req_id]
        if len(self.reserved) >= self.max_batch or self.used + tokens > self.budget_tokens:
            return False
        del self.queued[req_id]
        self.reserved[req_id] = tokens
        self.started[req_id] = self.clock()
        self.used += tokens
        return True

    def release(self, req_id: str) -> None:
        """Forget a retired request, queued or running (a no-op for an unknown id)."""
        self.queued.pop(req_id, None)
        self.max_tokens.pop(req_id, None)
        tokens = self.reserved.pop(req_id, None)
        if tokens is not None:
            self.used -= tokens
            self.service_s = _ema(self.service_s, self.clock() - self.started.pop(req_id))

    # -- Retry-After --------------------------------------------------------------------------
    def record_step(self, seconds: float) -> None:
        self.step_s = _ema(self.step_s, seconds)

    def retry_after(self, waiting: int | None = None) -> float:
        """Seconds until the `waiting` requests (default: those waiting for capacity now) will
        all have started, by the recent time a request holds its slot."""
        waiting = self.waiting_for_capacity() if waiting is None else waiting
        per_request = self.service_s
        if per_request is None and self.step_s is not None:
            # Nothing finished yet: one token per step is the slowest a request can go.
            running = [self.max_tokens[r] for r in self.reserved] or list(self.max_tokens.values()) or [1]
            per_request = self.step_s * sum(running) / len(running)
        if per_request is None:
            return 1.0
        estimate = max(waiting, 1) * per_request / max(1, len(self.reserved))
        return min(MAX_RETRY_AFTER_S, max(1.0, estimate))
