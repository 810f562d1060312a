"""Bad days on the multi-replica topology: Redis down and back, 200 streams abandoned by their
clients, client deadlines. Serving goes on, nothing is lost, no request state is left behind."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import httpx

from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.stack import Stack, free_port, stack_env
from tests.integration.topology import (API_KEY, LONG, PROMPT, Topology, complete, no_state_left, record,
                                        reference, wait_until)

SHORT = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
RATE = 4  # requests per minute on the rate-limited gateway of the Redis test


def telemetry_keys(topo: Topology) -> list:
    return list(topo.redis.client().scan_iter("specserve:accept:*"))


def limited_gateway(topo: Topology, tmp_path, home) -> tuple[Stack, str]:
    """A third gateway with a request rate limit in the topology's Redis."""
    st = Stack(tmp_path, stack_env(home, REDIS_URL=topo.redis.url, SPECSERVE_API_KEYS=API_KEY,
                                   SPECSERVE_METRICS_PORT="0"))
    http_port = free_port()
    sched_addrs = ",".join(s.addr for s in topo.services("scheduler"))
    target = topo.services("scheduler")[0].args[1]
    gw = st.start("gateway", "--target", target, "--http-port", str(http_port), "--scheduler-addrs", sched_addrs,
                  "--rate-limit", f"{RATE}/m")
    st.wait_healthy(gw)
    return st, f"http://127.0.0.1:{http_port}"


def test_redis_down_and_back(topology, tmp_path, home):
    topology.heal()
    want = reference(topology)
    st, limited = limited_gateway(topology, tmp_path, home)
    try:
        # Up: the limit holds, telemetry is written.
        codes = [complete(limited, SHORT, topology.headers).status_code for _ in range(RATE + 1)]
        assert codes == [200] * RATE + [429]
        assert telemetry_keys(topology)
        # Down: every request is served (rate limits fail open), with the same tokens.
        topology.redis.stop()
        down_at = time.monotonic()
        for i in range(4):
            r = complete(topology.http_url(i % 2), LONG, topology.headers)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        unchecked = [complete(limited, SHORT, topology.headers).status_code for _ in range(3)]
        assert unchecked == [200] * 3, "with Redis down the limiter must fail open"
        # Back (empty, as after a Redis restart): both recover on their own.
        topology.redis.start()
        back_at = time.monotonic()

        def limited_again() -> bool:
            return complete(limited, SHORT, topology.headers).status_code == 429

        limit_s = wait_until(limited_again, 30, "the rate limit holding again", interval=0.05)

        def telemetry_again() -> bool:
            assert complete(topology.http_url(0), SHORT, topology.headers).status_code == 200
            return bool(telemetry_keys(topology))

        telemetry_s = wait_until(telemetry_again, 30, "telemetry written again", interval=0.1)
        record("Redis SIGKILL, restarted empty", client_saw="every request served (rate limits open)",
               tokens_lost=0, outage_s=round(back_at - down_at, 1),
               rate_limit_back_after_s=round(limit_s, 2), telemetry_back_after_s=round(telemetry_s, 2))
    finally:
        st.stop_all()
    log = st.services["gateway"][0].log.read_text()
    assert "Redis is unreachable for rate limits" in log
    no_state_left(topology)


async def abandon(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """Open a stream and walk away after a random moment (before or after the first chunk)."""
    body = {**LONG, "stream": True, "max_tokens": rng.randint(20, 200)}
    try:
        async with asyncio.timeout(rng.uniform(0.05, 1.5)):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        return "finished"
    except TimeoutError:
        return "abandoned"


def test_two_hundred_abandoned_streams_leave_nothing_behind(topology):
    topology.heal()
    started = time.monotonic()
    reference(topology)
    normal_s = time.monotonic() - started
    rng = random.Random(9)

    async def crowd():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(headers=topology.headers, limits=limits, timeout=60) as client:
            return await asyncio.gather(*(abandon(client, topology.http_url(i % 2), rng) for i in range(200)))

    outcomes = asyncio.run(crowd())
    assert outcomes.count("abandoned") >= 150, outcomes.count("abandoned")
    freed_s = wait_until(lambda: not topology.leftover_state(), 20, "every abandoned request freed", interval=0.1)
    start = time.monotonic()
    r = complete(topology.http_url(0), LONG, topology.headers)
    after_s = time.monotonic() - start
    assert r.status_code == 200
    assert after_s < 3 * normal_s + 2, f"{after_s:.2f} s after the crowd vs {normal_s:.2f} s before"
    no_state_left(topology)
    record("200 streams abandoned by their clients", client_saw="-", tokens_lost=0,
           abandoned=outcomes.count("abandoned"), state_freed_after_s=round(freed_s, 2),
           next_request_s=round(after_s, 2), normal_request_s=round(normal_s, 2))


def test_a_client_deadline_ends_the_request_everywhere(topology):
    topology.heal()

    async def go():
        async with grpc.aio.insecure_channel(topology.services("gateway")[0].addr) as ch:
            stub = gateway_pb2_grpc.GenerationStub(ch)
            req = gateway_pb2.TextRequest(prompt=PROMPT, params=common_pb2.SamplingParams(max_tokens=200,
                                                                                         ignore_eos=True))
            meta = (("authorization", f"Bearer {API_KEY}"),)
            # Twelve at once, so the batch is slow enough for a 0.3 s deadline to cut them off.
            calls = [stub.Generate(req, metadata=meta, timeout=0.3) for _ in range(12)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(go())
    codes = [r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK for r in results]
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    no_state_left(topology)
