"""Remote workers: the scheduler's side of the long-lived step streams to draft and verifier
replicas (`RemoteWorkers`, the gRPC implementation of services/scheduler/workers.py's interface).

Each replica has one bidirectional stream; one step message goes out and one result comes back,
in order. A replica remembers which committed tokens it was sent per request (`sent`), so step
messages carry only new tokens. A broken stream marks the replica down; its requests move to a
live replica (resent from offset 0) and the replica is retried later. A request sticks to one
replica; new requests go to the least loaded. A failed draft replica costs only speculation (its
requests get no tree until one is back); a failed verifier replica's requests are re-prefilled
on another from their committed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common import codec
from services.common.grpc_server import channel, check_serving
from services.common.tracing import RequestSpans
from services.scheduler.workers import Reply, Work, Workers, collect, work_item
from specserve.v1 import common_pb2, draft_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


class WorkerDown(RuntimeError):
    pass


class Replica:
    """One draft or verifier replica: a channel, a step stream, and what each request was sent."""

    def __init__(self, kind: str, address: str, credentials: grpc.ChannelCredentials | None = None):
        self.kind, self.address = kind, address
        self.channel = channel(address, credentials)
        stub_cls = draft_pb2_grpc.DraftServiceStub if kind == "draft" else verifier_pb2_grpc.VerifierServiceStub
        self.stub = stub_cls(self.channel)
        self.call = None
        self.sent: dict[str, int] = {}  # request id -> committed tokens this replica has
        self.requests: set[str] = set()  # requests assigned here
        self.down_since: float | None = None
        self.lock = asyncio.Lock()

    @property
    def live(self) -> bool:
        return self.down_since is None or time.monotonic() - self.down_since > RETRY_AFTER_S

    async def info(self, timeout: float = 5.0) -> common_pb2.InfoResponse:
        return await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout)

    async def step(self, message):
        """Send one step message and wait for its result; raises WorkerDown when the stream breaks."""
        async with self.lock:
            try:
                if self.call is not None and self.call.done():  # it ended while idle (the replica died)
                    self.call = None
                if self.call is None:
                    self.call = self.stub.Propose() if self.kind == "draft" else self.stub.Verify()
                    self.sent.clear()  # a new stream may reach a restarted replica: resend all
                await self.call.write(message)
                result = await self.call.read()
                if result is grpc.aio.EOF:
                    raise WorkerDown(f"{self.kind} {self.address} closed its stream")
                self.down_since = None
                return result
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, WorkerDown) as e:
                self.call = None
                self.sent.clear()
                self.down_since = time.monotonic()
                raise WorkerDown(f"{self.kind} {self.address}: {e}") from e

    async def close(self) -> None:
        if self.call is not None:
            try:
                await self.call.done_writing()
            except Exception:  # the stream may already be gone
                pass
        await self.channel.close()


class ReplicaSet:
    """Replicas of one kind; a request sticks to one, new requests go to the least loaded (ties
    taken in turn, so sequential requests spread too)."""

    def __init__(self, kind: str, addresses: list[str], credentials: grpc.ChannelCredentials | None = None):
        if not addresses:
            raise ValueError(f"no {kind} replica address configured")
        self.kind = kind
        self.replicas = [Replica(kind, a, credentials) for a in addresses]
        self.assignment: dict[str, Replica] = {}
        self._turn = 0  # rotates the choice among equally loaded replicas

    def assign(self, req_id: str, near: str = "") -> Replica | None:
        """The request's replica; a new one joins `near`'s when that is live (they share a
        prompt), else the least loaded."""
        rep = self.assignment.get(req_id)
        if rep is not None and rep.live:
            return rep
        if rep is not None:
            rep.requests.discard(req_id)
        candidates = [r for r in self.replicas if r.live]
        if not candidates:
            self.assignment.pop(req_id, None)
            return None
        rep = self.assignment.get(near) if near else None
        if rep is None or not rep.live:
            least = min(len(r.requests) for r in candidates)
            tied = [r for r in candidates if len(r.requests) == least]
            rep = tied[self._turn % len(tied)]
            self._turn += 1
        rep.requests.add(req_id)
        rep.sent.pop(req_id, None)
        self.assignment[req_id] = rep
        return rep

    def forget(self, req_id: str) -> Replica | None:
        rep = self.assignment.pop(req_id, None)
        if rep is not None:
            rep.requests.discard(req_id)
            rep.sent.pop(req_id, None)
        return rep

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()


class RemoteWorkers(Workers):
    """One kind of worker over gRPC: each step sends one message per replica, concurrently.
    `spans`: the scheduler's request spans, whose context a request's first item carries."""

    def __init__(self, kind: str, addresses: list[str], spans: RequestSpans | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.kind = kind
        self.codec = codec.DRAFT if kind == "draft" else codec.VERIFIER
        self.replicas = ReplicaSet(kind, addresses, credentials)
        self.spans = spans
        self.releases: dict[Replica, list[str]] = {}  # to send with each replica's next message

    def _item(self, rep: Replica, w: Work):
        offset = rep.sent.get(w.req_id, 0)
        return work_item(w, offset, self.spans.first(w.req_id, offset) if self.spans is not None else "")

    async def step(self, step_id: int, works: list[Work]) -> Reply:
        reply, groups = Reply(), {}
        for w in works:
            rep = self.replicas.assign(w.req_id, w.near)
            if rep is None:
                reply.unplaced.append(w.req_id)
            else:
                groups.setdefault(rep, []).append(w)
        reps = list(groups)
        items = {rep: [self._item(rep, w) for w in groups[rep]] for rep in reps}
        msgs = [self.codec.step(step_id, items[rep], self.releases.pop(rep, [])) for rep in reps]
        answers = await asyncio.gather(*(rep.step(m) for rep, m in zip(reps, msgs)), return_exceptions=True)
        for rep, answer in zip(reps, answers):
            if isinstance(answer, WorkerDown):  # its requests move to another replica next step
                log.warning("%s", answer)
                continue
            if isinstance(answer, BaseException):
                raise answer
            reply.compute_ms = max(reply.compute_ms, answer.timing.compute_ms)
            collect(reply, rep.sent, groups[rep], items[rep], self.codec.results(answer))
        return reply

    def release(self, req_id: str) -> None:
        rep = self.replicas.forget(req_id)
        if rep is not None:
            self.releases.setdefault(rep, []).append(req_id)

    async def flush(self) -> None:
        pending, self.releases = self.releases, {}
        for rep, ids in pending.items():
            try:
                await rep.step(self.codec.step(0, [], ids))
            except WorkerDown as e:  # its stream is gone, and with it the replica's state for these
                log.info("release not delivered (%s): the replica dropped the state with the stream", e)

    async def info(self, timeout_s: float = 600.0) -> common_pb2.InfoResponse:
        """The first replica's Info; workers may still be loading their model: retry until one answers."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            for rep in self.replicas.replicas:
                try:
                    return await rep.info(timeout=2.0)
                except Exception as e:  # not up yet
                    last = e
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no {self.kind} replica answered: {last}")
            await asyncio.sleep(0.5)

    async def serving(self) -> bool:
        """Whether at least one replica answers its health check with SERVING."""
        checks = await asyncio.gather(*(check_serving(rep.channel, timeout=2.0) for rep in self.replicas.replicas))
        return any(checks)

    async def close(self) -> None:
        await self.replicas.close()
