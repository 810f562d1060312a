"""What watches the step without steering it: Redis priors, Prometheus metrics, trace spans, a
step log.

The step (services/scheduler/core.py) hands every observer one `StepReport` per step; each
observer turns it into its own records, so the step names none of them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.common.metrics import SchedulerMetrics
from services.common.tracing import RequestSpans
from services.common.tree import DraftTree
from services.scheduler.priors import Priors, StepRecord
from services.scheduler.request import Request


@dataclass
class Outcome:
    """One request's part of a step that was verified."""

    req: Request
    draft_length: int  # the k it was given
    tree: DraftTree  # the tree verified (after trimming)
    accepted: int  # draft tokens accepted
    output: int  # output tokens the verifier gave (accepted + recovered or bonus)
    committed: list[int]  # those committed (fewer when the request stopped within them)

    @property
    def depth(self) -> int:
        return max(self.tree.depths(), default=0)


@dataclass
class StepReport:
    step_id: int
    batch: int  # requests running
    started: float  # perf_counter at the start, once drafted (trimmed), once verified
    drafted: float
    verified: float
    outcomes: list[Outcome] = field(default_factory=list)
    decisions: list[tuple[int, int]] = field(default_factory=list)  # adaptive (k, tree budget) chosen
    chunks: list[int] = field(default_factory=list)  # prompt tokens sent per prefilling request (chunked prefill)
    chunk_starts: list[int] = field(default_factory=list)  # where each chunk starts in its prompt
    prompt_rows: int = 0  # rows the chunks cost the verifier (a prefix it copies costs none)
    predicted: tuple[float, float] | None = None  # the adaptive plan in force: output tokens, step ms
    compute_ms: tuple[float, float] = (0.0, 0.0)  # the draft's and the verifier's own time (the rest: hops)

    @property
    def draft_ms(self) -> float:
        return (self.drafted - self.started) * 1e3

    @property
    def verify_ms(self) -> float:
        return (self.verified - self.drafted) * 1e3


class StepObserver(ABC):
    @abstractmethod
    def on_step(self, report: StepReport) -> None:
        """Called once per step, after its requests are committed."""


class PriorsObserver(StepObserver):
    """Each drafted request's depth outcomes into its class's shared priors."""

    def __init__(self, priors: Priors):
        self.priors = priors

    def on_step(self, report: StepReport) -> None:
        for o in report.outcomes:
            if o.draft_length:
                self.priors.record(StepRecord(o.req.request_class, o.draft_length, o.accepted, len(o.tree),
                                              report.draft_ms, report.verify_ms))
        self.priors.flush()


class MetricsObserver(StepObserver):
    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics

    def on_step(self, report: StepReport) -> None:
        self.metrics.record_phases(report.draft_ms / 1e3, report.verify_ms / 1e3)
        for k, tree_size in report.decisions:
            self.metrics.record_choice(k, tree_size)
        self.metrics.record_prefill(report.chunks)
        for o in report.outcomes:
            self.metrics.record_step(len(o.tree), o.accepted)


class SpansObserver(StepObserver):
    """A step span under each traced request's scheduler span."""

    def __init__(self, spans: RequestSpans):
        self.spans = spans

    def on_step(self, report: StepReport) -> None:
        for o in report.outcomes:
            rid = o.req.req_id
            if rid in self.spans.spans:
                self.spans.step(rid, "scheduler.step", report.started, report.verified, {
                    "specserve.step_id": report.step_id, "specserve.batch_size": report.batch,
                    "specserve.draft_length": o.draft_length, "specserve.tree_size": len(o.tree),
                    "specserve.accepted_tokens": o.accepted, "specserve.output_tokens": len(o.committed),
                    "specserve.draft_ms": report.draft_ms, "specserve.verify_ms": report.verify_ms})


class StepLogObserver(StepObserver):
    """One JSON line per step appended to a file (the scheduler's `--step-log`): its start, its
    milliseconds drafting and verifying and of them the workers' own (the rest is the hops), the
    batch, the prompt chunks, what the adaptive plan predicted, and per request [k, nodes
    verified, draft tokens accepted, tokens committed]. Where a step's time goes under a real
    load, which the metrics' histograms average away."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # a line at a time

    def on_step(self, report: StepReport) -> None:
        tokens, ms = report.predicted or (None, None)
        self.file.write(json.dumps({
            "step": report.step_id, "started": round(report.started, 6), "draft_ms": round(report.draft_ms, 3),
            "verify_ms": round(report.verify_ms, 3), "draft_compute_ms": round(report.compute_ms[0], 3),
            "verify_compute_ms": round(report.compute_ms[1], 3), "batch": report.batch, "chunks": report.chunks,
            "chunk_starts": report.chunk_starts, "prompt_rows": report.prompt_rows,
            "planned_tokens": tokens, "planned_ms": ms,
            "requests": [[o.draft_length, len(o.tree), o.accepted, len(o.committed)] for o in report.outcomes],
        }) + "\n")

    def close(self) -> None:
        self.file.close()
