"""The public gRPC API (specserve.v1.Generation) on loopback, with a scripted scheduler."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from services.common.grpc_server import GrpcServer
from services.gateway.public_grpc import SERVICE_NAME, GenerationServicer, add_to_server
from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.unit.test_gateway_http import KEY, make_gateway
from tests.unit.test_gateway_scheduler_client import FakeScheduler, dead_addr, running_fake

AUTH = (("authorization", f"Bearer {KEY}"),)


@contextlib.asynccontextmanager
async def public_api(fake: FakeScheduler | None = None, *, dead: bool = False, keys=(KEY,)):
    """A Generation server over a fake scheduler; yields (stub, fake, servicer)."""
    async with running_fake(fake) as (fake, addr):
        gw = make_gateway([dead_addr()] if dead else [addr], keys=keys)
        server = GrpcServer("127.0.0.1", 0, [SERVICE_NAME])
        servicer = GenerationServicer(gw)
        add_to_server(servicer, server.server)
        await server.start()
        await server.ready()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
                yield gateway_pb2_grpc.GenerationStub(channel), fake, servicer
        finally:
            await server.server.stop(grace=None)
            await gw.scheduler.close()


def text_request(prompt: str = "w5 w6", **params) -> gateway_pb2.TextRequest:
    return gateway_pb2.TextRequest(prompt=prompt, params=common_pb2.SamplingParams(**params))


def test_generate_returns_the_whole_completion():
    async def go():
        async with public_api() as (stub, fake, servicer):
            resp = await stub.Generate(text_request(max_tokens=4, seed=5), metadata=AUTH, timeout=10)
            return resp, fake.requests[0], servicer.active

    resp, req, active = asyncio.run(go())
    assert resp.text == FakeScheduler.expected_text(4) and list(resp.token_ids) == [10, 11, 12, 13]
    assert resp.finish_reason == "length" and resp.usage.completion_tokens == 4 and resp.id == req.request_id
    assert list(req.prompt_ids) == [5, 6]
    # proto3 zeros: temperature 0 = greedy, top_p 0 = unset (1.0); the seed is passed on
    assert req.params.temperature == 0.0 and req.params.top_p == 1.0 and req.params.seed == 5
    assert active == 0


def test_generate_stream_chunks_and_chat_messages():
    async def go():
        async with public_api() as (stub, fake, _):
            request = gateway_pb2.TextRequest(
                messages=[gateway_pb2.ChatMessage(role="user", content="w7")],
                params=common_pb2.SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9))
            chunks = [c async for c in stub.GenerateStream(request, metadata=AUTH, timeout=10)]
            return chunks, fake.requests[0]

    chunks, req = asyncio.run(go())
    assert "".join(c.text for c in chunks) == FakeScheduler.expected_text(3)
    assert [list(c.token_ids) for c in chunks] == [[10], [11], [12]]
    assert [c.finish_reason for c in chunks] == ["", "", "length"]
    assert not chunks[0].HasField("usage") and chunks[-1].usage.completion_tokens == 3
    assert list(req.prompt_ids) == [7, 9]  # the chat template: "w7 " + generation prompt "w9"
    assert req.params.temperature == pytest.approx(0.5) and req.params.top_p == pytest.approx(0.9)


def _code(coro_factory, **kw) -> tuple[grpc.StatusCode, str, list]:
    async def go():
        async with public_api(**kw) as (stub, fake, _):
            try:
                await coro_factory(stub)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details(), fake.requests
            raise AssertionError("the call succeeded")
    return asyncio.run(go())


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)])
def test_wrong_or_missing_key_is_unauthenticated(metadata):
    code, _, reqs = _code(lambda stub: stub.Generate(text_request(max_tokens=2), metadata=metadata, timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED and reqs == []

    async def stream(stub):
        return [c async for c in stub.GenerateStream(text_request(max_tokens=2), metadata=metadata, timeout=10)]
    assert _code(stream)[0] == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("request_,code,word", [
    (text_request(temperature=3.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (text_request(top_p=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (text_request(max_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (text_request(max_tokens=63), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (text_request(stop=["a", "b", "c", "d", "e"]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (text_request(""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (gateway_pb2.TextRequest(messages=[gateway_pb2.ChatMessage(role="robot", content="x")]),
     grpc.StatusCode.INVALID_ARGUMENT, "role"),
    (gateway_pb2.TextRequest(model="gpt-4", prompt="w5"), grpc.StatusCode.NOT_FOUND, "gpt-4"),
])
def test_invalid_requests_name_the_parameter(request_, code, word):
    got, details, reqs = _code(lambda stub: stub.Generate(request_, metadata=AUTH, timeout=10))
    assert got == code and word in details and reqs == []


def test_unreachable_scheduler_is_unavailable():
    async def stream(stub):
        return [c async for c in stub.GenerateStream(text_request(), metadata=AUTH, timeout=10)]
    assert _code(stream, dead=True)[0] == grpc.StatusCode.UNAVAILABLE


def test_scheduler_error_event_is_internal():
    fake = FakeScheduler()
    fake.error_after = 1

    async def stream(stub):
        return [c async for c in stub.GenerateStream(text_request(max_tokens=4), metadata=AUTH, timeout=10)]
    code, details, _ = _code(stream, fake=fake)
    assert code == grpc.StatusCode.INTERNAL and "scripted failure" in details


def test_open_when_no_keys_are_set():
    async def go():
        async with public_api(keys=()) as (stub, _, _s):
            return await stub.Generate(text_request(max_tokens=2), timeout=10)
    assert asyncio.run(go()).finish_reason == "length"


def test_cancelling_the_stream_cancels_the_scheduler_call():
    async def go():
        async with public_api(FakeScheduler(delay=0.05)) as (stub, fake, servicer):
            call = stub.GenerateStream(text_request(max_tokens=60), metadata=AUTH, timeout=10)
            first = await call.read()
            call.cancel()
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            for _ in range(100):  # the servicer notices its own cancellation
                if servicer.active == 0:
                    break
                await asyncio.sleep(0.02)
            return first, fake, servicer.active

    first, fake, active = asyncio.run(go())
    assert first.text == "t0 "
    assert fake.cancelled == [fake.requests[0].request_id] and fake.finished == []
    assert active == 0


def test_the_client_deadline_becomes_the_scheduler_call_deadline():
    async def go():
        async with public_api(FakeScheduler(delay=0.05)) as (stub, fake, servicer):
            call = stub.GenerateStream(text_request(max_tokens=40), metadata=AUTH, timeout=1.0)  # 2 s of events
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            quick = await stub.Generate(text_request(max_tokens=2), metadata=AUTH)  # no deadline: none passed on
            return err.value.code(), fake, quick

    code, fake, quick = asyncio.run(go())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client's 1 s, less the time spent on the way; gRPC's wire encoding of a timeout "may round
    # up" (grpc core, timeout_encoding.h: never early), so each hop may add a little (1.0097 seen).
    assert fake.time_remaining[0] is not None and 0 < fake.time_remaining[0] <= 1.1
    assert fake.cancelled == [fake.requests[0].request_id]
    assert quick.finish_reason == "length" and fake.time_remaining[1] is None
