"""The step loop, embedded mode: propose, verify, commit for every running request of a batch.

Requests join and leave between steps (continuous batching). The same loop drives the draft and
verifier services over gRPC; here both run in-process, for the CLI, tests and benchmarks.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from services.common.loading import LoadedModel
from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.draft.proposer import ProposeItem, Proposer
from services.scheduler.calibration import calibrate_local
from services.scheduler.controller import ControllerConfig, DraftController
from services.scheduler.latency import StepShape
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH
from services.scheduler.request import Request
from services.scheduler.telemetry import StepRecord, Telemetry
from services.verifier.verifier import Verifier, VerifyItem


@dataclass
class EngineConfig:
    # k, the draft tree depth per step (0 = plain decoding), or "adaptive": the controller picks
    # each request's k in [min_draft_length, max_draft_length] every step.
    draft_length: int | str = 4
    tree_size: int | None = None  # draft nodes per step; None = draft_length (a chain)
    max_batch: int = 16  # running requests per step
    min_draft_length: int = 0
    max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH
    adjust_interval_ms: float = 0.0

    @property
    def adaptive(self) -> bool:
        return self.draft_length == "adaptive"

    def validate(self) -> None:
        if not self.adaptive and (isinstance(self.draft_length, bool) or not isinstance(self.draft_length, int)):
            raise ValueError(f"draft_length must be an integer or 'adaptive', got {self.draft_length!r}")
        if not self.adaptive and self.draft_length < 0:
            raise ValueError(f"draft_length must be >= 0, got {self.draft_length}")
        if self.tree_size is not None and not 0 <= self.tree_size <= 256:
            raise ValueError(f"tree_size must be in [0, 256], got {self.tree_size}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")


@dataclass
class StepTiming:
    draft_s: float = 0.0
    verify_s: float = 0.0
    batch: int = 0


class Engine:
    def __init__(self, target: LoadedModel, proposer: Proposer | None, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self.target = target
        self.tokenizer = target.tokenizer
        self.proposer = proposer
        self.verifier = Verifier(target.model)
        self.max_positions = target.config.max_positions
        eos = set(target.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.last_timing = StepTiming()
        self._ids = itertools.count()
        self.controller: DraftController | None = None
        if self.config.adaptive and proposer is not None:
            cfg = self.config
            width = -(-cfg.tree_size // cfg.max_draft_length) if cfg.tree_size else 1
            self.telemetry = Telemetry(None, "in-process")  # priors shared by this engine's requests
            self.controller = DraftController(
                ControllerConfig(cfg.min_draft_length, cfg.max_draft_length, width, cfg.adjust_interval_ms,
                                 route_rows=target.model.matmul.small_rows),
                priors=lambda cls: self.telemetry.priors(cls, cfg.max_draft_length))
            self._calibrated = False

    def add_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str | None = None) -> Request:
        params.validate()
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_positions:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds the context of {self.max_positions} tokens")
        cfg = self.config
        k = (cfg.max_draft_length if cfg.adaptive else cfg.draft_length) if self.proposer is not None else 0
        tree = k if cfg.tree_size is None else cfg.tree_size
        req = Request(req_id or f"req-{next(self._ids)}", prompt_ids, params, self.tokenizer,
                      self.eos_token_ids, draft_length=k, tree_size=tree)
        if self.controller is not None:
            self.controller.add(req.req_id, greedy=params.greedy)
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _draft_budget(self, req: Request) -> tuple[int, int]:
        k = req.draft_length
        limit = self.proposer.max_positions if self.proposer is not None else None
        if limit is not None:  # a draft with a shorter context than the target stops drafting
            k = min(k, limit - len(req.prompt_ids) - len(req.output_ids))
        return req.draft_budget(k)

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one step; returns (request, tokens committed this step) for every running request."""
        while self.waiting and len(self.running) < self.config.max_batch:
            self.running.append(self.waiting.popleft())
        batch = self.running
        if not batch:
            return []
        budgets = [self._draft_budget(r) for r in batch]
        if self.controller is not None:
            if not self._calibrated:  # warm-up: seed the latency model before the first plan
                cw = self.controller.config
                calibrate_local(self.controller.latency, self.verifier, self.proposer, self.target.config.vocab_size,
                                cw.max_draft_length, cw.tree_width)
                self._calibrated = True
            chosen = self.controller.choose({r.req_id: k for r, (k, _) in zip(batch, budgets)})
            budgets = [(chosen[r.req_id].k, min(chosen[r.req_id].tree_size, 256)) for r in batch]
        t0 = time.perf_counter()
        if self.proposer is not None and any(k for k, _ in budgets):
            trees = self.proposer.propose([
                ProposeItem(r.req_id, r.tokens, k, n, r.params, r.draft_generator)
                for r, (k, n) in zip(batch, budgets)])
        else:
            trees = [DraftTree() for _ in batch]
        proposed = (sum(len(t) for t in trees), max((max(t.depths(), default=0) for t in trees), default=0))
        confs = None
        if self.controller is not None and proposed[0]:  # keep the nodes that pay
            trees, confs = self.controller.trim([r.req_id for r in batch], trees, [r.params.greedy for r in batch],
                                                (time.perf_counter() - t0) * 1e3, len(batch))
        t1 = time.perf_counter()
        verdicts = self.verifier.verify([
            VerifyItem(r.req_id, r.tokens, tree, r.params, r.verify_generator)
            for r, tree in zip(batch, trees)])
        t2 = time.perf_counter()
        self.last_timing = StepTiming(t1 - t0, t2 - t1, len(batch))
        out = []
        if self.controller is not None:
            depths = [max(t.depths(), default=0) for t in trees]
            shape = StepShape(len(batch), sum(1 for k, _ in budgets if k), proposed[0], proposed[1],
                              verified=sum(len(t) for t in trees))
            self.controller.observe(shape, (t1 - t0) * 1e3, (t2 - t1) * 1e3, {
                r.req_id: (d, len(v.accepted_nodes), len(v.tokens)) for r, d, v in zip(batch, depths, verdicts)},
                prefill=any(r.stats.steps == 0 for r in batch))
            for i, (tree, d, v) in enumerate(zip(trees, depths, verdicts)):
                if confs is not None and confs[i] is not None:
                    self.controller.observe_nodes(batch[i].req_id, tree, confs[i], v.accepted_nodes)
                if d:
                    self.telemetry.record(StepRecord("default", d, len(v.accepted_nodes), len(tree),
                                                     (t1 - t0) * 1e3, (t2 - t1) * 1e3))
        for req, tree, verdict in zip(batch, trees, verdicts):
            out.append((req, req.commit(verdict.tokens, len(tree), len(verdict.accepted_nodes))))
            if req.finished:
                self.release(req)
        self.running = [r for r in self.running if not r.finished]
        return out

    def release(self, req: Request) -> None:
        if self.controller is not None:
            self.controller.remove(req.req_id)
        self.verifier.release(req.req_id)
        if self.proposer is not None:
            self.proposer.release(req.req_id)

    def cancel(self, req_id: str) -> bool:
        for queue in (self.running, self.waiting):
            for r in list(queue):
                if r.req_id == req_id:
                    queue.remove(r)
                    r.finish_reason = "cancelled"
                    self.release(r)
                    return True
        return False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Run prompts to completion (batched up to max_batch); results in prompt order."""
        reqs = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return reqs
