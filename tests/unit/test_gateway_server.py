"""serve_gateway as a real process (uvicorn and the public gRPC server in one event loop) over a
scripted scheduler served from a thread of the test: real HTTP, real client disconnects, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from services.gateway.server import bind_http_socket, served_model_name
from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.unit.test_gateway_scheduler_client import FakeScheduler, dead_addr, running_fake

KEY = "sk-server-test"
REPO = Path(__file__).resolve().parents[2]
LAUNCH = ("import argparse, asyncio, sys\n"
          "from services.common.settings import add_role_options\n"
          "from services.gateway.server import serve_gateway\n"
          "p = argparse.ArgumentParser()\n"
          "add_role_options(p, 'gateway')\n"
          "asyncio.run(serve_gateway(p.parse_args(sys.argv[1:])))\n")


class ThreadedFake:
    """A FakeScheduler served by an event loop in a background thread."""

    def __init__(self, fake: FakeScheduler):
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        async def main():
            self._stop = asyncio.Event()
            async with running_fake(self.fake) as (_, addr):
                self.addr = addr
                ready.set()
                await self._stop.wait()
        self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


def free_port() -> int:
    with bind_http_socket("127.0.0.1", 0) as s:
        return s.getsockname()[1]


def start_gateway(target: Path, scheduler_addr: str, tmp: Path) -> tuple[subprocess.Popen, str, str, Path]:
    http_port, grpc_port = free_port(), free_port()
    log = tmp / f"gateway-{http_port}.log"
    env = {**os.environ, "SPECSERVE_API_KEYS": KEY, "SPECSERVE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--port", str(grpc_port), "--http-port", str(http_port),
                             "--target", str(target), "--scheduler-addrs", scheduler_addr,
                             "--grace-period", "10", "--log-level", "INFO"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited {proc.returncode}:\n{log.read_text()}"
        try:
            httpx.get(f"{url}/health", timeout=1)
            return proc, url, f"127.0.0.1:{grpc_port}", log
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"gateway did not start:\n{log.read_text()}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("the gateway ignored SIGTERM")
    return proc.returncode


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    fake = ThreadedFake(FakeScheduler(delay=0.03))
    proc, url, grpc_addr, log = start_gateway(tiny_target, fake.addr, tmp_path_factory.mktemp("gw"))
    yield fake.fake, url, grpc_addr
    code = stop(proc)
    fake.close()
    assert code == 0, log.read_text()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_http_and_grpc_serve_from_one_process(served, tiny_target):
    fake, url, grpc_addr = served
    assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=5).json()
    assert models["data"][0]["id"] == served_model_name(str(tiny_target)) == "target"
    assert models["data"][0]["max_model_len"] == 256  # the tiny checkpoint's context
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "target", "prompt": "w5 w6", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == FakeScheduler.expected_text(3)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "w5"}, timeout=5).status_code == 401

    async def via_grpc():
        async with grpc.aio.insecure_channel(grpc_addr) as ch:
            stub = gateway_pb2_grpc.GenerationStub(ch)
            request = gateway_pb2.TextRequest(prompt="w5", params=common_pb2.SamplingParams(max_tokens=2))
            return await stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
    assert asyncio.run(via_grpc()).text == FakeScheduler.expected_text(2)


def test_http_client_disconnect_cancels_the_scheduler_call(served):
    fake, url, _ = served
    body = {"prompt": "w5", "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            first = next(r.iter_lines())
            assert json.loads(first[len("data: "):])["choices"][0]["text"] == "t0 "
        # leaving the block closes the connection mid-stream
    rid = fake.requests[-1].request_id
    deadline = time.monotonic() + 5  # 200 tokens would take 6 s
    while rid not in fake.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in fake.cancelled and rid not in fake.finished


def test_sigterm_lets_an_inflight_stream_finish_then_exits(tiny_target, tmp_path):
    fake = ThreadedFake(FakeScheduler(delay=0.03))
    proc, url, grpc_addr, log = start_gateway(tiny_target, fake.addr, tmp_path)
    try:
        body = {"prompt": "w5", "max_tokens": 40, "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
                lines = r.iter_lines()
                first = next(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        frames = [first] + rest
        assert frames[-1] == "data: [DONE]"
        text = "".join(json.loads(f[6:])["choices"][0]["text"] for f in frames[:-1])
        assert text == FakeScheduler.expected_text(40)
        assert proc.wait(20) == 0, log.read_text()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        stop(proc)
        fake.close()


def test_a_taken_http_port_fails_at_startup(tiny_target, tmp_path):
    with bind_http_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        env = {**os.environ, "SPECSERVE_LOG_FORMAT": "text"}
        done = subprocess.run([sys.executable, "-c", LAUNCH, "--port", str(free_port()), "--http-port", str(port),
                               "--target", str(tiny_target), "--scheduler-addrs", dead_addr()],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"cannot listen for HTTP on 127.0.0.1:{port}" in done.stderr
