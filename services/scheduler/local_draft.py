"""A draft replica inside the scheduler's own process, for n-gram drafting (`--draft-addrs local`).

An n-gram lookup needs no weights and takes well under a millisecond, while the hop to a draft
service and back costs a few (vLLM and SGLang also run n-gram lookup in their engine process).
This replica answers the same ProposeStep messages as a remote draft service, through the same
step code (DraftServicer.step), called directly instead of over a stream; the scheduler's loop,
its warm-up and its releases treat it like any other draft replica.
"""

from __future__ import annotations

import logging

from services.common.worker import check_step
from services.draft.ngram import NgramProposer
from services.draft.servicer import DraftServicer
from services.scheduler.workers import WorkerDown
from specserve.v1 import common_pb2, draft_pb2

log = logging.getLogger(__name__)

LOCAL = "local"  # the --draft-addrs value that selects it


class LocalDraft:
    """The Replica interface (kind, address, live, sent, requests, info, step, close) in-process."""

    kind = "draft"
    address = LOCAL
    live = True  # it fails only with the scheduler itself

    def __init__(self, target: common_pb2.InfoResponse):
        info = common_pb2.InfoResponse(model=target.model, vocab_size=target.vocab_size,
                                       max_positions=target.max_positions, eos_token_ids=target.eos_token_ids,
                                       role="draft", proposer=NgramProposer.name, device="cpu")
        self.servicer = DraftServicer(NgramProposer(), info)
        self.sent: dict[str, int] = {}  # request id -> committed tokens it has
        self.requests: set[str] = set()  # requests assigned here

    async def info(self, timeout: float = 5.0) -> common_pb2.InfoResponse:
        return self.servicer.worker.info

    async def step(self, message: draft_pb2.ProposeStep) -> draft_pb2.ProposeResult:
        try:
            check_step(message)
            return self.servicer.step(message)
        except Exception as e:  # a bug, not an outage: log it, start afresh as a new stream would
            log.exception("local draft step %d failed", message.step_id)
            for rid in self.servicer.worker.ledger.ids():
                self.servicer.worker.release(rid)
            self.sent.clear()
            raise WorkerDown(f"local draft: {e}") from e

    async def close(self) -> None:
        pass
