"""SchedulerClient against a scripted scheduler: a real grpc.aio server on loopback.

`FakeScheduler` and `running_fake` are also used by the other gateway unit tests (imported as
`tests.unit.test_gateway_scheduler_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest

from services.common.grpc_server import GrpcServer
from services.gateway.errors import ApiError
from services.gateway.scheduler_client import SchedulerClient, error_from_rpc
from specserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Answers Generate with one event per output token: token ids 10, 11, ... with text
    "t0 ", "t1 ", ...; the last event carries finish_reason and usage. Knobs: `delay` between
    events, `abort` (a grpc.StatusCode to fail with), `error_after` (a final "error" event after
    that many tokens), `no_final` (end the stream without a finish reason)."""

    def __init__(self, delay: float = 0.0, max_positions: int = 256):
        self.delay = delay
        self.max_positions = max_positions
        self.abort: grpc.StatusCode | None = None
        self.error_after: int | None = None
        self.no_final = False
        self.requests: list[scheduler_pb2.GenerateRequest] = []
        self.time_remaining: list[float | None] = []  # each call's deadline as the scheduler saw it
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.cancel_seen = asyncio.Event()

    @staticmethod
    def expected_text(n: int) -> str:
        return "".join(f"t{i} " for i in range(n))

    async def Generate(self, request, context):
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.abort is not None:
            await context.abort(self.abort, f"max_tokens is bad: scripted {self.abort.name}")
        n = request.params.max_tokens
        try:
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.error_after is not None and i == self.error_after:
                    yield scheduler_pb2.GenerateEvent(finish_reason="error", error="scripted failure")
                    return
                event = scheduler_pb2.GenerateEvent(token_ids=[10 + i], text=f"t{i} ")
                if i == n - 1 and not self.no_final:
                    event.finish_reason = "length"
                    event.usage.CopyFrom(scheduler_pb2.Usage(
                        prompt_tokens=len(request.prompt_ids), completion_tokens=n, steps=max(1, n // 2),
                        drafted_tokens=2 * n, accepted_tokens=n - max(1, n // 2),
                        mean_accepted_length=n / max(1, n // 2), acceptance_rate=0.5))
                yield event
            self.finished.append(request.request_id)
        # A cancelled call raises CancelledError here when it comes during the sleep; when it comes
        # while gRPC sends an event, the server closes this generator instead (GeneratorExit).
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            self.cancel_seen.set()
            raise

    async def Info(self, request, context):
        return common_pb2.InfoResponse(model="fake", max_positions=self.max_positions, role="scheduler")


@contextlib.asynccontextmanager
async def running_fake(fake: FakeScheduler | None = None):
    """Serve a FakeScheduler on a free loopback port; yields (fake, "127.0.0.1:PORT")."""
    fake = fake or FakeScheduler()
    server = GrpcServer("127.0.0.1", 0, [SCHEDULER_SERVICE])
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server.server)
    await server.start()
    await server.ready()
    try:
        yield fake, f"127.0.0.1:{server.bound_port}"
    finally:
        await server.server.stop(grace=None)


def dead_addr() -> str:
    """A loopback address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def request(rid: str = "r1", max_tokens: int = 4) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(request_id=rid, prompt_ids=[5, 6, 7],
                                         params=common_pb2.SamplingParams(max_tokens=max_tokens))


async def _events(client: SchedulerClient, req) -> list[scheduler_pb2.GenerateEvent]:
    async with client.stream(req) as events:
        return [e async for e in events]


def test_stream_yields_every_event_and_ends():
    async def go():
        async with running_fake() as (fake, addr):
            client = SchedulerClient([addr])
            events = await _events(client, request(max_tokens=5))
            await client.close()
            return fake, events

    fake, events = asyncio.run(go())
    assert [list(e.token_ids) for e in events] == [[10], [11], [12], [13], [14]]
    assert "".join(e.text for e in events) == FakeScheduler.expected_text(5)
    assert events[-1].finish_reason == "length" and events[-1].usage.prompt_tokens == 3
    assert fake.finished == ["r1"] and fake.cancelled == []


def test_leaving_the_stream_early_cancels_the_scheduler_call():
    async def go():
        async with running_fake(FakeScheduler(delay=0.05)) as (fake, addr):
            client = SchedulerClient([addr])
            async with client.stream(request(max_tokens=50)) as events:
                async for _ in events:
                    break
            await asyncio.wait_for(fake.cancel_seen.wait(), 5)
            await client.close()
            return fake

    fake = asyncio.run(go())
    assert fake.cancelled == ["r1"] and fake.finished == []


def test_unavailable_replica_is_skipped_and_requests_round_robin():
    async def go():
        async with running_fake() as (fake, addr):
            client = SchedulerClient([dead_addr(), addr])
            for i in range(4):
                events = await _events(client, request(f"r{i}", 2))
                assert events[-1].finish_reason == "length"
            await client.close()
            return fake

    fake = asyncio.run(go())
    assert [r.request_id for r in fake.requests] == ["r0", "r1", "r2", "r3"]


def test_new_requests_alternate_between_live_replicas():
    async def go():
        async with running_fake() as (a, addr_a), running_fake() as (b, addr_b):
            client = SchedulerClient([addr_a, addr_b])
            for i in range(4):
                await _events(client, request(f"r{i}", 1))
            await client.close()
            return [r.request_id for r in a.requests], [r.request_id for r in b.requests]

    assert asyncio.run(go()) == (["r0", "r2"], ["r1", "r3"])


def test_a_full_replica_passes_the_request_to_the_next():
    async def go():
        full = FakeScheduler()
        full.abort = grpc.StatusCode.RESOURCE_EXHAUSTED
        async with running_fake(full) as (_, addr_full), running_fake() as (ok, addr_ok):
            client = SchedulerClient([addr_full, addr_ok])
            events = await _events(client, request("r0", 2))
            await client.close()
            return full, ok, events

    full, ok, events = asyncio.run(go())
    assert events[-1].finish_reason == "length"
    assert [r.request_id for r in full.requests] == ["r0"] and [r.request_id for r in ok.requests] == ["r0"]


def test_all_replicas_unavailable_is_a_503():
    async def go():
        client = SchedulerClient([dead_addr(), dead_addr()])
        try:
            with pytest.raises(ApiError) as e:
                await _events(client, request())
            assert not await client.healthy(timeout=1)
            assert await client.info(timeout=1) is None
        finally:
            await client.close()
        return e.value

    err = asyncio.run(go())
    assert err.status == 503 and err.code == "scheduler_unavailable"


@pytest.mark.parametrize("code,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "max_tokens"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (grpc.StatusCode.INTERNAL, 500, None),
])
def test_grpc_errors_map_to_http_statuses(code, status, param):
    async def go():
        fake = FakeScheduler()
        fake.abort = code
        async with running_fake(fake) as (_, addr):
            client = SchedulerClient([addr])
            try:
                with pytest.raises(ApiError) as e:
                    await _events(client, request())
            finally:
                await client.close()
            return e.value

    err = asyncio.run(go())
    assert err.status == status
    assert err.param == param
    assert "scripted" in err.message


def test_health_and_info_of_a_live_scheduler():
    async def go():
        async with running_fake(FakeScheduler(max_positions=77)) as (_, addr):
            client = SchedulerClient([dead_addr(), addr])
            try:
                return await client.healthy(timeout=2), await client.info(timeout=2)
            finally:
                await client.close()

    healthy, info = asyncio.run(go())
    assert healthy and info.max_positions == 77


def test_error_from_rpc_without_a_server():
    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return ""

    assert error_from_rpc(Err()).status == 504


def test_no_addresses_is_refused():
    with pytest.raises(ValueError):
        SchedulerClient([])
