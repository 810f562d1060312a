"""A multi-replica SpecServe on one machine for fault tests: Redis, 2 verifiers, 2 drafts,
2 schedulers (each using every draft and verifier) and 2 gateways (each using both schedulers),
all real processes on loopback serving a tiny model. Every process keeps its port, so a killed
one can be restarted in place and rejoin, as Kubernetes or compose would restart it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import redis

from specserve.v1 import common_pb2, draft_pb2_grpc, scheduler_pb2_grpc, verifier_pb2_grpc
from tests.integration.stack import Service, Stack, free_port, stack_env

API_KEY = "sk-test-topology"
PROMPT = "w5 w6 w7 w8 w5 w6"
LONG = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}

STATE_STUBS = {"scheduler": scheduler_pb2_grpc.SchedulerServiceStub, "draft": draft_pb2_grpc.DraftServiceStub,
               "verifier": verifier_pb2_grpc.VerifierServiceStub}


class RedisProcess:
    """A redis-server on a fixed loopback port that can be stopped and started again (empty)."""

    def __init__(self, binary: str, workdir: Path):
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)


@dataclass
class Topology:
    stack: Stack
    redis: RedisProcess
    http_ports: dict[int, int]  # gateway gRPC port -> its HTTP port

    def services(self, role: str) -> list[Service]:
        return self.stack.services[role]

    def http_url(self, gateway: int = 0) -> str:
        return f"http://127.0.0.1:{self.http_ports[self.services('gateway')[gateway].port]}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    # -- lifecycle ------------------------------------------------------------------------
    def wait_ready(self, svc: Service, timeout: float = 120.0) -> None:
        self.stack.wait_healthy(svc, timeout)
        if svc.role == "gateway":  # its HTTP side too
            url = f"http://127.0.0.1:{self.http_ports[svc.port]}/health"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(f"gateway HTTP not healthy:\n{svc.log_tail()}")

    def heal(self) -> None:
        """Restart whatever a test killed (Redis included) and wait until all of it serves."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        for role in ("verifier", "draft", "scheduler", "gateway"):
            for svc in self.services(role):
                if not svc.alive:
                    self.stack.restart(svc)
                self.wait_ready(svc)

    def stop(self) -> None:
        self.stack.stop_all()
        self.redis.stop()

    # -- inspection -----------------------------------------------------------------------
    def request_ids(self, svc: Service) -> list[str]:
        """The request ids a scheduler, draft or verifier holds state for."""
        with grpc.insecure_channel(svc.addr) as ch:
            reply = STATE_STUBS[svc.role](ch).State(common_pb2.StateRequest(), timeout=5)
        return list(reply.request_ids)

    def steps(self, svc: Service) -> int:
        with grpc.insecure_channel(svc.addr) as ch:
            return STATE_STUBS[svc.role](ch).State(common_pb2.StateRequest(), timeout=5).steps

    def holding(self, role: str) -> list[Service]:
        """The replicas of a role that hold any request right now."""
        return [s for s in self.services(role) if s.alive and self.request_ids(s)]

    def leftover_state(self) -> dict[str, list[str]]:
        """Request ids still held by any live process (empty when every request was freed)."""
        out = {}
        for role in ("scheduler", "draft", "verifier"):
            for svc in self.services(role):
                ids = self.request_ids(svc) if svc.alive else []
                if ids:
                    out[f"{role}:{svc.port}"] = ids
        return out


def start_topology(root: Path, home: Path, target: Path, draft: Path, redis_binary: str) -> Topology:
    rds = RedisProcess(redis_binary, root)
    rds.start()
    st = Stack(root, stack_env(home, REDIS_URL=rds.url, SPECSERVE_API_KEYS=API_KEY, SPECSERVE_METRICS_PORT="0"))
    topo = Topology(st, rds, {})
    try:
        verifiers = [st.start("verifier", "--target", str(target)) for _ in range(2)]
        drafts = [st.start("draft", "--target", str(target), "--draft", str(draft), "--compression-ratio", "1.0")
                  for _ in range(2)]
        for svc in verifiers + drafts:
            st.wait_healthy(svc)
        worker_args = ("--target", str(target), "--draft-addrs", ",".join(s.addr for s in drafts),
                       "--verifier-addrs", ",".join(s.addr for s in verifiers))
        # A fixed draft length: on a tiny model on a CPU, adaptive rightly drafts little, and
        # the draft replicas must be in use for their faults to matter.
        schedulers = [st.start("scheduler", *worker_args, "--draft-length", "3", "--tree-size", "5")
                      for _ in range(2)]
        for svc in schedulers:
            st.wait_healthy(svc)
        for _ in range(2):
            http_port = free_port()
            gw = st.start("gateway", "--target", str(target), "--http-port", str(http_port),
                          "--scheduler-addrs", ",".join(s.addr for s in schedulers))
            topo.http_ports[gw.port] = http_port
        for gw in topo.services("gateway"):
            topo.wait_ready(gw)
    except BaseException:
        topo.stop()
        raise
    return topo


# -- clients --------------------------------------------------------------------------------
@dataclass
class StreamResult:
    status: int
    id: str = ""  # the completion id (the request id on every service)
    text: str = ""
    events: int = 0  # content chunks received
    error: dict | None = None  # an error object sent inside the stream
    done: bool = False  # data: [DONE] arrived
    finish_reason: str | None = None
    events_after_mark: int = 0  # chunks received after on_event returned True
    marked_at: float | None = None  # when on_event returned True (time.monotonic)
    ended_at: float | None = None
    max_gap_after_mark: float = 0.0  # longest wait between chunks after the mark (seconds)


def stream_completion(url: str, body: dict, headers: dict, on_event=None, timeout: float = 60) -> StreamResult:
    """POST /v1/completions with stream: true, reading SSE frames as they come. `on_event(result)`
    runs after each content chunk; once it returns True, later chunks are counted separately."""
    res, marked, last = StreamResult(0), False, time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=timeout) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.error = json.loads(r.read()).get("error")
            return res
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                res.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj["error"]
                continue
            res.id = obj.get("id", res.id)
            for choice in obj.get("choices", []):
                res.text += choice.get("text", "")
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            res.events += 1
            now = time.monotonic()
            if marked:
                res.events_after_mark += 1
                res.max_gap_after_mark = max(res.max_gap_after_mark, now - last)
            last = now
            if on_event is not None and not marked and on_event(res):
                marked, res.marked_at, last = True, time.monotonic(), time.monotonic()
    res.ended_at = time.monotonic()
    return res


def complete(url: str, body: dict, headers: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)


def record(fault: str, **figures) -> None:
    """Append one fault's figures as a JSON line to $SPECSERVE_RELIABILITY_LOG (if set): the raw
    material of RELIABILITY.md."""
    path = os.environ.get("SPECSERVE_RELIABILITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, **figures}) + "\n")


def reference(topo: Topology) -> str:
    r = complete(topo.http_url(1), LONG, topo.headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll until `predicate()` is true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(interval)
    return time.monotonic() - start


def no_state_left(topo: Topology, timeout: float = 5.0) -> None:
    """Every request is freed on every live replica (a release follows a finish within a step)."""
    deadline = time.monotonic() + timeout
    while left := topo.leftover_state():
        assert time.monotonic() < deadline, f"state left after {timeout} s: {left}"
        time.sleep(0.1)
