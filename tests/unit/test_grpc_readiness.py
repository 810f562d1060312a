"""GrpcServer's readiness: listening before the role can serve, its RPCs refused with UNAVAILABLE
(every kind of call), health NOT_SERVING and "liveness" SERVING; then ready; `watch` follows a
dependency both ways and never turns a draining server SERVING again."""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import LIVENESS, GrpcServer
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class Draft(draft_pb2_grpc.DraftServiceServicer):
    async def Info(self, request, context):
        return common_pb2.InfoResponse(role="draft")

    async def Propose(self, request_iterator, context):
        async for _ in request_iterator:
            yield draft_pb2.ProposeResult()


async def _status(channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def _refused(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert "not ready" in e.details() and ("retry-after", "1") in tuple(e.trailing_metadata())
        return e.code()
    raise AssertionError("the call was served before the server was ready")


async def _scenario() -> None:
    server = GrpcServer("127.0.0.1", 0, [DRAFT_SERVICE])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(Draft(), server.server)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    try:
        assert await _status(channel) == NOT_SERVING and await _status(channel, DRAFT_SERVICE) == NOT_SERVING
        assert await _status(channel, LIVENESS) == SERVING
        assert await _refused(stub.Info(common_pb2.InfoRequest())) == grpc.StatusCode.UNAVAILABLE
        stream = stub.Propose()
        await stream.write(draft_pb2.ProposeStep())
        assert await _refused(stream.read()) == grpc.StatusCode.UNAVAILABLE
        await server.set_serving(True)  # not ready yet: a watcher's "yes" does not open it
        assert await _status(channel) == NOT_SERVING

        peer_up = True
        await server.ready()
        assert (await stub.Info(common_pb2.InfoRequest())).role == "draft"
        watcher = server.watch(lambda: asyncio.sleep(0, peer_up), "peer", interval_s=0.02)
        await asyncio.sleep(0.1)
        assert await _status(channel) == SERVING
        peer_up = False
        await asyncio.sleep(0.1)
        assert await _status(channel) == NOT_SERVING and await _status(channel, LIVENESS) == SERVING
        assert (await stub.Info(common_pb2.InfoRequest())).role == "draft"  # not ready is no refusal
        peer_up = True
        await asyncio.sleep(0.1)
        assert await _status(channel) == SERVING
        server.stopping.set()  # draining: stays NOT_SERVING whatever the peer does
        await server.set_serving(False)
        await asyncio.sleep(0.1)
        assert await _status(channel) == NOT_SERVING
        watcher.cancel()
    finally:
        await channel.close()
        await server.server.stop(0)


def test_not_ready_then_ready_then_following_its_peer():
    asyncio.run(_scenario())
