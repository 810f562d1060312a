"""Scheduler pieces that need no model: telemetry without Redis, replica assignment, the token
ledger of the step protocol."""

import asyncio

from services.common.ledger import TokenLedger
from services.scheduler.telemetry import StepRecord, Telemetry
from services.scheduler.workers import ReplicaSet


def test_telemetry_without_redis_keeps_local_estimates():
    t = Telemetry(None, "pair", local_decay=1.0)
    for _ in range(30):
        t.record(StepRecord("chat", depth=3, accepted=1, nodes=4, draft_ms=1.0, verify_ms=2.0))
    s = t.stats("chat")
    assert s.judged == {1: 30, 2: 30}  # depth 3 was never reached, so never judged
    assert s.accepted == {1: 30}
    assert s.rate(1) == 1.0 and s.rate(2) == 0.0 and s.rate(3) is None
    assert t.priors("chat", 3) == [1.0, 0.0, None]
    assert t.priors("code", 2) == [None, None]  # classes are kept apart


def test_telemetry_survives_an_unreachable_redis():
    async def scenario():
        t = Telemetry("redis://127.0.0.1:1/0", "pair")  # nothing listens on port 1
        t.record(StepRecord("default", depth=1, accepted=1, nodes=1, draft_ms=1.0, verify_ms=1.0))
        t.flush()
        await asyncio.wait_for(t._task, 5)
        await t.close()
        return t

    t = asyncio.run(scenario())
    assert t.redis_errors == 1 and t.stats().judged == {1: 1}


def test_requests_stick_to_a_replica_and_spread_across_replicas():
    async def scenario():
        rs = ReplicaSet("verifier", ["127.0.0.1:1", "127.0.0.1:2"])
        a, b, c = rs.assign("a"), rs.assign("b"), rs.assign("c")
        assert a is not b and rs.assign("a") is a and rs.assign("b") is b
        assert {len(r.requests) for r in rs.replicas} == {1, 2} and c in rs.replicas
        rs.forget("a")
        assert "a" not in a.requests
        a.down_since = 1e18  # marked down just now: new and moved requests avoid it
        moved = rs.assign("c") if c is a else rs.assign("a")
        assert moved is not a
        await rs.close()
        # One request at a time (each finished before the next) still visits every replica.
        rs = ReplicaSet("draft", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        used = set()
        for i in range(3):
            used.add(rs.assign(f"seq-{i}"))
            rs.forget(f"seq-{i}")
        assert used == set(rs.replicas)
        await rs.close()

    asyncio.run(scenario())


def test_token_ledger_offsets_and_resync():
    led = TokenLedger()
    assert led.update("r", 0, [1, 2, 3]) == [1, 2, 3]
    assert led.update("r", 3, [4]) == [1, 2, 3, 4]
    assert led.update("r", 2, [9]) == [1, 2, 9]  # a rebuilt request may rewrite the tail
    assert led.update("r", 7, [5]) is None  # never saw tokens 3..6: resync
    assert led.update("unknown", 4, [1]) is None
    led.release("r")
    assert "r" not in led
