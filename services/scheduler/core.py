"""The step: one round of speculation for every running request, written once for the
in-process engine (services/scheduler/engine.py) and the scheduler service (loop.py).

    admit -> plan k -> propose -> trim -> verify -> commit -> observe -> emit

Requests join and leave between steps (continuous batching): the head of the queue starts when a
batch slot is free and its KV reservation fits (admission.py). Each request's draft length comes
from its own fixed k or, adaptive, from the controller (controller.py: the latency model and
acceptance estimates), capped by what it may still emit and by the draft's context. Under a step
budget (prefill.py, budget.py) a new prompt joins in chunks after the decode rows (chunked prefill) and
drafts once all of it is in the verifier; trees are cut to a row limit. The draft and
the verifier sit behind one interface (workers.py), in this process or over gRPC (replicas.py);
metrics, spans and the Redis priors watch the step through observers (observers.py). The step
returns what it committed; its driver emits it (the engine returns it, the service streams it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from services.common.sampling import SamplingParams
from services.common.tree import MAX_TREE_NODES, DraftTree
from services.scheduler.admission import DEFAULT_KV_BUDGET_TOKENS, DEFAULT_MAX_WAITING, Admission, reservation
from services.scheduler.budget import DEFAULT_TARGET_ITL_MS, StepBudget
from services.scheduler.calibration import WarmUp, warm_up
from services.scheduler.controller import ControllerConfig, DraftController
from services.scheduler.latency import StepShape, row_context
from services.scheduler.observers import Outcome, PriorsObserver, StepObserver, StepReport
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH
from services.scheduler.prefill import Prefill
from services.scheduler.priors import Priors
from services.scheduler.request import Request
from services.scheduler.workers import Reply, Work, Workers

log = logging.getLogger(__name__)

# A request already streaming waits this long for a verifier replica to return (a restarted
# verifier re-prefills it from its committed tokens) before it fails; one that has streamed
# nothing fails at once, so that its caller can try another scheduler.
HOLD_WITHOUT_VERIFIER_S = 60.0
# A draft that proposes without a lookup match (a model, a feature head, the hybrid): whether the
# request's last ARM_GRAM tokens occurred before splits its adaptive estimates in two (the
# controller's arms): where the end recurs a lookup matches and a draft tends to copy well,
# elsewhere it predicts; one estimate for both over-drafts the second kind.
ARM_GRAM = 2


@dataclass
class StepConfig:
    # k, the draft tree depth per step (0 = plain decoding), or "adaptive": the controller picks
    # each request's k in [min_draft_length, max_draft_length] every step.
    draft_length: int | str = 4
    tree_size: int | None = None  # draft nodes per step; None = draft_length (a chain)
    max_batch: int = 16  # running requests per step
    min_draft_length: int = 0
    max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH
    adjust_interval_ms: float = 0.0
    rejection_alert: float = 0.85
    kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS
    max_waiting: int = DEFAULT_MAX_WAITING
    # Chunked prefill (budget.py): rows per verify forward at most (0: none), and the step time
    # prompts may fill while requests decode (0: none). Both 0: every prompt joins whole.
    max_step_tokens: int = 0
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS

    @property
    def adaptive(self) -> bool:
        return self.draft_length == "adaptive"

    @property
    def tree_width(self) -> int:
        """Adaptive: draft nodes per level of a tree (1 = chains)."""
        return -(-self.tree_size // self.max_draft_length) if self.tree_size else 1

    def validate(self) -> None:
        if not self.adaptive and (isinstance(self.draft_length, bool) or not isinstance(self.draft_length, int)):
            raise ValueError(f"draft_length must be an integer or 'adaptive', got {self.draft_length!r}")
        if not self.adaptive and self.draft_length < 0:
            raise ValueError(f"draft_length must be >= 0, got {self.draft_length}")
        if self.tree_size is not None and not 0 <= self.tree_size <= MAX_TREE_NODES:
            raise ValueError(f"tree_size must be in [0, {MAX_TREE_NODES}], got {self.tree_size}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        StepBudget(self.max_step_tokens, self.target_itl_ms).validate(self.max_batch)


@dataclass
class Target:
    """What the step must know of the target and its tokenizer."""

    tokenizer: object
    eos_token_ids: tuple[int, ...]
    max_positions: int
    vocab_size: int
    route_rows: int = 0  # the verifier's matmul route step (latency.py)
    grammars: object = None  # a Constraints (services/common/constraint.py): checks requests' grammars


class StepCore:
    def __init__(self, config: StepConfig, target: Target, verifiers: Workers, drafts: Workers | None,
                 priors: Priors | None = None, observers: list[StepObserver] | None = None):
        config.validate()
        self.config, self.target = config, target
        self.verifiers, self.drafts = verifiers, drafts
        self.priors = priors or Priors(None, "in-process")  # shared by this core's requests at least
        self.observers = [PriorsObserver(self.priors), *(observers or [])]
        self.controller: DraftController | None = None
        if config.adaptive and drafts is not None:
            cc = ControllerConfig(config.min_draft_length, config.max_draft_length, config.tree_width,
                                  config.adjust_interval_ms, rejection_alert=config.rejection_alert,
                                  route_rows=target.route_rows)
            self.controller = DraftController(cc, priors=lambda cls: self.priors.priors(cls, cc.max_draft_length))
        self.admission = Admission(config.kv_budget_tokens, config.max_waiting, config.max_batch)
        self.prefill = Prefill(StepBudget(config.max_step_tokens, config.target_itl_ms))
        self.waiting: deque[Request] = deque()  # mirrors the admission queue
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.steps = 0
        self.max_batch_seen = 0

    # -- requests -------------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams, draft_length: int | None = None,
               tree_size: int | None = None, request_class: str = "default", follows: str | None = None) -> Request:
        """Queue a request; ValueError for bad input (also one too large for the KV budget),
        admission.Overloaded when the queue is full. `follows`: a request submitted before with
        the same prompt (another of n samples): this one starts once that one has its first token,
        on its replicas, which then copy the prompt's KV instead of computing it again."""
        if req_id in self.by_id:
            raise ValueError(f"request id {req_id!r} is already running")
        self._check(prompt_ids, params, draft_length, tree_size)
        if params.grammar is not None:  # the output, from the prompt's end on, follows it
            params = replace(params, grammar=replace(params.grammar, start=len(prompt_ids)))
        cfg = self.config
        fixed = draft_length if draft_length is not None else (None if self.controller else cfg.draft_length)
        if self.drafts is None:
            fixed = 0
        most = cfg.max_draft_length if fixed is None else fixed
        tree = tree_size if tree_size is not None else (cfg.tree_size if cfg.tree_size is not None else most)
        req = Request(req_id, prompt_ids, params, self.target.tokenizer, self.target.eos_token_ids,
                      draft_length=most, tree_size=tree, fixed_k=fixed, request_class=request_class or "default")
        req.follows = self.by_id.get(follows) if follows else None
        # The largest tree a step may give it: as asked, or what the controller may choose.
        max_tree = req.tree_size if fixed is not None else most * cfg.tree_width
        self.admission.enqueue(req_id, reservation(len(prompt_ids), params.max_tokens, min(max_tree, MAX_TREE_NODES)),
                               params.max_tokens)
        if fixed is None:
            self.controller.add(req_id, req.request_class, greedy=params.greedy)
        self.by_id[req_id] = req
        self.waiting.append(req)
        return req

    def _check(self, prompt_ids: list[int], params: SamplingParams, draft_length: int | None,
               tree_size: int | None) -> None:
        params.validate()
        if params.grammar is not None:
            if self.target.grammars is None:
                raise ValueError("grammar: this scheduler serves no structured outputs")
            self.target.grammars.check(params.grammar)
        vocab = self.target.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None) if vocab else None
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        for name, value in (("draft_length", draft_length), ("tree_size", tree_size)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.target.max_positions:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context of {self.target.max_positions} tokens")

    def cancel(self, req_id: str) -> Request | None:
        req = self.by_id.get(req_id)
        if req is not None and not req.finished:
            req.finish_reason = "cancelled"
            self.retire(req)
        return req

    def fail(self, req: Request, message: str, unavailable: bool = False) -> None:
        req.finish_reason, req.error, req.unavailable = "error", message, unavailable
        self.retire(req)

    def retire(self, req: Request) -> None:
        """Forget a finished request everywhere; remote workers free it with their next message."""
        rid = req.req_id
        self.by_id.pop(rid, None)
        self.admission.release(rid)
        if self.controller is not None:
            self.controller.remove(rid)
        for group in (self.waiting, self.running):
            if req in group:
                group.remove(req)
        for workers in (self.verifiers, self.drafts):
            if workers is not None:
                workers.release(rid)

    async def warm_up(self, pair: str) -> WarmUp | None:
        """Calibrate the latency model before serving (None: nothing to calibrate, no controller)."""
        if self.controller is None:
            return None
        cc = self.controller.config
        return await warm_up(self.controller.latency, self.verifiers, self.drafts, self.target.vocab_size, pair,
                             cc.max_draft_length, cc.tree_width, self.target.max_positions)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_held(self) -> bool:
        """Every running request waits for a verifier replica (a driver pauses between steps)."""
        return bool(self.running) and all(r.held_since is not None for r in self.running)

    # -- the step -------------------------------------------------------------------------------
    async def step(self) -> list[tuple[Request, list[int]]]:
        """One step for every running request: (request, tokens committed) for each that
        committed or failed (a failed one with no tokens and its `error`)."""
        batch = self._admit()
        if not batch:
            return []
        t0 = time.perf_counter()
        decoding, prompts = self.prefill.split(batch)
        held = {r.req_id: len(r.tokens) for r in decoding}  # the tokens each holds: its rows attend to them
        budgets, decisions = self._plan(decoding, held)
        trees, drafted, fresh, draft_compute = await self._propose(decoding, budgets, prompts)
        proposed = (sum(len(t) for t in trees.values()), max((max(t.depths(), default=0) for t in trees.values()),
                                                             default=0))
        confs = self._trim(decoding, trees, time.perf_counter() - t0, held)
        self.prefill.fit_trees(decoding, bool(prompts), trees, confs)
        chunks = self.prefill.chunks(decoding, prompts, trees, (time.perf_counter() - t0) * 1e3)
        t1 = time.perf_counter()
        # A request cancelled while the draft worked is not verified: its release is on its way.
        layers = self.drafts.feature_layers if self.drafts is not None else ()
        works = [Work(r.req_id, r.tokens, r.params, tree=trees.get(r.req_id), state_layers=layers, near=r.near)
                 for r in decoding if not r.finished]
        works += [Work(r.req_id, r.tokens[: r.prefilled + n], r.params, state_layers=layers,
                       prefill=r.prefilled + n < len(r.prompt_ids), near=r.near) for r, n in chunks]
        verified = await self.verifiers.step(self.steps, works)
        t2 = time.perf_counter()
        plan = self.controller.last_plan if decisions else None
        report = StepReport(self.steps, len(batch), t0, t1, t2, decisions=decisions, chunks=[n for _, n in chunks],
                            chunk_starts=[r.prefilled for r, _ in chunks], prompt_rows=self.prefill.rows,
                            predicted=(plan.expected_tokens, plan.step_ms) if plan else None,
                            compute_ms=(draft_compute, verified.compute_ms))
        self.steps += 1
        self.admission.record_step(t2 - t0)
        joined = self.prefill.advance(chunks, verified)
        out = self._commit(decoding + joined, budgets, trees, confs, verified, report)
        if verified.results:  # a step no verifier took times nothing
            self.prefill.observe(report.verify_ms, decoding, trees, verified.fresh)
        if self.controller is not None and report.outcomes:
            shape = self._shape(held, trees, drafted, proposed)
            outcomes = {o.req.req_id: (o.draft_length, o.depth, o.accepted, o.output, len(o.tree))
                        for o in report.outcomes}
            self.controller.observe(shape, report.draft_ms, report.verify_ms, outcomes,
                                    prefill=bool(verified.fresh or fresh or chunks))
        for o in report.outcomes:  # after the controller learnt from their last step
            if o.req.finished:
                self.retire(o.req)
        for observer in self.observers:
            observer.on_step(report)
        return out

    @staticmethod
    def _shape(held: dict[str, int], trees: dict[str, DraftTree], drafted: int, proposed: tuple[int, int]
               ) -> StepShape:
        """The step as the latency model sees it; `held`: the tokens each decoding request held."""
        return StepShape(len(held), drafted, proposed[0], proposed[1], verified=sum(len(t) for t in trees.values()),
                         context=sum(row_context(1, n) for n in held.values()),
                         node_context=sum(row_context(len(trees.get(rid, ())), n) for rid, n in held.items()))

    def _hold(self, req: Request) -> bool:
        """Whether a request no verifier could take waits for one (it is streaming, and has not
        waited HOLD_WITHOUT_VERIFIER_S yet)."""
        if not req.output_ids:
            return False
        now = time.monotonic()
        if req.held_since is None:
            req.held_since = now
            log.warning("no verifier replica for request %s: holding it up to %.0f s", req.req_id,
                        HOLD_WITHOUT_VERIFIER_S)
        return now - req.held_since < HOLD_WITHOUT_VERIFIER_S

    def _admit(self) -> list[Request]:
        """First come, first served, within max_batch and the KV budget (a request following
        another waits for that one's first token, one step)."""
        while self.waiting and self.waiting[0].may_start() and self.admission.admit(self.waiting[0].req_id):
            self.running.append(self.waiting.popleft())
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        return list(self.running)

    def _plan(self, batch: list[Request], held: dict[str, int]
              ) -> tuple[dict[str, tuple[int, int]], list[tuple[int, int]]]:
        """(draft length, tree budget) per request: fixed ones as asked, the rest from the
        controller (`held`: the tokens each holds); and the controller's choices, for metrics. A
        lookup draft is not asked where it has nothing to propose (its call would cost the step a
        round trip for an empty tree), and the controller plans only the requests it could serve."""
        out, caps, arms = {}, {}, {}
        room = self.drafts.max_positions if self.drafts is not None else None
        match = self.drafts.min_match if self.drafts is not None else 0
        for r in batch:
            if self.drafts is not None and not match and r.fixed_k is None:
                arms[r.req_id] = "recurs" if r.recurs(ARM_GRAM) else "new"
            k = r.draft_length if r.fixed_k is None else r.fixed_k
            if room is not None:  # a draft with a shorter context than the target stops drafting
                k = min(k, room - len(r.tokens))
            # A grammar's forced tokens are proposed without a match.
            if k > 0 and match and r.params.grammar is None and not r.recurs(match):
                out[r.req_id] = (0, 0)
                continue
            if r.fixed_k is None:
                caps[r.req_id] = r.draft_budget(k)[0]
            else:
                out[r.req_id] = r.draft_budget(k)
        decisions = []
        if self.controller is not None:
            self.controller.set_arms(arms)
        if caps:
            for rid, d in self.controller.choose(caps, held).items():
                out[rid] = (d.k, min(d.tree_size, MAX_TREE_NODES))
                decisions.append(out[rid])
        return out, decisions

    async def _propose(self, batch: list[Request], budgets: dict[str, tuple[int, int]], prompts: list[Request]
                       ) -> tuple[dict[str, DraftTree], int, set[str], float]:
        """The trees of the requests that draft this step, how many the draft was sent, which of
        them it received from their first token (a prefill), and the draft's own ms. The draft
        also takes the prompt chunks the verifier took last step (chunked prefill)."""
        works = [Work(r.req_id, r.tokens, r.params, *budgets[r.req_id], states=r.take_states(), near=r.near)
                 for r in batch if budgets[r.req_id][0] > 0]
        chunks = [r for r in prompts if r.prefilled > r.draft_prefilled] if self.drafts is not None else []
        if not works and not chunks:
            return {}, 0, set(), 0.0
        reply = await self.drafts.step(self.steps, works + [Work(r.req_id, r.tokens[: r.prefilled], r.params,
                                                                 prefill=True, near=r.near) for r in chunks])
        for r in chunks:
            if r.req_id in reply.results:
                r.draft_prefilled = r.prefilled
        drafting = {w.req_id for w in works}
        trees = {rid: t for rid, t in reply.results.items() if rid in drafting}
        return trees, len(works) - len(drafting.intersection(reply.unplaced)), reply.fresh, reply.compute_ms

    def _trim(self, batch: list[Request], trees: dict[str, DraftTree], spent_s: float, held: dict[str, int]
              ) -> dict[str, list[float]]:
        """Cut the adaptive requests' trees to the nodes worth verifying (in place); their
        nodes' confidences, to learn from once verified. `held`: the tokens each request holds."""
        reqs = [r for r in batch if len(trees.get(r.req_id, ()))]
        if self.controller is None or not any(r.fixed_k is None for r in reqs):
            return {}
        rids = [r.req_id for r in reqs]
        kept, confs = self.controller.trim(rids, [trees[rid] for rid in rids], [r.params.greedy for r in reqs],
                                           spent_s * 1e3, len(batch), [r.fixed_k is None for r in reqs],
                                           [held[rid] for rid in rids], sum(row_context(1, n) for n in held.values()))
        trees.update(zip(rids, kept))
        return {rid: conf for rid, conf in zip(rids, confs) if conf is not None}

    def _commit(self, batch: list[Request], budgets: dict[str, tuple[int, int]], trees: dict[str, DraftTree],
                confs: dict[str, list[float]], verified: Reply, report: StepReport) -> list[tuple[Request, list[int]]]:
        """Commit every verdict (the step retires the requests that finished); fail the requests
        no verifier could take. A request with no verdict (its replica failed or needs a resync)
        commits nothing this step."""
        out = []
        for rid in verified.unplaced:
            req = self.by_id.get(rid)
            if req is not None and not self._hold(req):
                self.fail(req, "no verifier replica is available", unavailable=True)
                out.append((req, []))
        for req in batch:
            verdict = verified.results.get(req.req_id)
            if verdict is None or req.finished:
                continue
            req.held_since = None
            tree = trees.get(req.req_id) or DraftTree()
            if req.req_id in confs:
                self.controller.observe_nodes(req.req_id, tree, confs[req.req_id], list(verdict.accepted_nodes))
            if verdict.states is not None:
                req.states.append(verdict.states)
            committed = req.commit(list(verdict.tokens), len(tree), len(verdict.accepted_nodes), verdict.logprobs)
            report.outcomes.append(Outcome(req, budgets.get(req.req_id, (0, 0))[0], tree, len(verdict.accepted_nodes),
                                           len(verdict.tokens), committed))
            out.append((req, committed))
        return out
