"""Real service processes on loopback for integration tests: verifier, draft, scheduler, gateway
as `python -m services.cli serve ROLE`, each on a free port, torn down with SIGTERM. A service can
be killed (SIGKILL) and restarted on the same port with the same arguments, as a container
orchestrator would restart it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for bind(0) can be taken
# by any outgoing connection (a service dialling another) before the service binds it.
_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing holds now and this process has not handed out before."""
    while True:
        port = random.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def grpc_health(addr: str, timeout: float = 1.0) -> int | None:
    """The overall health status of a gRPC server, or None when it does not answer."""
    try:
        with grpc.insecure_channel(addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status
    except grpc.RpcError:
        return None


@dataclass
class Service:
    role: str
    port: int
    proc: subprocess.Popen
    log: Path
    args: tuple[str, ...] = ()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Stack:
    workdir: Path
    env: dict
    services: dict[str, list[Service]] = field(default_factory=dict)

    def start(self, role: str, *args: str, port: int | None = None) -> Service:
        port = port or free_port()
        svc = Service(role, port, self._spawn(role, port, args), self.workdir / f"{role}-{port}.log", args)
        self.services.setdefault(role, []).append(svc)
        return svc

    def _spawn(self, role: str, port: int, args: tuple[str, ...]) -> subprocess.Popen:
        log = open(self.workdir / f"{role}-{port}.log", "a")  # a restart appends to the same log
        cmd = [sys.executable, "-m", "services.cli", "serve", role, "--port", str(port), *args]
        with log:
            return subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, svc: Service) -> None:
        """SIGKILL: no draining, no goodbye, as a crash or an OOM kill."""
        if svc.alive:
            svc.proc.kill()
        svc.proc.wait()

    def restart(self, svc: Service) -> None:
        """Start a dead service again on its port with its arguments (wait_healthy for it)."""
        assert not svc.alive, f"{svc.role} on {svc.port} is still running"
        svc.proc = self._spawn(svc.role, svc.port, svc.args)

    def wait_healthy(self, svc: Service, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.role} exited with {svc.proc.returncode}:\n{svc.log_tail()}")
            if grpc_health(svc.addr) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{svc.role} not healthy after {timeout} s:\n{svc.log_tail()}")

    def stop(self, svc: Service, timeout: float = 30.0) -> int:
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
            try:
                svc.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        return svc.proc.returncode

    def stop_all(self) -> None:
        for role in ("gateway", "scheduler", "draft", "verifier"):
            for svc in self.services.get(role, []):
                self.stop(svc)


def stack_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    env.update({"SPECSERVE_HOME": str(home), "SPECSERVE_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env
