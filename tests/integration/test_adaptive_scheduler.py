"""The adaptive draft length in the scheduler service: lossless over gRPC, priors shared through
Redis between schedulers, and serving on without Redis."""

import asyncio
import time

import httpx
import pytest

from services.scheduler.priors import FLUSH_INTERVAL_S, Priors, StepRecord
from tests.integration.stack import Stack, free_port, stack_env
from tests.integration.test_services import PROMPTS, generate


def start_scheduler(tmp_path, home, stack, **env):
    """On the tiny models a draft hop costs more than a verify step, so adaptive alone would
    rightly decode plainly; a minimum of 1 keeps it drafting (k varies in [1, 4])."""
    st = Stack(tmp_path, stack_env(home, **env))
    metrics_port = free_port()
    sched = st.start("scheduler", "--target", str(stack.target), "--draft-addrs", stack.draft_addr,
                     "--verifier-addrs", stack.verifier_addr, "--draft-length", "adaptive",
                     "--min-draft-length", "1", "--max-draft-length", "4", "--metrics-port", str(metrics_port))
    st.wait_healthy(sched)
    return st, sched, f"http://127.0.0.1:{metrics_port}/metrics"


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.mark.parametrize("redis", ["up", "down"])
def test_adaptive_scheduler_streams_the_target_greedy_output(tmp_path, home, stack, redis_url, redis):
    url = redis_url if redis == "up" else "redis://127.0.0.1:1/0"  # nothing listens on port 1
    st, sched, metrics_url = start_scheduler(tmp_path, home, stack, REDIS_URL=url)
    try:
        async def run_all():
            return await asyncio.gather(*(generate(sched.addr, f"adaptive-{redis}-{i}", p, max_tokens=30)
                                          for i, p in enumerate(PROMPTS[:4])))

        for prompt, got in zip(PROMPTS[:4], asyncio.run(run_all())):
            assert got["token_ids"] == stack.engine_generate_ids(prompt, max_tokens=30)["token_ids"]
        assert "warm-up: verify ms" in sched.log.read_text()  # latency measured before serving
        m = scrape(metrics_url)
        steps = m["specserve:draft_length_chosen_count"]
        assert steps > 0 and m['specserve:draft_length_chosen_bucket{le="4.0"}'] == steps  # k <= max
        # k >= min, except where a request may emit at most one more token (nothing to draft)
        assert m['specserve:draft_length_chosen_bucket{le="0.0"}'] <= 4
        observed = m["specserve:adaptive_observed_tokens_total"]
        committed = sum(m[k] for k in m if k.startswith("specserve:generation_tokens_total"))
        assert committed <= observed <= committed + 4 * 4  # the last step of each may pass max_tokens
        assert m["specserve:adaptive_predicted_tokens_total"] > 0
        if redis == "down":  # degraded, said so (from a background write), and still served
            deadline = time.monotonic() + 10
            while "Redis unavailable" not in sched.log.read_text():
                assert time.monotonic() < deadline, sched.log_tail()
                time.sleep(0.1)
    finally:
        st.stop_all()


def test_priors_sum_fast_steps_into_few_writes_and_lose_none(redis_url):
    """Steps every 20 ms: their records reach Redis summed, in at most one write per
    FLUSH_INTERVAL_S, and the last step's record arrives too."""
    import redis

    async def scenario():
        t = Priors(redis_url, "pair-flush")
        writes, write = [], t._write

        async def counted(batch):
            writes.append(len(batch))
            await write(batch)

        t._write = counted
        started = time.monotonic()
        for _ in range(30):
            t.record(StepRecord("c", k=2, accepted=1, nodes=2, draft_ms=1.0, verify_ms=5.0))
            t.flush()
            await asyncio.sleep(0.02)
        await t._task
        elapsed = time.monotonic() - started
        await t.close()
        return writes, elapsed

    writes, elapsed = asyncio.run(scenario())
    assert sum(writes) == 30 and len(writes) <= 2 + elapsed / FLUSH_INTERVAL_S
    client = redis.Redis.from_url(redis_url)
    (key,) = client.scan_iter("specserve:accept:pair-flush:c:*")
    counts = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
    # depth 1 judged and accepted, depth 2 judged and rejected, every step
    assert counts == {"judged:1": 30, "accepted:1": 30, "judged:2": 30, "steps": 30, "tree_nodes": 60}


def test_schedulers_share_acceptance_priors_through_redis(redis_url):
    """Two schedulers of one model pair: what one learns about a request class is the other's
    prior for it; other classes and pairs are unaffected."""
    async def scenario():
        a, b = Priors(redis_url, "pair-x"), Priors(redis_url, "pair-x")
        other = Priors(redis_url, "pair-y")
        for _ in range(40):
            a.record(StepRecord("team-a", k=3, accepted=1, nodes=3, draft_ms=1.0, verify_ms=5.0))
        a.flush()
        await a._task
        b.record(StepRecord("team-a", k=1, accepted=1, nodes=1, draft_ms=1.0, verify_ms=5.0))
        b.flush()  # a write also reads the class's shared counts back
        await b._task
        other.record(StepRecord("team-a", k=1, accepted=0, nodes=1, draft_ms=1.0, verify_ms=5.0))
        other.flush()
        await other._task
        out = b.priors("team-a", 3), b.priors("team-b", 3), other.priors("team-a", 3)
        for t in (a, b, other):
            await t.close()
        return out

    shared, unseen, other_pair = asyncio.run(scenario())
    assert shared[0] == pytest.approx(41 / 41, abs=0.01)  # depth 1 always accepted
    assert shared[1] == pytest.approx(0.0, abs=0.01)  # depth 2 judged 40 times, never accepted
    assert shared[2] is None  # never reached
    assert unseen == [None, None, None]
    assert other_pair[0] is None  # one observation of its own, too few to trust
