"""Prometheus metrics of the four services, scraped after real requests: the speculative-decoding
counters agree with each other and with the usage the API returned; latencies, queue and KV
gauges, HTTP statuses, auth failures and rate-limit rejections are counted."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests import tiny
from tests.integration.stack import Stack, free_port, stack_env

API_KEY = "sk-metrics-test"
RATE = 6  # requests per minute per key: the test sends exactly this many good requests
PROMPTS = ["w5 w6 w7 w8 w5 w6", "w9 w10", "w11 w12 w13 w14", "w20 w21 w20 w21", "w30", "w40 w41 w42"]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels) -> float:
    """Sum over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.fixture(scope="module")
def metered(tmp_path_factory, home, redis_url):
    root = tmp_path_factory.mktemp("metered")
    target = tiny.make_checkpoint(root / "target", seed=1)
    draft = tiny.make_checkpoint(root / "draft", seed=2, noise_from=target, noise_std=0.08)
    env = stack_env(home, REDIS_URL=redis_url, SPECSERVE_API_KEYS=API_KEY)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    st = Stack(root, env)
    ports = {role: free_port() for role in ("scheduler", "draft", "verifier")}
    try:
        verifier = st.start("verifier", "--target", str(target), "--metrics-port", str(ports["verifier"]))
        drafter = st.start("draft", "--target", str(target), "--draft", str(draft),
                           "--metrics-port", str(ports["draft"]))
        st.wait_healthy(verifier)
        st.wait_healthy(drafter)
        sched = st.start("scheduler", "--target", str(target), "--draft-addrs", drafter.addr,
                         "--verifier-addrs", verifier.addr, "--draft-length", "3", "--tree-size", "5",
                         "--metrics-port", str(ports["scheduler"]))
        st.wait_healthy(sched)
        http_port = free_port()
        gateway = st.start("gateway", "--target", str(target), "--scheduler-addrs", sched.addr,
                           "--http-port", str(http_port), "--rate-limit", f"{RATE}/m")
        st.wait_healthy(gateway)
        urls = {role: f"http://127.0.0.1:{p}/metrics" for role, p in ports.items()}
        urls["gateway"] = f"http://127.0.0.1:{http_port}/metrics"
        yield f"http://127.0.0.1:{http_port}", urls, sched.addr
    finally:
        st.stop_all()


def completion(url: str, prompt: str, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})


def test_metrics_move_consistently_after_requests(metered):
    url, urls, _ = metered
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: they share steps
        responses = list(pool.map(lambda p: completion(url, p), PROMPTS))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text for r in responses]
    usage = [r.json()["usage"] for r in responses]
    assert completion(url, "w5", key=None).status_code == 401
    assert completion(url, "w5", key="sk-wrong").status_code == 401
    limited = completion(url, "w5")  # the key's RATE requests this minute are spent
    assert limited.status_code == 429, limited.text
    time.sleep(0.5)  # the workers free the finished requests with the scheduler's next message

    s = scrape(urls["scheduler"])
    drafted, accepted = sum(u["drafted_tokens"] for u in usage), sum(u["accepted_tokens"] for u in usage)
    steps, n = sum(u["steps"] for u in usage), len(usage)
    assert drafted > 0 and 0 < accepted <= drafted
    assert value(s, "specserve:spec_decode_num_draft_tokens_total") == drafted
    assert value(s, "specserve:spec_decode_num_accepted_tokens_total") == accepted
    assert 0 < value(s, "specserve:spec_decode_num_drafts_total") <= steps
    per_pos = [value(s, "specserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # reaching position i means accepting 0..i-1
    assert value(s, "specserve:scheduler_steps_total") >= max(u["steps"] for u in usage)
    assert value(s, "specserve:generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 12 * n
    assert value(s, "specserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert value(s, "specserve:request_success_total", finished_reason="length") == n
    assert value(s, "specserve:time_to_first_token_seconds_count") == n
    assert value(s, "specserve:e2e_request_latency_seconds_count") == n
    assert value(s, "specserve:inter_token_latency_seconds_count") == steps - n  # one gap per later step
    assert value(s, "specserve:time_to_first_token_seconds_sum") <= \
        value(s, "specserve:e2e_request_latency_seconds_sum")
    assert value(s, "specserve:num_requests_running") == 0 and value(s, "specserve:num_requests_waiting") == 0

    for role in ("draft", "verifier"):
        w = scrape(urls[role])
        assert value(w, "specserve:worker_step_duration_seconds_count") > 0, role
        assert value(w, "specserve:kv_cache_usage_bytes") == 0, role  # everything was released
        assert value(w, "specserve:worker_requests") == 0, role
    # The verifier verified every request at every step: its batch sizes add up to the steps.
    assert value(scrape(urls["verifier"]), "specserve:worker_batch_size_sum") == steps

    g = scrape(urls["gateway"])
    assert value(g, "specserve:http_requests_total", route="/v1/completions", status="200") == n
    assert value(g, "specserve:http_requests_total", route="/v1/completions", status="401") == 2
    assert value(g, "specserve:http_requests_total", route="/v1/completions", status="429") == 1
    assert total(g, "specserve:auth_failures_total") == 2
    assert value(g, "specserve:rate_limit_rejections_total", limit="requests") == 1
    assert value(g, "specserve:http_request_duration_seconds_count", route="/v1/completions") == n + 3


def test_gauges_while_a_request_runs(metered):
    """A long request, straight to the scheduler: it is counted as running, and the workers hold
    KV cache for it until it is cancelled."""
    _, urls, sched_addr = metered

    async def run():
        async with grpc.aio.insecure_channel(sched_addr) as ch:
            call = scheduler_pb2_grpc.SchedulerServiceStub(ch).Generate(scheduler_pb2.GenerateRequest(
                request_id="metrics-long", prompt_ids=[5, 6, 7],
                params=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)))
            await call.read()
            await call.read()  # two steps in: every worker holds the request
            during = (scrape(urls["scheduler"]), scrape(urls["draft"]), scrape(urls["verifier"]))
            call.cancel()
        return during

    s, d, v = asyncio.run(run())
    assert value(s, "specserve:num_requests_running") == 1
    assert value(v, "specserve:kv_cache_usage_bytes") > 0 and value(v, "specserve:worker_requests") == 1
    assert value(d, "specserve:kv_cache_usage_bytes") > 0  # the draft model's cache
    assert value(v, "specserve:model_weight_bytes") > 0 and value(d, "specserve:model_weight_bytes") > 0
    deadline = time.monotonic() + 5
    while value(scrape(urls["verifier"]), "specserve:kv_cache_usage_bytes") > 0:
        assert time.monotonic() < deadline, "the verifier kept the cancelled request's KV cache"
        time.sleep(0.1)
    assert value(scrape(urls["scheduler"]), "specserve:request_success_total", finished_reason="abort") == 1
