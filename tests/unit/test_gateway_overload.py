"""Overload at the gateway: the scheduler's retry hint reaches HTTP and gRPC clients, and the
in-flight cap (--max-concurrent-requests) refuses with 503 + Retry-After and is released on every
path (success, error, refusal, client disconnect, stream cancel)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway.app import create_app
from services.gateway.core import InFlight, input_limits
from tests.unit.test_gateway_grpc import AUTH, public_api, text_request
from tests.unit.test_gateway_http import _asgi_post, assert_openai_error, make_gateway, run
from tests.unit.test_gateway_scheduler_client import FakeScheduler, running_fake


class RefusingScheduler(FakeScheduler):
    """Refuses every request as a full scheduler does: RESOURCE_EXHAUSTED, retry-after 7."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the scheduler is at capacity",
                            (("retry-after", "7"),))
        yield  # an async generator, like the real servicer


def test_scheduler_retry_after_reaches_http_clients_and_is_counted():
    async def s(client, fake, gw):
        return (await client.post("/v1/completions", json={"prompt": "w5"}),
                await client.post("/v1/completions", json={"prompt": "w5", "stream": True}),
                await client.post("/infer", json={"input": "w5"}),
                (await client.get("/metrics")).text)
    *responses, metrics = run(s, RefusingScheduler())
    for r in responses:
        assert_openai_error(r, 429, code="scheduler_overloaded")
        assert r.headers["retry-after"] == "7"
    assert 'specserve:requests_rejected_total{reason="scheduler_overloaded"} 3.0' in metrics


def test_scheduler_retry_after_reaches_grpc_clients():
    async def go():
        async with public_api(RefusingScheduler()) as (stub, _, servicer):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(text_request(max_tokens=2), metadata=AUTH, timeout=10)
            return e.value, servicer.gateway.rejections
    err, rejections = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.trailing_metadata())["retry-after"] == "7"
    assert rejections == {"scheduler_overloaded": 1}


def test_unreachable_scheduler_503_has_retry_after():
    async def s(client, fake, gw):
        return await client.post("/v1/completions", json={"prompt": "w5"}), gw.inflight.active
    r, active = run(s, dead=True)
    assert_openai_error(r, 503, code="scheduler_unavailable")
    assert r.headers["retry-after"] == "1" and active == 0


def test_http_cap_refuses_past_the_limit_and_frees_slots_on_every_path():
    async def s(client, fake, gw):
        gw.inflight = InFlight(2)
        fake.delay = 0.05
        # Two streams hold both slots until their last event (8 tokens x 50 ms).
        held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 8,
                                                                          "stream": True})) for _ in range(2)]
        while gw.inflight.active < 2:
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
        refused_infer = await client.post("/infer", json={"input": "w5"})
        streams = await asyncio.gather(*held)
        after_streams = gw.inflight.active
        fake.delay = 0.0
        ok = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        bad = await client.post("/v1/completions", json={"prompt": "w5", "temperature": 9})  # 400, no scheduler
        fake.error_after = 0
        failed = await client.post("/v1/completions", json={"prompt": "w5"})  # error event: 500
        failed_stream = await client.post("/v1/completions", json={"prompt": "w5", "stream": True})
        fake.error_after = None
        return refused, refused_infer, streams, after_streams, (ok, bad, failed, failed_stream), gw
    refused, refused_infer, streams, after_streams, others, gw = run(s)
    for r in (refused, refused_infer):
        assert_openai_error(r, 503, code="gateway_overloaded")
        assert r.headers["retry-after"] == "1"
    assert [r.status_code for r in streams] == [200, 200] and all(r.text.endswith("[DONE]\n\n") for r in streams)
    assert after_streams == 0
    assert [r.status_code for r in others] == [200, 400, 500, 500]
    assert gw.inflight.active == 0
    assert gw.rejections == {"gateway_overloaded": 2}


@pytest.mark.parametrize("stream", [True, False])
def test_http_client_disconnect_frees_the_slot(stream):
    async def go():
        async with running_fake(FakeScheduler(delay=0.05)) as (fake, addr):
            gw = make_gateway([addr])
            gone = asyncio.Event()

            async def disconnect_soon():
                while not fake.requests:
                    await asyncio.sleep(0.01)
                during = gw.inflight.active
                await asyncio.sleep(0.2)
                gone.set()
                return during

            watcher = asyncio.create_task(disconnect_soon())
            await _asgi_post(create_app(gw), "/v1/completions", {"prompt": "w5", "max_tokens": 60, "stream": stream},
                             gone)
            during = await watcher
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            await gw.scheduler.close()
            return during, gw.inflight.active

    during, after = asyncio.run(go())
    assert (during, after) == (1, 0)


def test_grpc_cap_refuses_and_frees_slots_on_cancel():
    async def go():
        async with public_api(FakeScheduler(delay=0.05)) as (stub, fake, servicer):
            gw = servicer.gateway
            gw.inflight = InFlight(1)
            call = stub.GenerateStream(text_request(max_tokens=60), metadata=AUTH, timeout=10)
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(text_request(max_tokens=2), metadata=AUTH, timeout=10)
            call.cancel()
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            for _ in range(100):  # the servicer notices its own cancellation
                if gw.inflight.active == 0:
                    break
                await asyncio.sleep(0.02)
            active_after_cancel = gw.inflight.active
            ok = await stub.Generate(text_request(max_tokens=2), metadata=AUTH, timeout=10)
            return refused.value, active_after_cancel, ok, gw.inflight.active
    refused, after_cancel, ok, after_ok = asyncio.run(go())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.trailing_metadata())["retry-after"] == "1"
    assert after_cancel == 0 and ok.finish_reason == "length" and after_ok == 0


def test_max_concurrent_requests_option():
    class Args:
        max_concurrent_requests = "3"
    assert input_limits(Args())["max_concurrent_requests"] == 3
    Args.max_concurrent_requests = "0"
    with pytest.raises(ValueError, match="--max-concurrent-requests"):
        input_limits(Args())
    Args.max_concurrent_requests = None
    assert input_limits(Args())["max_concurrent_requests"] == 256
