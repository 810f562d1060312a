"""Readiness and liveness as a load balancer or a Kubernetes probe sees them, on real processes:
a gateway started before any scheduler, a scheduler started before any verifier, then the
verifier; then the verifier dies and comes back."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import LIVENESS
from specserve.v1 import common_pb2, scheduler_pb2_grpc
from tests.integration.stack import Stack, free_port, grpc_health, stack_env

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(addr: str, service: str) -> int | None:
    try:
        with grpc.insecure_channel(addr) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=2).status
    except grpc.RpcError:
        return None


def wait_until(predicate, what: str, services, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for svc in services:
            assert svc.alive, f"{svc.role} exited:\n{svc.log_tail()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s:\n" + \
            "\n".join(f"{s.role}:\n{s.log_tail(10)}" for s in services)
        time.sleep(0.2)


@pytest.fixture
def st(tmp_path, home):
    stack = Stack(tmp_path, stack_env(home))
    yield stack
    stack.stop_all()


def test_health_follows_what_each_role_needs(st, tiny_target):
    target = str(tiny_target)
    sched_port, verifier_port, http_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{http_port}"
    gateway = st.start("gateway", "--target", target, "--scheduler-addrs", f"127.0.0.1:{sched_port}",
                       "--http-port", str(http_port))
    # Alive, not ready: no scheduler yet.
    wait_until(lambda: health_of(gateway.addr, LIVENESS) == SERVING, "gateway liveness", [gateway])
    assert grpc_health(gateway.addr) == NOT_SERVING
    assert httpx.get(f"{base}/health/live", timeout=5).status_code == 200
    r = httpx.get(f"{base}/health", timeout=5)
    assert r.status_code == 503 and r.headers.get("retry-after") == "1"
    assert f"127.0.0.1:{sched_port}" in r.json()["error"]["message"]

    # A scheduler waiting for its verifier listens, but is not ready and refuses work.
    sched = st.start("scheduler", "--target", target, "--draft-addrs", "local",
                     "--verifier-addrs", f"127.0.0.1:{verifier_port}", port=sched_port)
    wait_until(lambda: health_of(sched.addr, LIVENESS) == SERVING, "scheduler liveness", [gateway, sched])
    assert grpc_health(sched.addr) == NOT_SERVING
    with grpc.insecure_channel(sched.addr) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in refused.value.details()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 503

    verifier = st.start("verifier", "--target", target, port=verifier_port)
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, "gateway ready",
               [gateway, sched, verifier])
    assert grpc_health(sched.addr) == SERVING
    wait_until(lambda: grpc_health(gateway.addr) == SERVING, "gateway gRPC SERVING", [gateway])
    with grpc.insecure_channel(sched.addr) as ch:
        assert scheduler_pb2_grpc.SchedulerServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5).vocab_size > 0

    # The verifier dies: the scheduler cannot serve, and says so; it comes back by itself.
    st.kill(verifier)
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, "gateway not ready",
               [gateway, sched])
    assert grpc_health(sched.addr) == NOT_SERVING and health_of(sched.addr, LIVENESS) == SERVING
    st.restart(verifier)
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, "gateway ready again",
               [gateway, sched, verifier])
