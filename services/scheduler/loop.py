"""The scheduler's continuous-batching loop over remote draft and verifier replicas.

Each step: propose (one ProposeStep per draft replica, all running requests), verify (one
VerifyStep per verifier replica: one forward for all its requests), commit, stream events.
Requests join and leave between steps. A failed draft replica costs only speculation (its
requests decode plainly until it is back); a failed verifier replica's requests move to another
replica and are re-prefilled from their committed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from services.common import codec
from services.common.metrics import Registry, SchedulerMetrics
from services.common.sampling import SamplingParams
from services.common.tracing import RequestSpans
from services.common.tree import DraftTree
from services.scheduler.admission import DEFAULT_KV_BUDGET_TOKENS, DEFAULT_MAX_WAITING, Admission, reservation
from services.scheduler.request import Request
from services.scheduler.controller import ControllerConfig, DraftController
from services.scheduler.latency import StepShape
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH
from services.scheduler.telemetry import StepRecord, Telemetry
from services.scheduler.workers import Replica, ReplicaSet, WorkerDown
from specserve.v1 import draft_pb2, scheduler_pb2, verifier_pb2

log = logging.getLogger(__name__)


@dataclass
class Live:
    """A running request plus what its client has been sent."""

    req: Request
    fixed_k: int | None  # None: the controller chooses
    request_class: str = "default"
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    params_pb: object = None
    emitted_chars: int = 0
    unavailable: bool = False  # failed for want of a worker replica (retryable elsewhere)


class SchedulerLoop:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_positions: int, drafts: ReplicaSet,
                 verifiers: ReplicaSet, telemetry: Telemetry, draft_length: str = "adaptive",
                 max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH, tree_size: int | None = None, max_batch: int = 16,
                 controller: ControllerConfig | None = None, metrics: SchedulerMetrics | None = None,
                 kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS, max_waiting: int = DEFAULT_MAX_WAITING,
                 vocab_size: int | None = None):
        self.tokenizer, self.eos_token_ids, self.max_positions = tokenizer, eos_token_ids, max_positions
        self.vocab_size = vocab_size  # prompt ids are checked against it (the workers would refuse the step)
        self.drafts, self.verifiers, self.telemetry = drafts, verifiers, telemetry
        self.adaptive = draft_length == "adaptive"
        self.draft_length = max_draft_length if self.adaptive else int(draft_length)
        self.tree_size, self.max_batch = tree_size, max_batch
        self.controller = None
        if self.adaptive:
            cfg = controller or ControllerConfig(max_draft_length=max_draft_length)
            cfg.tree_width = -(-tree_size // cfg.max_draft_length) if tree_size else 1
            self.controller = DraftController(cfg, priors=lambda cls: telemetry.priors(cls, cfg.max_draft_length))
        self.admission = Admission(kv_budget_tokens, max_waiting, max_batch)  # mirrors waiting / running
        self.waiting: list[Live] = []
        self.running: list[Live] = []
        self.by_id: dict[str, Live] = {}
        self.releases: dict[Replica, list[str]] = {}
        self.wake = asyncio.Event()
        self.accepting = True
        self.steps = 0
        self.max_batch_seen = 0
        self.metrics = metrics or SchedulerMetrics(Registry("scheduler"))
        if self.controller is not None:
            self.metrics.watch_controller(self.controller)
        self.metrics.watch_admission(self.admission)
        self.spans = RequestSpans("specserve.scheduler")  # the servicer opens each request's span

    # -- requests ---------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               draft_length: int | None = None, tree_size: int | None = None,
               request_class: str = "default") -> Live:
        """Queue a request; raises ValueError for bad input (also a request too large for the KV
        budget), Overloaded when the queue is full, RuntimeError when shutting down."""
        if not self.accepting:
            self.admission.rejections["shutting_down"] += 1
            raise RuntimeError("scheduler is shutting down")
        if req_id in self.by_id:
            raise ValueError(f"request id {req_id!r} is already running")
        params.validate()
        if self.vocab_size:
            bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        for name, value in (("draft_length", draft_length), ("tree_size", tree_size)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_positions:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context of {self.max_positions} tokens")
        k = self.draft_length if draft_length is None else draft_length
        req = Request(req_id, prompt_ids, params, self.tokenizer, self.eos_token_ids, draft_length=k,
                      tree_size=tree_size if tree_size is not None else (self.tree_size or k))
        live = Live(req, fixed_k=draft_length if draft_length is not None else (None if self.adaptive else k),
                    request_class=request_class or "default", params_pb=codec.params_to_pb(params))
        # The largest tree a step may give it: as asked, or what the controller may choose.
        max_tree = req.tree_size if live.fixed_k is not None else self.draft_length * self.controller.config.tree_width
        self.admission.enqueue(req_id, reservation(len(prompt_ids), params.max_tokens, min(max_tree, 256)),
                               params.max_tokens)
        if live.fixed_k is None:
            self.controller.add(req_id, live.request_class, greedy=params.greedy)
        self.by_id[req_id] = live
        self.waiting.append(live)
        self.wake.set()
        return live

    def cancel(self, req_id: str) -> None:
        live = self.by_id.get(req_id)
        if live is not None and not live.req.finished:
            live.req.finish_reason = "cancelled"
            self._retire(live)

    def _retire(self, live: Live) -> None:
        """Forget a finished request everywhere: its replicas free it with the next message."""
        rid = live.req.req_id
        self.by_id.pop(rid, None)
        self.admission.release(rid)
        if self.controller is not None:
            self.controller.remove(rid)
        for group in (self.waiting, self.running):
            if live in group:
                group.remove(live)
        for rs in (self.drafts, self.verifiers):
            rep = rs.forget(rid)
            if rep is not None:
                self.releases.setdefault(rep, []).append(rid)
        self.wake.set()

    def _emit(self, live: Live, tokens: list[int], error: str = "") -> None:
        req = live.req
        text = req.detok.text if req.finished else req.detok.stable_text()
        event = scheduler_pb2.GenerateEvent(token_ids=tokens, text=text[live.emitted_chars:])
        live.emitted_chars = len(text)
        if req.finished:
            s = req.summary()
            event.finish_reason = "error" if error else req.finish_reason
            event.error = error
            event.usage.CopyFrom(scheduler_pb2.Usage(
                prompt_tokens=s["prompt_tokens"], completion_tokens=s["completion_tokens"], steps=s["steps"],
                drafted_tokens=s["drafted_tokens"], accepted_tokens=s["accepted_tokens"],
                mean_accepted_length=s["mean_accepted_length"], acceptance_rate=s["acceptance_rate"]))
        live.events.put_nowait(event)

    def _fail(self, live: Live, message: str, unavailable: bool = False) -> None:
        live.req.finish_reason = "error"
        live.unavailable = unavailable
        self._emit(live, [], error=message)
        self._retire(live)

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            # Clear before looking: a request submitted while this task awaits below sets it again.
            self.wake.clear()
            if not (self.waiting or self.running):
                await self._send_releases()
                if not (self.waiting or self.running):
                    await self.wake.wait()
                continue
            try:
                await self.step()
            except Exception:  # never let one bad step kill the loop
                log.exception("step failed")
                await asyncio.sleep(0.05)

    async def drain(self) -> None:
        """Stop accepting requests; return when every running one has finished."""
        self.accepting = False
        while self.waiting or self.running:
            await asyncio.sleep(0.05)
        await self._send_releases()

    def _budgets(self, batch: list[Live]) -> dict[str, tuple[int, int]]:
        """(draft length, tree budget) per request: fixed ones as asked, the rest from the controller."""
        out, caps = {}, {}
        for lv in batch:
            if lv.fixed_k is None:
                caps[lv.req.req_id] = lv.req.draft_budget(self.draft_length)[0]
            else:
                out[lv.req.req_id] = lv.req.draft_budget(lv.fixed_k)
        if caps:
            for rid, d in self.controller.choose(caps).items():
                out[rid] = (d.k, min(d.tree_size, 256))
                self.metrics.record_choice(*out[rid])
        return out

    def _trim(self, batch: list[Live], trees: dict[str, DraftTree], spent_s: float) -> dict[str, list[float]]:
        """Cut the adaptive requests' trees to the nodes worth verifying (in place); their
        nodes' confidences, to learn from once verified."""
        lives = [lv for lv in batch if len(trees.get(lv.req.req_id, ()))]
        if self.controller is None or not any(lv.fixed_k is None for lv in lives):
            return {}
        rids = [lv.req.req_id for lv in lives]
        kept, confs = self.controller.trim(rids, [trees[r] for r in rids], [lv.req.params.greedy for lv in lives],
                                           spent_s * 1e3, len(batch), [lv.fixed_k is None for lv in lives])
        trees.update(zip(rids, kept))
        return {rid: conf for rid, conf in zip(rids, confs) if conf is not None}

    async def _send_releases(self) -> None:
        pending, self.releases = self.releases, {}
        for rep, ids in pending.items():
            msg = (draft_pb2.ProposeStep(release=ids) if rep.kind == "draft" else verifier_pb2.VerifyStep(release=ids))
            try:
                await rep.step(msg)
            except WorkerDown as e:  # its stream is gone, and with it the replica's state for these
                log.info("release not delivered (%s): the replica dropped the state with the stream", e)

    async def _exchange(self, groups: dict[Replica, list[Live]], build) -> dict[Replica, object]:
        """Send one step message per replica concurrently; a failed replica maps to None."""
        reps = list(groups)
        msgs = [build(rep, groups[rep], self.releases.pop(rep, [])) for rep in reps]
        results = await asyncio.gather(*(rep.step(m) for rep, m in zip(reps, msgs)), return_exceptions=True)
        out = {}
        for rep, res in zip(reps, results):
            if isinstance(res, WorkerDown):
                log.warning("%s", res)
                res = None
            elif isinstance(res, BaseException):
                raise res
            out[rep] = res
        return out

    def _new_tokens(self, rep: Replica, live: Live) -> tuple[int, list[int]]:
        tokens = live.req.tokens
        offset = rep.sent.get(live.req.req_id, 0)
        return offset, tokens[offset:]

    async def step(self) -> None:
        # First come, first served, within max_batch and the KV budget (services/scheduler/admission.py).
        while self.waiting and self.admission.admit(self.waiting[0].req.req_id):
            self.running.append(self.waiting.pop(0))
        batch = list(self.running)
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        t0 = time.perf_counter()
        # Propose.
        budgets = self._budgets(batch)
        draft_groups: dict[Replica, list[Live]] = {}
        for lv in batch:
            if budgets[lv.req.req_id][0] > 0:
                rep = self.drafts.assign(lv.req.req_id)
                if rep is not None:
                    draft_groups.setdefault(rep, []).append(lv)

        prefills: set[str] = set()  # requests a worker receives from their first token this step

        def build_propose(rep, lives, release):
            items = []
            for lv in lives:
                offset, new = self._new_tokens(rep, lv)
                if offset == 0:
                    prefills.add(lv.req.req_id)
                k, tree_size = budgets[lv.req.req_id]
                items.append(draft_pb2.ProposeItem(request_id=lv.req.req_id, offset=offset, tokens=new,
                                                   draft_length=k, tree_size=tree_size, params=lv.params_pb,
                                                   traceparent=self.spans.first(lv.req.req_id, offset)))
            return draft_pb2.ProposeStep(step_id=self.steps, items=items, release=release)

        trees: dict[str, DraftTree] = {}
        draft_ms = 0.0
        for rep, res in (await self._exchange(draft_groups, build_propose)).items():
            if res is None:
                continue
            draft_ms = max(draft_ms, res.timing.compute_ms)
            for lv, prop in zip(draft_groups[rep], res.proposals):
                if prop.need_resync:
                    rep.sent[lv.req.req_id] = 0
                else:
                    rep.sent[lv.req.req_id] = len(lv.req.tokens)
                    trees[lv.req.req_id] = codec.tree_from_pb(prop.tree)
        proposed = (sum(len(t) for t in trees.values()), max((max(t.depths(), default=0) for t in trees.values()),
                                                             default=0))
        confs = self._trim(batch, trees, time.perf_counter() - t0)
        t1 = time.perf_counter()
        # Verify.
        verify_groups: dict[Replica, list[Live]] = {}
        for lv in batch:
            rep = self.verifiers.assign(lv.req.req_id)
            if rep is None:
                self._fail(lv, "no verifier replica is available", unavailable=True)
                continue
            verify_groups.setdefault(rep, []).append(lv)

        def build_verify(rep, lives, release):
            items = []
            for lv in lives:
                offset, new = self._new_tokens(rep, lv)
                if offset == 0:
                    prefills.add(lv.req.req_id)
                tree = trees.get(lv.req.req_id, DraftTree())
                items.append(verifier_pb2.VerifyItem(request_id=lv.req.req_id, offset=offset, tokens=new,
                                                     tree=codec.tree_to_pb(tree), params=lv.params_pb,
                                                     traceparent=self.spans.first(lv.req.req_id, offset)))
            return verifier_pb2.VerifyStep(step_id=self.steps, items=items, release=release)

        results = await self._exchange(verify_groups, build_verify)
        t2 = time.perf_counter()
        self.steps += 1
        self.metrics.record_phases(t1 - t0, t2 - t1)
        self.admission.record_step(t2 - t0)
        if log.isEnabledFor(logging.DEBUG):
            worker_ms = max((r.timing.compute_ms for r in results.values() if r is not None), default=0.0)
            log.debug("step %d: %d requests, draft %.1f ms (worker %.1f), verify %.1f ms (worker %.1f)",
                      self.steps, len(batch), (t1 - t0) * 1e3, draft_ms, (t2 - t1) * 1e3, worker_ms)
        outcomes: dict[str, tuple[int, int, int]] = {}  # (depth, accepted, output tokens)
        finished: list[Live] = []
        for rep, res in results.items():
            if res is None:  # the replica failed: its requests are reassigned and re-prefilled
                continue
            for lv, verdict in zip(verify_groups[rep], res.verdicts):
                rid = lv.req.req_id
                if verdict.need_resync:
                    rep.sent[rid] = 0
                    continue
                rep.sent[rid] = len(lv.req.tokens)
                tree = trees.get(rid, DraftTree())
                accepted = len(verdict.accepted_nodes)
                if rid in confs:
                    self.controller.observe_nodes(rid, tree, confs[rid], list(verdict.accepted_nodes))
                committed = lv.req.commit(list(verdict.tokens), len(tree), accepted)
                self.metrics.record_step(len(tree), accepted)
                if rid in self.spans.spans:  # a traced request: its step span
                    self.spans.step(rid, "scheduler.step", t0, t2, {
                        "specserve.step_id": self.steps - 1, "specserve.batch_size": len(batch),
                        "specserve.draft_length": budgets[rid][0], "specserve.tree_size": len(tree),
                        "specserve.accepted_tokens": accepted, "specserve.output_tokens": len(committed),
                        "specserve.draft_ms": (t1 - t0) * 1e3, "specserve.verify_ms": (t2 - t1) * 1e3})
                depth = max(tree.depths(), default=0)
                outcomes[rid] = (depth, accepted, len(verdict.tokens))
                if tree.tokens:
                    self.telemetry.record(StepRecord(lv.request_class, depth, accepted, len(tree),
                                                     (t1 - t0) * 1e3, (t2 - t1) * 1e3))
                self._emit(lv, committed)
                if lv.req.finished:
                    finished.append(lv)
        if self.controller is not None and outcomes:
            shape = StepShape(len(batch), sum(len(v) for v in draft_groups.values()), proposed[0], proposed[1],
                              verified=sum(len(t) for t in trees.values()))
            self.controller.observe(shape, (t1 - t0) * 1e3, (t2 - t1) * 1e3, outcomes, prefill=bool(prefills))
        for lv in finished:
            self._retire(lv)
        self.telemetry.flush()
