"""Scheduler pieces that need no model: the acceptance priors without Redis, replica assignment,
a worker's sequences of the step protocol."""

import asyncio

from services.common.sampling import SamplingParams
from services.common.sequence import Sequences
from services.scheduler.priors import Priors, StepRecord
from services.scheduler.replicas import ReplicaSet


def test_priors_without_redis_keep_local_estimates():
    t = Priors(None, "pair", local_decay=1.0)
    for _ in range(30):
        t.record(StepRecord("chat", k=3, accepted=1, nodes=4, draft_ms=1.0, verify_ms=2.0))
    s = t.stats("chat")
    assert s.judged == {1: 30, 2: 30}  # depth 3 was never reached, so never judged
    assert s.accepted == {1: 30}
    assert s.rate(1) == 1.0 and s.rate(2) == 0.0 and s.rate(3) is None
    assert t.priors("chat", 3) == [1.0, 0.0, None]
    assert t.priors("code", 2) == [None, None]  # classes are kept apart


def test_priors_survive_an_unreachable_redis():
    async def scenario():
        t = Priors("redis://127.0.0.1:1/0", "pair")  # nothing listens on port 1
        t.record(StepRecord("default", k=1, accepted=1, nodes=1, draft_ms=1.0, verify_ms=1.0))
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


def test_sequence_offsets_resync_and_parameters_sent_once():
    seqs, greedy, sampled = Sequences(1), SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0)
    seq = seqs.update("r", 0, [1, 2, 3], greedy)
    assert seq.tokens == [1, 2, 3] and seq.params == greedy and seq.generator is None
    assert seqs.update("r", 3, [4]) is seq and seq.tokens == [1, 2, 3, 4]  # later items: no params
    assert seqs.update("r", 2, [9]).tokens == [1, 2, 9]  # a rebuilt request may rewrite the tail
    assert seqs.update("r", 7, [5]) is None  # never saw tokens 3..6: resync
    assert seqs.update("unknown", 4, [1]) is None
    again = seqs.update("r", 0, [1, 2], sampled)  # resent from 0 with other parameters: a fresh stream
    assert again.params == sampled and again.generator is not None
    seqs.release("r")
    assert "r" not in seqs
