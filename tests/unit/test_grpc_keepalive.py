"""Our servers accept our channels' keepalive pings: a stream that carries no data for several
keepalive periods stays open (gRPC's default server policy would close the connection with GOAWAY
"too_many_pings" and fail every call on it; CI once lost a gateway-to-scheduler call that way)."""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import GrpcServer, channel_options

KEEPALIVE_MS = 500  # the production ratio of options at a short period, so the test takes seconds


async def _idle_stream_survives(idle_s: float) -> list[int]:
    server = GrpcServer("127.0.0.1", 0, [], keepalive_ms=KEEPALIVE_MS)
    await server.start()
    await server.ready()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}",
                                        options=channel_options(KEEPALIVE_MS))
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        seen = [(await watch.read()).status]
        await asyncio.sleep(idle_s)  # the stream is open and silent; only keepalive pings flow
        await server.set_serving(False)
        seen.append((await asyncio.wait_for(watch.read(), 5)).status)
        return seen
    finally:
        await channel.close()
        await server.server.stop(0)


def test_an_idle_stream_outlives_many_keepalive_pings():
    # 12 periods: the default policy sends GOAWAY at the third early ping.
    seen = asyncio.run(_idle_stream_survives(12 * KEEPALIVE_MS / 1000))
    assert seen == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
