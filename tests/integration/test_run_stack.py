"""`make run` (scripts/run_stack.py) as a user runs it: a real launcher starting a real Redis and the
four services as processes, on free ports, with a tiny model; and the container health check
(deploy/healthcheck.py) against a real gRPC server.

Every launcher run gets a unique RUN_STACK_TEST_ID in its environment, which the launcher passes to
everything it starts: after it exits, no process on this machine may still carry it, and no pid
it recorded in its run directory may still be running.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.integration.stack import free_port
from tests.integration.topology import LONG, complete, record, stream_completion

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_stack.py"
ROLES = ("verifier", "draft", "scheduler", "gateway")


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds RUN_STACK_TEST_ID=marker."""
    needle, found = f"RUN_STACK_TEST_ID={marker}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours
                pass
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, does not count)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


class Launcher:
    """scripts/run_stack.py in its own environment and run directory."""

    def __init__(self, tmp_path: Path, **settings: str):
        self.marker = uuid.uuid4().hex
        self.run_dir = tmp_path / "run"
        ports = free_ports(6)
        self.ports = dict(zip((*ROLES, "http", "redis"), ports))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_") and k != "REDIS_URL"}
        env.update({f"SPECSERVE_{r.upper()}_PORT": str(self.ports[r]) for r in ROLES})
        env.update(SPECSERVE_HTTP_PORT=str(self.ports["http"]), SPECSERVE_REDIS_PORT=str(self.ports["redis"]),
                   SPECSERVE_RUN_DIR=str(self.run_dir), SPECSERVE_LOG_FORMAT="text",
                   RUN_STACK_TEST_ID=self.marker, **settings)
        self.env, self.out_path, self.proc = env, tmp_path / "launcher.out", None

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=ROOT, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, \
                f"the launcher exited ({self.proc.returncode}) before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s:\n{self.output()}"
            time.sleep(0.2)

    def pids(self) -> dict[str, int]:
        """The launcher's pid files (it writes each whole, by rename; one removed after the glob
        is skipped, as is anything not a pid)."""
        out = {}
        for p in self.run_dir.glob("*.pid"):
            try:
                text = p.read_text().strip()
            except FileNotFoundError:
                continue
            if text.isdigit():
                out[p.stem] = int(text)
        return out

    def cleanup(self) -> None:
        """If a test failed halfway: stop the launcher, then anything it left (by pid)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in processes_with(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def launcher(tmp_path, home, tiny_target):
    lc = Launcher(tmp_path, SPECSERVE_HOME=str(home), SPECSERVE_TARGET=str(tiny_target))
    yield lc
    lc.cleanup()


def test_dry_run_prints_the_commands_and_starts_nothing(launcher):
    res = launcher.run("--dry-run")
    assert res.returncode == 0, res.stderr
    p, lines = launcher.ports, res.stdout.splitlines()
    redis = [ln for ln in lines if "redis-server" in ln]
    assert len(redis) == 1 and f"--port {p['redis']}" in redis[0]
    assert "--save ''" in redis[0] and "--appendonly no" in redis[0] and "--bind 127.0.0.1" in redis[0]
    assert f"export REDIS_URL=redis://127.0.0.1:{p['redis']}/0" in lines
    cmd = {role: next(ln for ln in lines if f"-m services.cli serve {role} " in ln) for role in ROLES}
    for role in ROLES:
        assert f"--port {p[role]}" in cmd[role] and str(launcher.run_dir / f"{role}.log") in cmd[role]
    assert f"--draft-addrs 127.0.0.1:{p['draft']}" in cmd["scheduler"]
    assert f"--verifier-addrs 127.0.0.1:{p['verifier']}" in cmd["scheduler"]
    assert f"--scheduler-addrs 127.0.0.1:{p['scheduler']}" in cmd["gateway"]
    assert f"--http-port {p['http']}" in cmd["gateway"]
    assert not launcher.run_dir.exists() and processes_with(launcher.marker) == []

    launcher.env["REDIS_URL"] = "redis://redis.example:6380/1"
    res = launcher.run("--dry-run")
    assert res.returncode == 0 and "redis-server" not in res.stdout
    assert "export REDIS_URL=redis://redis.example:6380/1" in res.stdout

    launcher.env["SPECSERVE_DRAFT_ADDRS"] = "local"  # n-gram drafting in the scheduler: no draft service
    res = launcher.run("--dry-run")
    assert res.returncode == 0 and "serve draft" not in res.stdout
    assert "--draft-addrs local" in next(ln for ln in res.stdout.splitlines() if "serve scheduler" in ln)

    launcher.env["SPECSERVE_VERIFIER_ADDRS"] = "local"  # the target in the scheduler: no verifier service
    res = launcher.run("--dry-run")
    assert res.returncode == 0 and "serve verifier" not in res.stdout and "serve draft" not in res.stdout
    assert "--verifier-addrs local" in next(ln for ln in res.stdout.splitlines() if "serve scheduler" in ln)


def test_a_port_in_use_is_refused_before_anything_starts(launcher):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", launcher.ports["draft"]))
        busy.listen()
        res = launcher.run()
    assert res.returncode != 0
    assert f"port {launcher.ports['draft']} is in use" in res.stderr and "SPECSERVE_DRAFT_PORT" in res.stderr
    assert launcher.pids() == {} and processes_with(launcher.marker) == []


def test_a_service_that_fails_to_start_stops_everything(launcher, tmp_path):
    launcher.env.update(SPECSERVE_TARGET=str(tmp_path / "no-such-model"), SPECSERVE_STARTUP_TIMEOUT="120")
    res = launcher.run(timeout=300)
    assert res.returncode != 0
    # Which one failed, and the end of its log.
    assert "exited with code" in res.stderr or "not healthy after" in res.stderr, res.stderr
    assert any(f"{role}.log" in res.stderr or f"{role}:" in res.stderr for role in ROLES), res.stderr
    assert launcher.pids() == {} and processes_with(launcher.marker) == []


def test_sigterm_while_starting_stops_everything(launcher):
    launcher.start()
    launcher.wait_for(lambda: set(launcher.pids()) == {*ROLES, "redis"}, 60, "every pid file")
    pids = launcher.pids()
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=60) == 0, launcher.output()
    assert launcher.pids() == {}
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert processes_with(launcher.marker) == []


def test_the_stack_serves_and_ctrl_c_leaves_nothing_behind(launcher):
    launcher.start()
    base = f"http://127.0.0.1:{launcher.ports['http']}"
    launcher.wait_for(lambda: "SpecServe is up" in launcher.output(), 300, "healthy stack")
    assert f"curl -s {base}/v1/chat/completions" in launcher.output()
    for role in ROLES:
        assert f"{role}: healthy" in launcher.output()
    with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
        assert r.status == 200
    pids = launcher.pids()
    assert set(pids) == {*ROLES, "redis"} and all(alive(pid) for pid in pids.values())
    # The marker finds the launcher and the services (redis-server overwrites its own environment
    # for its process title: its pid file covers it).
    assert {launcher.proc.pid, *(pids[r] for r in ROLES)} <= set(processes_with(launcher.marker))

    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.proc.wait(timeout=90) == 0, launcher.output()
    assert launcher.pids() == {}
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert processes_with(launcher.marker) == []
    with socket.socket() as s:  # the gateway's port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", launcher.ports["http"]))


def test_container_healthcheck_script(tmp_path):
    """deploy/healthcheck.py (docker-compose's healthcheck) against a real role's gRPC server."""
    port = free_ports(1)[0]
    server_py = tmp_path / "server.py"
    server_py.write_text(
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from services.common.grpc_server import GrpcServer\n"
        "async def main():\n"
        f"    await GrpcServer('127.0.0.1', {port}, []).run(1.0)\n"
        "asyncio.run(main())\n")
    check = [sys.executable, str(ROOT / "deploy" / "healthcheck.py"), f"127.0.0.1:{port}", "--timeout", "1"]
    assert subprocess.run(check, capture_output=True, timeout=30).returncode == 1  # nothing listening
    server = subprocess.Popen([sys.executable, str(server_py)])
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(check, capture_output=True, timeout=30).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.3)
        http = check + ["--http", f"http://127.0.0.1:{free_ports(1)[0]}/health"]
        assert subprocess.run(http, capture_output=True, timeout=30).returncode == 1  # no HTTP there
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0


def _load_run_stack():
    spec = importlib.util.spec_from_file_location("run_stack", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_crash_loop_is_given_up_with_its_log(tmp_path):
    """The supervisor restarts a service that exits, with doubling delays, and gives up at the
    CRASH_LOOP_EXITS-th exit within the window, naming it and showing its log."""
    rs = _load_run_stack()
    stack = rs.Stack(tmp_path)
    stack.start("draft", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], dict(os.environ))
    supervisor = rs.Supervisor(stack, {"draft": free_ports(1)[0]}, first_backoff_s=0.05)
    starts, deadline = {stack.procs["draft"].pid}, time.monotonic() + 60
    with pytest.raises(rs.StackError) as gave_up:
        while time.monotonic() < deadline:
            supervisor.tick()
            starts.add(stack.procs["draft"].pid)
            time.sleep(0.01)
    assert len(starts) == rs.CRASH_LOOP_EXITS  # restarted after each exit but the last
    assert f"draft exited {rs.CRASH_LOOP_EXITS} times" in str(gave_up.value)
    assert "last code 3" in str(gave_up.value) and "boom" in str(gave_up.value)
    assert (tmp_path / "draft.log").read_text().count("boom") == rs.CRASH_LOOP_EXITS  # restarts append
    stack.stop(5)


def _serves_again(launcher, base: str, want: str, name: str, since: float, timeout: float = 120.0) -> float:
    """Seconds from `since` until the launcher restarted `name`, /health is 200 again and LONG
    gives `want`."""
    launcher.wait_for(lambda: f"run_stack: {name} restarted" in launcher.output(), 60, f"{name} restarted")
    launcher.wait_for(lambda: http_status(f"{base}/health") == 200, timeout, f"/health 200 after {name}")
    r = complete(base, LONG, {})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    return time.monotonic() - since


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_the_launcher_restarts_what_dies_and_serves_on(launcher):
    """SIGKILL the draft, then the verifier, then the scheduler, each mid-stream (as an OOM killer
    would): the launcher restarts each; streams through a dead worker finish with the text of an
    uninterrupted run, a dead scheduler's stream ends with an error event; serving resumes. Then
    Redis: requests are served while it is away, and it is restarted too."""
    launcher.start()
    base = f"http://127.0.0.1:{launcher.ports['http']}"
    launcher.wait_for(lambda: "SpecServe is up" in launcher.output(), 300, "healthy stack")
    r = complete(base, LONG, {})
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["text"]
    for name in ("draft", "verifier", "scheduler"):
        pid = launcher.pids()[name]
        killed = []

        def kill(_res, pid=pid) -> bool:
            if not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
            return True

        res = stream_completion(base, LONG, {}, on_event=kill, timeout=120)
        assert killed and res.done, (name, res)
        if name == "scheduler":
            assert res.error is not None and "scheduler" in res.error["message"], res
            assert want.startswith(res.text)  # what came before the error was right
        else:
            assert res.error is None and res.events_after_mark > 0, (name, res)
            assert res.text == want, name
        back_s = _serves_again(launcher, base, want, name, since=killed[0])
        record(f"launcher: {name} SIGKILL mid-stream",
               client_saw="error event, then [DONE]" if name == "scheduler" else "stream went on, same text",
               longest_stall_s=round(res.max_gap_after_mark, 2), kill_to_serving_s=round(back_s, 1))
        assert launcher.pids()[name] != pid and alive(launcher.pids()[name])
    assert f"draft exited with code {-signal.SIGKILL}" in launcher.output()
    os.kill(launcher.pids()["redis"], signal.SIGKILL)  # serving goes on without it (fails open)
    r = complete(base, LONG, {})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    launcher.wait_for(lambda: "run_stack: redis serving again" in launcher.output(), 30, "redis back")
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=90) == 0, launcher.output()
    assert processes_with(launcher.marker) == []
