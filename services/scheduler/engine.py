"""The in-process engine: the step (core.py) with the draft and the verifier in this process, for
the CLI, the tests and the benchmarks. The scheduler service drives the same step over gRPC
(loop.py), so both give the same tokens and `bench spec` times the code the service runs.

In-process workers answer at once, so a step never waits on anything: `run_now` runs it to the
end without an event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Coroutine
from dataclasses import replace

from services.common.constraint import Constraints
from services.common.loading import LoadedModel
from services.common.sampling import SamplingParams
from services.common.worker import StepWorker
from services.draft.proposer import ProposeWork, Proposer
from services.scheduler.calibration import WarmUp
from services.scheduler.core import StepConfig, StepCore, Target
from services.scheduler.request import Request
from services.scheduler.workers import LocalWorkers
from services.verifier.verifier import Verifier, VerifyWork
from specserve.v1 import common_pb2

# The engine's caller holds every prompt already: it queues them all (no KV budget, no 429).
UNBOUNDED = 1 << 40


def run_now(coro: Coroutine):
    """The result of a coroutine that never suspends (it awaits only in-process workers)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("an in-process step waited on I/O: it needs an event loop")


class Engine:
    def __init__(self, target: LoadedModel, proposer: Proposer | None, config: StepConfig | None = None,
                 draft_name: str | None = None, warm_up: bool = True):
        """`draft_name` names the draft in the calibration cache's key (default: the proposer's
        kind); `warm_up=False` leaves the latency model at its priors (tests)."""
        self.config = replace(config or StepConfig(), kv_budget_tokens=UNBOUNDED, max_waiting=UNBOUNDED)
        self.target, self.tokenizer, self.proposer = target, target.tokenizer, proposer
        c = target.config
        self.eos_token_ids = target.eos_token_ids
        grammars = Constraints(self.tokenizer, c.vocab_size, self.eos_token_ids)  # one engine for all three roles
        self.verifier = Verifier(target.model, grammars)
        info = common_pb2.InfoResponse(model=target.name, vocab_size=c.vocab_size, max_positions=c.max_positions)
        self.verifiers = LocalWorkers("verifier", StepWorker(info, 1, VerifyWork(self.verifier)))
        self.drafts = None
        if proposer is not None:
            self.drafts = LocalWorkers("draft", StepWorker(info, 0, ProposeWork(proposer, grammars)),
                                       max_positions=proposer.max_positions,
                                       feature_layers=proposer.feature_layers, min_match=proposer.min_match)
        self.core = StepCore(self.config, Target(self.tokenizer, self.eos_token_ids, c.max_positions, c.vocab_size,
                                                 target.model.matmul.small_rows, grammars),
                             self.verifiers, self.drafts)
        self.controller = self.core.controller
        pair = f"{target.name}|{draft_name or (proposer.name if proposer else 'none')}"
        self.warmed: WarmUp | None = run_now(self.core.warm_up(pair)) if warm_up else None
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str | None = None) -> Request:
        return self.core.submit(req_id or f"req-{next(self._ids)}", prompt_ids, params)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one step; (request, tokens committed this step) for every running request."""
        return run_now(self.core.step())

    def cancel(self, req_id: str) -> bool:
        return self.core.cancel(req_id) is not None

    def held_requests(self) -> list[str]:
        """Requests whose state a worker still holds (none once every request has finished)."""
        held = self.verifiers.worker.sequences.ids()
        return held + (self.drafts.worker.sequences.ids() if self.drafts is not None else [])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Run prompts to completion (batched up to max_batch); results in prompt order."""
        reqs = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return reqs
