"""The scheduler, draft and verifier as real processes over gRPC."""

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specserve.v1 import common_pb2, draft_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2_grpc
from tests.integration.stack import Stack, grpc_health, stack_env

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10], [11, 12, 13, 14, 15, 16, 17], [3], [20, 21, 20, 21, 20], [30, 31, 32],
           [40, 41, 42, 43], [50, 51, 52, 53, 54, 55, 56, 57, 58]]


async def generate(addr: str, request_id: str, prompt: list[int], fixed: dict | None = None, **params) -> dict:
    """`fixed`: the request's own draft_length and tree_size, if any."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        req = scheduler_pb2.GenerateRequest(request_id=request_id, prompt_ids=prompt,
                                            params=common_pb2.SamplingParams(**params), **(fixed or {}))
        tokens, text, events = [], "", 0
        async for ev in stub.Generate(req, timeout=120):
            tokens += ev.token_ids
            text += ev.text
            events += 1
            if ev.finish_reason:
                return {"token_ids": tokens, "text": text, "finish_reason": ev.finish_reason, "usage": ev.usage,
                        "events": events}
    raise AssertionError("stream ended without a finish reason")


def state(addr: str, stub_cls) -> common_pb2.StateResponse:
    with grpc.insecure_channel(addr) as ch:
        return stub_cls(ch).State(common_pb2.StateRequest(), timeout=5)


@pytest.mark.parametrize("params", [dict(max_tokens=24), dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7),
                                    dict(max_tokens=16, temperature=1.3, top_k=10, seed=123)])
def test_scheduler_stream_equals_in_process_engine(stack, params):
    for i, prompt in enumerate(PROMPTS[:3]):
        got = asyncio.run(generate(stack.scheduler_addr, f"eq-{params.get('seed')}-{i}", prompt, **params))
        want = stack.engine_generate_ids(prompt, **params)
        assert got["token_ids"] == want["token_ids"]
        assert got["text"] == want["text"]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["events"] > 1  # streamed step by step, not in one piece
        assert got["usage"].completion_tokens == len(want["token_ids"])


def test_concurrent_requests_share_steps(stack):
    async def all_of_them():
        return await asyncio.gather(*(generate(stack.scheduler_addr, f"conc-{i}", p, max_tokens=10 + 3 * i)
                                      for i, p in enumerate(PROMPTS)))

    results = asyncio.run(all_of_them())
    for i, (prompt, got) in enumerate(zip(PROMPTS, results)):
        assert got["token_ids"] == stack.engine_generate_ids(prompt, max_tokens=10 + 3 * i)["token_ids"]
    assert state(stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub).max_batch_seen > 1
    assert state(stack.scheduler_addr, scheduler_pb2_grpc.SchedulerServiceStub).max_batch_seen > 1


def test_disconnect_frees_state_everywhere_within_a_second(stack):
    rid = "disconnect-me"

    async def start_and_abandon():
        ch = grpc.aio.insecure_channel(stack.scheduler_addr)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        call = stub.Generate(scheduler_pb2.GenerateRequest(
            request_id=rid, prompt_ids=[5, 6, 7], params=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)))
        await call.read()  # the request is running
        held = [rid in state(a, s).request_ids for a, s in (
            (stack.scheduler_addr, scheduler_pb2_grpc.SchedulerServiceStub),
            (stack.draft_addr, draft_pb2_grpc.DraftServiceStub),
            (stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub))]
        call.cancel()
        await ch.close()
        return held

    assert asyncio.run(start_and_abandon()) == [True, True, True]
    deadline = time.monotonic() + 1.0
    stubs = [(stack.scheduler_addr, scheduler_pb2_grpc.SchedulerServiceStub),
             (stack.draft_addr, draft_pb2_grpc.DraftServiceStub),
             (stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub)]
    while True:
        left = [a for a, s in stubs if rid in state(a, s).request_ids]
        if not left:
            break
        assert time.monotonic() < deadline, f"still held after 1 s by {left}"
        time.sleep(0.02)
    assert state(stack.verifier_addr, verifier_pb2_grpc.VerifierServiceStub).kv_cache_bytes == 0


def test_bad_request_is_invalid_argument(stack):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate(stack.scheduler_addr, "too-long", [5, 6], max_tokens=100000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the context" in err.value.details()


def test_sigterm_drains_in_flight_requests(tmp_path, home, stack):
    """A scheduler of its own (on the shared workers): SIGTERM turns health NOT_SERVING, the
    request in flight still completes, and the process exits cleanly."""
    st = Stack(tmp_path, stack_env(home))
    # Plain decoding (k=0): one token per step, so the request stays in flight long enough.
    sched = st.start("scheduler", "--target", str(stack.target), "--draft-addrs", stack.draft_addr,
                     "--verifier-addrs", stack.verifier_addr, "--draft-length", "0")
    try:
        st.wait_healthy(sched)

        async def scenario():
            async with grpc.aio.insecure_channel(sched.addr) as ch:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
                call = stub.Generate(scheduler_pb2.GenerateRequest(
                    request_id="drain-me", prompt_ids=[5, 6, 7],
                    params=common_pb2.SamplingParams(max_tokens=240, ignore_eos=True)), timeout=120)
                first = await call.read()  # the request is running
                sched.proc.send_signal(signal.SIGTERM)
                # Poll health from a thread while this loop keeps reading the stream.
                statuses = asyncio.create_task(asyncio.to_thread(poll_until_not_serving, sched.addr))
                tokens, finish = list(first.token_ids), first.finish_reason
                while not finish:
                    ev = await call.read()
                    assert ev is not grpc.aio.EOF, "stream ended without a finish reason"
                    tokens += ev.token_ids
                    finish = ev.finish_reason
                return tokens, finish, await statuses

        tokens, finish, statuses = asyncio.run(scenario())
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, statuses
        assert finish == "length" and len(tokens) == 240
        assert sched.proc.wait(30) == 0
    finally:
        st.stop_all()


def poll_until_not_serving(addr: str) -> list:
    statuses = []
    for _ in range(100):
        statuses.append(grpc_health(addr, timeout=0.5))
        if statuses[-1] in (health_pb2.HealthCheckResponse.NOT_SERVING, None):
            break
        time.sleep(0.01)
    return statuses


def test_telemetry_reaches_redis(stack, redis_url):
    import redis

    asyncio.run(generate(stack.scheduler_addr, "telemetry", PROMPTS[0], max_tokens=12))
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 5
    while True:
        keys = list(client.scan_iter("specserve:accept:*:default:*"))
        if keys and int(client.hget(keys[0], "judged:1") or 0) > 0:
            break
        assert time.monotonic() < deadline, f"no acceptance telemetry in Redis: {keys}"
        time.sleep(0.1)
    fields = {k.decode() for k in client.hkeys(keys[0])}
    assert {"judged:1", "steps", "tree_nodes"} <= fields
    assert 0 < client.ttl(keys[0]) <= 30 * 60  # time buckets fade out
    latency = list(client.scan_iter("specserve:latency:*"))
    assert latency and float(client.hget(latency[0], "verify_ms_sum")) > 0


def test_redis_outage_never_fails_a_request(tmp_path, home, stack):
    """A scheduler whose Redis is unreachable still serves, with the same tokens."""
    st = Stack(tmp_path, stack_env(home, REDIS_URL="redis://127.0.0.1:9/0"))
    sched = st.start("scheduler", "--target", str(stack.target), "--draft-addrs", stack.draft_addr,
                     "--verifier-addrs", stack.verifier_addr, "--draft-length", "3", "--tree-size", "5")
    try:
        st.wait_healthy(sched)
        got = asyncio.run(generate(sched.addr, "no-redis", PROMPTS[2], max_tokens=20))
        assert got["token_ids"] == stack.engine_generate_ids(PROMPTS[2], max_tokens=20)["token_ids"]
    finally:
        st.stop_all()
    assert "Redis unavailable" in sched.log.read_text()


@pytest.mark.parametrize("params", [dict(max_tokens=30), dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)])
def test_local_ngram_draft_equals_in_process_engine(tmp_path, home, stack, params):
    """`--draft-addrs local`: the scheduler drafts by n-gram lookup itself (no draft service at
    all) and streams what the in-process engine with the same proposer yields."""
    from services.common.sampling import SamplingParams
    from services.draft.ngram import NgramProposer
    from services.scheduler.core import StepConfig
    from services.scheduler.engine import Engine

    st = Stack(tmp_path, stack_env(home))
    sched = st.start("scheduler", "--target", str(stack.target), "--draft-addrs", "local",
                     "--verifier-addrs", stack.verifier_addr, "--draft-length", "3")
    try:
        st.wait_healthy(sched)
        engine = Engine(stack.engine.target, NgramProposer(), StepConfig(draft_length=3))
        drafted = 0
        for i, prompt in enumerate([PROMPTS[0], PROMPTS[4]]):
            got = asyncio.run(generate(sched.addr, f"local-{params.get('seed')}-{i}", prompt, **params))
            want = engine.generate([prompt], SamplingParams(**params))[0]
            assert got["token_ids"] == want.output_ids
            drafted += got["usage"].drafted_tokens
        assert drafted > 0  # the repeating prompts give the lookup something to propose
    finally:
        st.stop_all()


def test_the_verifier_route_step_reaches_the_scheduler_cost_model(tmp_path, home, stack):
    """The verifier reports its matmul route step (fixed here by SPECSERVE_MATMUL_SMALL_ROWS, timed
    at load otherwise) in Info, and the scheduler's warm-up fits its latency model with it."""
    st = Stack(tmp_path, stack_env(home, SPECSERVE_MATMUL_SMALL_ROWS="2"))
    verifier = st.start("verifier", "--target", str(stack.target))
    try:
        st.wait_healthy(verifier)
        with grpc.insecure_channel(verifier.addr) as ch:
            info = verifier_pb2_grpc.VerifierServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
        assert info.route_rows == 2
        sched = st.start("scheduler", "--target", str(stack.target), "--draft-addrs", "local",
                         "--verifier-addrs", verifier.addr)
        st.wait_healthy(sched)
        # the warm-up line: verify ms = w . [1, batch, nodes, rows > 2, row curve (...)]
        assert "nodes, rows > 2, row curve" in sched.log.read_text()
    finally:
        st.stop_all()
