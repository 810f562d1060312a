"""Admission control (services/scheduler/admission.py): KV reservations, the bounded queue, FCFS,
Retry-After; and the scheduler servicer's mapping of its refusals to gRPC statuses."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.common.settings import OPTIONS
from services.scheduler.admission import (DEFAULT_KV_BUDGET_TOKENS, DEFAULT_MAX_WAITING, MAX_RETRY_AFTER_S,
                                          Admission, Overloaded, reservation)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def start_all(adm: Admission) -> list[str]:
    """What the loop does before a step: start queue heads while they fit."""
    started = []
    while adm.queued:
        head = next(iter(adm.queued))
        if not adm.admit(head):
            break
        started.append(head)
    return started


def test_reservation_is_sequence_plus_one_tree():
    assert reservation(prompt_tokens=10, max_tokens=20, max_tree=5) == 36


def test_running_reservations_never_exceed_the_budget_and_are_released():
    adm = Admission(budget_tokens=100, max_waiting=10, max_batch=8)
    for rid in "abc":
        adm.enqueue(rid, 40, max_tokens=30)
    assert start_all(adm) == ["a", "b"]  # c (40) does not fit into the 20 left
    assert adm.used == 80 and list(adm.queued) == ["c"]
    adm.release("a")
    assert adm.used == 40
    assert start_all(adm) == ["c"] and adm.used == 80


def test_max_batch_bounds_the_running_requests():
    adm = Admission(budget_tokens=1000, max_waiting=10, max_batch=2)
    for rid in "abc":
        adm.enqueue(rid, 10, max_tokens=5)
    assert start_all(adm) == ["a", "b"] and list(adm.queued) == ["c"]


def test_first_come_first_served_small_requests_cannot_overtake_a_big_one():
    adm = Admission(budget_tokens=100, max_waiting=10, max_batch=8)
    adm.enqueue("small0", 30, max_tokens=10)
    assert start_all(adm) == ["small0"]
    adm.enqueue("big", 90, max_tokens=80)  # needs almost everything: waits for small0
    adm.enqueue("small1", 20, max_tokens=5)  # would fit now, but arrived after big
    assert start_all(adm) == []
    with pytest.raises(ValueError, match="head of the queue"):
        adm.admit("small1")
    adm.release("small0")
    assert start_all(adm) == ["big"]  # and small1 still waits behind it
    adm.release("big")
    assert start_all(adm) == ["small1"]


def test_a_request_larger_than_the_budget_is_a_400_naming_max_tokens():
    adm = Admission(budget_tokens=100, max_waiting=10, max_batch=8)
    with pytest.raises(ValueError) as e:
        adm.enqueue("huge", 101, max_tokens=90)
    assert str(e.value).startswith("max_tokens (90)") and "100" in str(e.value)
    assert adm.rejections["exceeds_kv_budget"] == 1 and not adm.queued
    adm.enqueue("exact", 100, max_tokens=90)  # exactly the budget fits
    assert start_all(adm) == ["exact"]


def test_queue_bound_counts_only_requests_waiting_for_capacity():
    adm = Admission(budget_tokens=1000, max_waiting=2, max_batch=2)
    for rid in "ab":  # both start at the next step: they do not count as waiting
        adm.enqueue(rid, 10, max_tokens=5)
    adm.enqueue("c", 10, max_tokens=5)
    adm.enqueue("d", 10, max_tokens=5)
    assert adm.waiting_for_capacity() == 2
    with pytest.raises(Overloaded) as e:
        adm.enqueue("e", 10, max_tokens=5)
    assert e.value.retry_after_s >= 1
    assert list(adm.queued) == ["a", "b", "c", "d"] and "e" not in adm.max_tokens
    assert adm.rejections["queue_full"] == 1
    start_all(adm)
    adm.release("a")  # a slot frees: c starts, so one more may wait
    start_all(adm)
    adm.enqueue("e", 10, max_tokens=5)
    assert list(adm.queued) == ["d", "e"]


def test_max_waiting_zero_refuses_whatever_cannot_start_at_once():
    adm = Admission(budget_tokens=1000, max_waiting=0, max_batch=1)
    adm.enqueue("a", 10, max_tokens=5)
    with pytest.raises(Overloaded):
        adm.enqueue("b", 10, max_tokens=5)


def test_cancelled_requests_free_their_place_and_reservation():
    adm = Admission(budget_tokens=100, max_waiting=1, max_batch=1)
    adm.enqueue("run", 50, max_tokens=10)
    start_all(adm)
    adm.enqueue("wait", 50, max_tokens=10)
    with pytest.raises(Overloaded):
        adm.enqueue("third", 50, max_tokens=10)
    adm.release("wait")  # cancelled while queued
    adm.release("run")  # cancelled while running
    assert adm.used == 0 and not adm.queued and not adm.reserved and not adm.max_tokens and not adm.started
    adm.enqueue("third", 50, max_tokens=10)
    adm.release("unknown")  # a no-op
    assert start_all(adm) == ["third"] and adm.used == 50


def test_random_workload_keeps_the_books_balanced():
    rng = random.Random(7)
    adm = Admission(budget_tokens=500, max_waiting=5, max_batch=4)
    live: set[str] = set()
    for n in range(2000):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            adm.release(rid)
            live.discard(rid)
        else:
            try:
                adm.enqueue(f"r{n}", rng.randint(1, 600), max_tokens=1)
                live.add(f"r{n}")
            except (ValueError, Overloaded):
                pass
        start_all(adm)
        assert adm.used == sum(adm.reserved.values()) <= 500
        assert len(adm.reserved) <= 4 and adm.waiting_for_capacity() <= 5
        assert set(adm.queued) | set(adm.reserved) == live == set(adm.max_tokens)
    assert adm.rejections["queue_full"] > 0 and adm.rejections["exceeds_kv_budget"] > 0


def test_retry_after_follows_the_queue_and_the_time_a_request_holds_its_slot():
    clock = Clock()
    adm = Admission(budget_tokens=1000, max_waiting=4, max_batch=2, clock=clock)
    assert adm.retry_after(4) == 1.0  # nothing measured yet
    adm.record_step(0.5)
    for rid in "ab":
        adm.enqueue(rid, 10, max_tokens=8)
    start_all(adm)
    # Nothing finished: one step (0.5 s) per max_token (8) per request; 4 waiting on 2 slots.
    assert adm.retry_after(4) == pytest.approx(4 * 0.5 * 8 / 2)
    clock.now = 3.0
    adm.release("a")  # held its slot 3 s
    assert adm.retry_after(4) == pytest.approx(4 * 3.0 / 1)
    assert adm.retry_after(1000) == MAX_RETRY_AFTER_S
    assert adm.retry_after(1) >= 1.0


def test_defaults_agree_with_the_settings_table():
    opts = {o.flag: o for o in OPTIONS}
    assert opts["--kv-budget-tokens"].default == str(DEFAULT_KV_BUDGET_TOKENS)
    assert opts["--max-waiting"].default == str(DEFAULT_MAX_WAITING)
    assert opts["--kv-budget-tokens"].roles == opts["--max-waiting"].roles == ("scheduler",)


@pytest.mark.parametrize("bad", [dict(budget_tokens=0), dict(max_waiting=-1), dict(max_batch=0)])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Admission(**bad)


# -- the scheduler loop keeps its queue and the books in step ------------------------------------
def make_loop(**kw):
    """A scheduler loop whose replicas are never reached (no step runs; channels connect lazily)."""
    from services.common.metrics import Registry, SchedulerMetrics
    from services.common.tracing import RequestSpans
    from services.scheduler.core import StepConfig, StepCore, Target
    from services.scheduler.loop import SchedulerLoop
    from services.scheduler.replicas import RemoteWorkers
    from tests import tiny

    core = StepCore(StepConfig(draft_length=2, tree_size=3, **kw), Target(tiny.make_tokenizer(64), (2,), 512, 64),
                    RemoteWorkers("verifier", ["127.0.0.1:1"]), RemoteWorkers("draft", ["127.0.0.1:2"]))
    return SchedulerLoop(core, SchedulerMetrics(Registry("scheduler")), RequestSpans("test"))


def test_loop_reserves_prompt_max_tokens_and_a_tree_and_releases_on_cancel():
    from services.common.sampling import SamplingParams

    async def go():
        loop = make_loop(max_batch=1, kv_budget_tokens=100, max_waiting=1)
        core = loop.core
        loop.submit("a", [5, 6, 7], SamplingParams(max_tokens=20))
        assert core.admission.queued == {"a": 3 + 20 + 3 + 1}
        loop.submit("b", [5], SamplingParams(max_tokens=10))
        # "a" starts at the next step, "b" waits: one more cannot.
        with pytest.raises(Overloaded):
            loop.submit("c", [5], SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="^max_tokens"):
            loop.submit("d", [5] * 10, SamplingParams(max_tokens=90))
        assert [r.req_id for r in core.waiting] == list(core.admission.queued) == ["a", "b"]
        assert set(core.by_id) == set(loop.lives) == {"a", "b"}
        loop.cancel("a")
        loop.cancel("b")
        assert not core.admission.queued and not core.by_id and not loop.lives and core.admission.used == 0
        loop.submit("c", [5], SamplingParams(max_tokens=10))
        assert core.admission.rejections == {"queue_full": 1, "exceeds_kv_budget": 1}
        await core.verifiers.close()
        await core.drafts.close()

    asyncio.run(go())


# -- the servicer's statuses ----------------------------------------------------------------------
class AbortCalled(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.aborted = None

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details, metadata=()):
        self.aborted = (code, details, tuple(metadata))
        raise AbortCalled


class RefusingLoop:
    def __init__(self, error: Exception):
        self.error = error

    def submit(self, *a, **kw):
        raise self.error


@pytest.mark.parametrize("error,code,retry", [
    (Overloaded("full", 2.2), grpc.StatusCode.RESOURCE_EXHAUSTED, "3"),
    (ValueError("max_tokens (9) is too large"), grpc.StatusCode.INVALID_ARGUMENT, None),
    (RuntimeError("scheduler is shutting down"), grpc.StatusCode.UNAVAILABLE, "1"),
])
def test_servicer_maps_refusals_to_statuses_with_retry_after(error, code, retry):
    from services.scheduler.servicer import SchedulerServicer
    from specserve.v1 import common_pb2, scheduler_pb2

    servicer = SchedulerServicer(RefusingLoop(error), common_pb2.InfoResponse())
    ctx = FakeContext()
    request = scheduler_pb2.GenerateRequest(request_id="r", prompt_ids=[1],
                                            params=common_pb2.SamplingParams(max_tokens=4))

    async def go():
        with pytest.raises(AbortCalled):
            async for _ in servicer.Generate(request, ctx):
                pass

    asyncio.run(go())
    got_code, details, metadata = ctx.aborted
    assert got_code == code and details == str(error)
    assert dict(metadata).get("retry-after") == retry
