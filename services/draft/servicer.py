"""DraftService: protobuf in, proposer calls, protobuf out. One long-lived stream per scheduler."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from services.common import codec
from services.common.metrics import CallbackCounter, WorkerMetrics
from services.common.worker import StepWorker
from services.draft.proposer import ProposeItem, Proposer
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, info: common_pb2.InfoResponse, metrics: WorkerMetrics | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.proposer = proposer
        self.worker = StepWorker(info, 0, proposer.release, proposer.cache_bytes, metrics, executor,
                                 inline=not proposer.runs_model)
        slim_state = getattr(proposer, "slim_state", None)
        if metrics is not None and slim_state is not None:  # SlimSpec guard: slim -> full head switches
            CallbackCounter(metrics.registry, "specserve:slimspec_fallbacks",
                            "Switches of the draft from its SlimSpec head to the full head by the quality guard",
                            lambda: (slim_state() or {}).get("fallbacks", 0))

    def step(self, step: draft_pb2.ProposeStep) -> draft_pb2.ProposeResult:
        """Answer one step message (on the model thread, or in-process: services/scheduler/local_draft.py)."""
        started = time.perf_counter()
        for rid in step.release:
            self.worker.release(rid)
        items, slots, proposals = [], [], []
        for pb in step.items:
            self.worker.trace(pb.request_id, pb.traceparent)
            tokens = self.worker.ledger.update(pb.request_id, pb.offset, list(pb.tokens))
            proposals.append(draft_pb2.Proposal(request_id=pb.request_id, need_resync=tokens is None))
            if tokens is None or pb.draft_length <= 0:
                continue
            params = codec.params_from_pb(pb.params)
            items.append(ProposeItem(pb.request_id, tokens, pb.draft_length, pb.tree_size, params,
                                     self.worker.generator(pb.request_id, params)))
            slots.append(len(proposals) - 1)
        if items:
            for slot, tree in zip(slots, self.proposer.propose(items)):
                proposals[slot].tree.CopyFrom(codec.tree_to_pb(tree))
        traced = {}
        if self.worker.spans.spans:  # only for traced requests
            traced = {pb.request_id: {"specserve.step_id": step.step_id, "specserve.draft_length": pb.draft_length,
                                      "specserve.tree_size": pb.tree_size, "specserve.tree_nodes": len(p.tree.tokens),
                                      "specserve.batch_size": len(items), "specserve.need_resync": p.need_resync}
                      for pb, p in zip(step.items, proposals) if pb.request_id in self.worker.spans.spans}
        self.worker.count_step(len(items), started, traced)
        timing = common_pb2.StepTiming(compute_ms=(time.perf_counter() - started) * 1e3, batch_size=len(items),
                                       tokens=sum(len(p.tree.tokens) for p in proposals))
        return draft_pb2.ProposeResult(step_id=step.step_id, proposals=proposals, timing=timing)

    async def Propose(self, request_iterator, context):
        async for result in self.worker.serve_stream(request_iterator, context, self.step):
            yield result

    async def Info(self, request, context):
        return self.worker.info

    async def State(self, request, context):
        return self.worker.state()
