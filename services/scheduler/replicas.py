"""The scheduler's side of the long-lived step streams to draft and verifier replicas.

Each replica has one bidirectional stream; one step message goes out and one result comes back,
in order. A replica remembers which committed tokens it was sent per request (`sent`), so step
messages carry only new tokens. A broken stream marks the replica down; its requests move to a
live replica (resent from offset 0) and the replica is retried later.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from specserve.v1 import common_pb2, draft_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


class WorkerDown(RuntimeError):
    pass


class Replica:
    """One draft or verifier replica: a channel, a step stream, and what each request was sent."""

    def __init__(self, kind: str, address: str):
        self.kind, self.address = kind, address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
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

    def __init__(self, kind: str, addresses: list[str], replicas: list | None = None):
        """Remote replicas at `addresses`, or the given `replicas` (an in-process LocalDraft)."""
        if not addresses and not replicas:
            raise ValueError(f"no {kind} replica address configured")
        self.kind = kind
        self.replicas = list(replicas) if replicas else [Replica(kind, a) for a in addresses]
        self.assignment: dict[str, Replica] = {}
        self._turn = 0  # rotates the choice among equally loaded replicas

    def assign(self, req_id: str) -> Replica | None:
        rep = self.assignment.get(req_id)
        if rep is not None and rep.live:
            return rep
        if rep is not None:
            rep.requests.discard(req_id)
        candidates = [r for r in self.replicas if r.live]
        if not candidates:
            self.assignment.pop(req_id, None)
            return None
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
