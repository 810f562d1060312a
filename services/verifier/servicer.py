"""VerifierService: protobuf in, one batched verification per step, protobuf out."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from services.common import codec
from services.common.metrics import WorkerMetrics
from services.common.tree import MAX_TREE_NODES
from services.common.worker import StepWorker
from services.verifier.verifier import Verifier, VerifyItem
from specserve.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, verifier: Verifier, info: common_pb2.InfoResponse, metrics: WorkerMetrics | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.verifier = verifier
        self.worker = StepWorker(info, 1, verifier.release, verifier.cache_bytes, metrics, executor)

    def _step(self, step: verifier_pb2.VerifyStep) -> verifier_pb2.VerifyResult:
        started = time.perf_counter()
        for rid in step.release:
            self.worker.release(rid)
        items, slots, verdicts = [], [], []
        for pb in step.items:
            self.worker.trace(pb.request_id, pb.traceparent)
            tokens = self.worker.ledger.update(pb.request_id, pb.offset, list(pb.tokens))
            verdicts.append(verifier_pb2.Verdict(request_id=pb.request_id, need_resync=tokens is None))
            if tokens is None:
                continue
            params = codec.params_from_pb(pb.params)
            items.append(VerifyItem(pb.request_id, tokens, codec.tree_from_pb(pb.tree, MAX_TREE_NODES), params,
                                    self.worker.generator(pb.request_id, params)))
            slots.append(len(verdicts) - 1)
        if items:  # one target forward for every request of the step
            for slot, item, verdict in zip(slots, items, self.verifier.verify(items)):
                verdicts[slot].CopyFrom(codec.verdict_to_pb(item.req_id, verdict))
        traced = {}
        if self.worker.spans.spans:  # only for traced requests
            traced = {pb.request_id: {"specserve.step_id": step.step_id, "specserve.tree_nodes": len(pb.tree.tokens),
                                      "specserve.accepted_tokens": len(v.accepted_nodes),
                                      "specserve.output_tokens": len(v.tokens), "specserve.bonus": v.bonus,
                                      "specserve.batch_size": len(items), "specserve.need_resync": v.need_resync}
                      for pb, v in zip(step.items, verdicts) if pb.request_id in self.worker.spans.spans}
        self.worker.count_step(len(items), started, traced)
        timing = common_pb2.StepTiming(compute_ms=(time.perf_counter() - started) * 1e3, batch_size=len(items),
                                       tokens=sum(len(i.tree) + 1 for i in items))
        return verifier_pb2.VerifyResult(step_id=step.step_id, verdicts=verdicts, timing=timing)

    async def Verify(self, request_iterator, context):
        async for result in self.worker.serve_stream(request_iterator, context, self._step):
            yield result

    async def Info(self, request, context):
        return self.worker.info

    async def State(self, request, context):
        return self.worker.state()
