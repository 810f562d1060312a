"""DraftController: the adaptive draft length of every running request, step by step.

It keeps one `Acceptance` per request (acceptance.py; seeded from the shared prior of the
request's class), one `LatencyModel` for the step, re-plans with `policy.plan` at most every
`adjust_interval_ms` (and whenever a request joins), learns from every step, and says what it
decided in logs. Once the trees are proposed, `trim` keeps the nodes whose calibrated confidence
pays for their verification (trim.py). Plain Python: the same object serves the gRPC scheduler
and the in-process engine.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.tree import DraftTree
from services.scheduler.acceptance import Acceptance, NodeCalibration, RequestScale
from services.scheduler.latency import LatencyModel, StepShape, row_context
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH, Candidate, Plan, expected_tokens, plan
from services.scheduler.trim import trim, trimmable

log = logging.getLogger(__name__)

PROBE_BACKOFF = 8  # a request's probe interval grows to at most this many times probe_interval
SHARED_DECAY = 0.99  # per request-step, for the nodes verified per token over all requests

PriorLookup = Callable[[str], list]  # request class -> [alpha_1..alpha_max or None]


@dataclass
class ControllerConfig:
    min_draft_length: int = 0
    max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH
    tree_width: int = 1  # draft nodes per level (1 = chains); a request's tree budget is k * width
    adjust_interval_ms: float = 0.0  # re-plan at most this often (0 = every step)
    # A request whose draft has not reached past its planned k for this many steps drafts one
    # level deeper for a step (a probe): a pessimistic estimate (a request class's shared prior
    # after a run of bad drafts) is re-measured instead of holding it at that k for ever. A probe
    # whose level is rejected doubles the request's interval (up to PROBE_BACKOFF times this),
    # until one is accepted or the plan raises its k: where drafting does not pay, probes are
    # pure cost. A request planned at k = 0 probes only in a step where another request drafts
    # (the draft's round trip is paid anyway) or in every probe_interval-th step, so a batch's
    # probes share their steps: each step that drafts costs a plain batch the draft's call and
    # slows the next forward too (at 8 streams one probe a request every 16 steps made a fifth
    # of the steps draft).
    probe_interval: int = 16
    rejection_alert: float = 0.85  # warn when more than this share of draft tokens is rejected
    log_interval_s: float = 10.0  # at most one line per kind per interval
    route_rows: int = 0  # the verifier's matmul route step (latency.LatencyModel; 0 = none)

    def validate(self) -> None:
        if not 0 <= self.min_draft_length <= self.max_draft_length:
            raise ValueError(f"need 0 <= min_draft_length ({self.min_draft_length}) <= max_draft_length "
                             f"({self.max_draft_length})")
        if self.tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {self.tree_width}")
        if self.adjust_interval_ms < 0:
            raise ValueError(f"adjust_interval_ms must be >= 0, got {self.adjust_interval_ms}")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")


@dataclass
class Decision:
    k: int
    tree_size: int


class DraftController:
    def __init__(self, config: ControllerConfig, latency: LatencyModel | None = None,
                 priors: PriorLookup | None = None, clock: Callable[[], float] = time.monotonic):
        config.validate()
        self.config = config
        self.latency = latency or LatencyModel(route_rows=config.route_rows)
        self.priors = priors or (lambda cls: [])
        self.clock = clock
        self.accept: dict[str, Acceptance] = {}
        self.classes: dict[str, str] = {}
        self.current: dict[str, int] = {}
        self.last_plan: Plan | None = None
        self._planned_at = -math.inf
        self._typical_k: int | None = None
        self._last_log: dict[str, float] = {}
        # Rolling draft outcome (decayed counts) for the rejection alert, and the prediction check.
        self.recent_drafted = 0.0
        self.recent_accepted = 0.0
        self.predicted_tokens = 0.0  # expected output tokens of the steps observed so far
        self.observed_tokens = 0  # their actual output tokens
        self.calibration = NodeCalibration()  # node confidence -> acceptance, for trimming
        self.trimmed: dict[str, bool] = {}  # request -> its last tree could be trimmed
        self.idle: dict[str, int] = {}  # request -> steps since its draft last reached past its planned k
        self.probe_every: dict[str, int] = {}  # request -> its probe interval now (backed off)
        self.probing: dict[str, int] = {}  # request -> the depth it probes this step
        self.choices = 0  # steps chosen for so far (probes of undrafted requests fall on multiples)
        self.scales: dict[str, RequestScale] = {}  # request -> how its nodes fare vs the calibration
        self.proposed_nodes = 0  # draft nodes proposed, and kept for verification after trimming
        self.kept_nodes = 0
        # The nodes every request's verified trees held and the draft tokens accepted (decayed):
        # each request's prior for its own nodes per token.
        self.shared_kept = self.shared_hits = 0.0
        # Arms: a request's steps of one kind (e.g. whether its end recurs, where a lookup in the
        # draft matches) keep their own estimates under a key of their own; arm_of says which arm
        # each request's step is in, from `choose` to `observe`.
        self.arm_of: dict[str, str] = {}
        self.arms: dict[str, set[str]] = {}  # request -> its keys
        self.greedy: dict[str, bool] = {}

    # -- requests ------------------------------------------------------------------------------
    def add(self, req_id: str, request_class: str = "default", greedy: bool = False) -> None:
        """A new request; `greedy`: its trees are known to be trimmable from the first step
        (trim.trimmable), so the planner prices its depth by drafting it and verifying the nodes
        the trim keeps for what it adds (policy.Candidate)."""
        self.arms[req_id], self.greedy[req_id] = {req_id}, greedy
        self._add_key(req_id, request_class, greedy)

    def _add_key(self, key: str, request_class: str, greedy: bool) -> None:
        self.classes[key] = request_class
        self.accept[key] = Acceptance(self.config.max_draft_length, self.priors(request_class))
        if greedy:
            self.trimmed[key] = True
        self.idle[key] = 0
        self._planned_at = -math.inf  # a newcomer gets a plan at once

    def remove(self, req_id: str) -> None:
        for key in self.arms.pop(req_id, {req_id}):
            for d in (self.accept, self.classes, self.current, self.trimmed, self.scales, self.idle,
                      self.probe_every, self.probing):
                d.pop(key, None)
        self.arm_of.pop(req_id, None)
        self.greedy.pop(req_id, None)

    def _key(self, req_id: str) -> str:
        """Where this step's estimates of the request live: its arm's key (the request's own id
        when it has no arm)."""
        arm = self.arm_of.get(req_id)
        if arm is None:
            return req_id
        key = f"{req_id}#{arm}"
        if key not in self.accept and req_id in self.accept:
            self.arms.setdefault(req_id, {req_id}).add(key)
            self._add_key(key, self.classes[req_id], self.greedy.get(req_id, False))
        return key

    # -- choosing -------------------------------------------------------------------------------
    def set_arms(self, arms: dict[str, str]) -> None:
        """The kind of step each request is in this step (the others: none), before `choose`."""
        self.arm_of = dict(arms)

    def choose(self, caps: dict[str, int], contexts: dict[str, int] | None = None) -> dict[str, Decision]:
        """Draft length and tree budget per request, given each one's cap on k this step (what
        the request may still emit, the draft's context room) and the tokens it holds (default 0)."""
        for rid in caps:
            if rid not in self.accept:
                self.add(rid)
        keys = {rid: self._key(rid) for rid in caps}
        contexts = {keys[rid]: n for rid, n in (contexts or {}).items() if rid in keys}
        chosen = self._choose({keys[rid]: cap for rid, cap in caps.items()}, contexts)
        return {rid: chosen[key] for rid, key in keys.items()}

    def _choose(self, caps: dict[str, int], contexts: dict[str, int]) -> dict[str, Decision]:
        """choose, over the arms' keys."""
        now = self.clock()
        due = (now - self._planned_at) * 1e3 >= self.config.adjust_interval_ms
        if due or any(rid not in self.current for rid in caps):
            cfg, shared = self.config, self._kept_prior()
            cands = [Candidate(rid, self.accept[rid].rates(), max_k=min(cap, cfg.max_draft_length),
                               min_k=cfg.min_draft_length, width=cfg.tree_width, trimmed=self.trimmed.get(rid, False),
                               context=contexts.get(rid, 0), kept_per_token=self.accept[rid].kept_per_token(shared))
                     for rid, cap in caps.items()]
            self.last_plan = plan(cands, self.latency)
            for rid, k in self.last_plan.k.items():
                if k > self.current.get(rid, k):  # its estimate improved: probe at the base interval again
                    self.probe_every.pop(rid, None)
            self.current.update(self.last_plan.k)
            self._planned_at = now
            self._report(self.last_plan)
        ks = {rid: max(0, min(self.current.get(rid, 0), cap)) for rid, cap in caps.items()}
        drafting = any(ks.values()) or self.choices % self.config.probe_interval == 0
        self.choices += 1
        out = {}
        for rid, cap in caps.items():
            k = ks[rid]
            every = self.probe_every.get(rid, self.config.probe_interval)
            if k < cap and self.idle.get(rid, 0) + 1 >= every and drafting:  # `every` steps after the last
                k += 1  # a probe, this step only (see ControllerConfig.probe_interval)
                self.idle[rid] = 0  # counted from here, even if the trim then cuts the probe
                self.probing[rid] = k
            out[rid] = Decision(k, k * self.config.tree_width)
        return out

    def trim(self, rids: list[str], trees: list[DraftTree], greedy: list[bool], spent_ms: float, batch: int,
             adaptive: list[bool] | None = None, contexts: list[int] | None = None, context: float = 0.0
             ) -> tuple[list[DraftTree], list[list[float] | None]]:
        """The step's proposed trees, those of adaptive requests (default: all) that may be
        trimmed without bias (`trimmable`) cut to the nodes worth verifying (see trim.py); and
        the confidences of the trimmed trees' nodes for `observe_nodes` (None for a tree left as
        proposed). `contexts`: the tokens each tree's request holds (default 0); `context`: the
        whole batch's (StepShape.context). The planner then prices a trimmed request's depth by
        drafting it and verifying the nodes such trees keep for what they add (policy.Candidate)."""
        rids = [self._key(rid) for rid in rids]
        adaptive = adaptive or [True] * len(trees)
        contexts = contexts or [0] * len(trees)
        which = [i for i, (t, g, a) in enumerate(zip(trees, greedy, adaptive)) if a and len(t) and trimmable(t, g)]
        for i, (rid, a) in enumerate(zip(rids, adaptive)):
            if a and len(trees[i]) and rid in self.accept:
                self.trimmed[rid] = i in which
        chosen = set(which)
        fixed = sum(len(t) for i, t in enumerate(trees) if i not in chosen)
        fixed_node_context = sum(row_context(len(t), contexts[i]) for i, t in enumerate(trees) if i not in chosen)
        scales = [self.scales[rids[i]].value if rids[i] in self.scales else 1.0 for i in which]
        kept, confs = trim([trees[i] for i in which], self.calibration, self.latency, spent_ms, batch, fixed,
                           min_depth=self.config.min_draft_length, scales=scales,
                           contexts=[contexts[i] for i in which], context=context,
                           fixed_node_context=fixed_node_context)
        out, out_confs = list(trees), [None] * len(trees)
        for i, tree, conf in zip(which, kept, confs):
            out[i], out_confs[i] = tree, conf
            if not len(tree) and rids[i] in self.scales:  # nothing verified: drift back toward 1
                self.scales[rids[i]].observe(0.0, 0)
        self.proposed_nodes += sum(len(t) for t in trees)
        self.kept_nodes += sum(len(t) for t in out)
        return out, out_confs

    def observe_nodes(self, rid: str, tree: DraftTree, confidence: list[float], accepted_nodes: list[int]) -> None:
        """Learn node acceptance by confidence from one request's verified (trimmed) tree."""
        expected, passed = self.calibration.observe(tree, confidence, accepted_nodes)
        rid = self._key(rid)
        if rid in self.accept:
            self.scales.setdefault(rid, RequestScale()).observe(expected, passed)

    # -- learning -------------------------------------------------------------------------------
    def observe(self, shape: StepShape, draft_ms: float, verify_ms: float,
                outcomes: dict[str, tuple[int, int, int, int, int]], prefill: bool = False) -> None:
        """One step: its shape and latencies, and per request (the draft length k it was given,
        the depth of its verified tree, draft tokens accepted, output tokens, the verified tree's
        nodes). `prefill`: the step also ran a prompt (a request's first step, or a replica
        re-prefilling one), whose cost no draft shape explains; its latencies are left out of the
        latency model (a prompt of a few hundred tokens looked like a costly step with few nodes
        and pulled the per-node cost to zero)."""
        if not prefill:
            self.latency.observe(shape, draft_ms, verify_ms)
        for rid, (k, depth, accepted, output, kept) in outcomes.items():
            rid = self._key(rid)
            acc = self.accept.get(rid)
            if acc is None:
                continue
            self.idle[rid] = 0 if depth > self.current.get(rid, 0) else self.idle.get(rid, 0) + 1
            self._probed(rid, accepted)
            self.predicted_tokens += expected_tokens(acc.rates(), k)
            self.observed_tokens += output
            acc.observe(k, accepted, kept)
            if k:
                self.shared_kept = self.shared_kept * SHARED_DECAY + kept
                self.shared_hits = self.shared_hits * SHARED_DECAY + accepted
            if depth:
                self.recent_drafted = self.recent_drafted * 0.99 + depth
                self.recent_accepted = self.recent_accepted * 0.99 + accepted
        rejected = 1.0 - self.recent_accepted / self.recent_drafted if self.recent_drafted >= 20 else 0.0
        if rejected > self.config.rejection_alert and self._may_log("rejection"):
            log.warning("draft rejection rate exceeded threshold (%.0f%%): %.0f%% of recent draft tokens rejected",
                        100 * self.config.rejection_alert, 100 * rejected)

    def _kept_prior(self) -> float:
        """Nodes verified per draft token accepted, over all requests lately (before any: 1, every
        node verified is accepted)."""
        return self.shared_kept / self.shared_hits if self.shared_hits >= 1.0 else 1.0

    def _probed(self, rid: str, accepted: int) -> None:
        """A probe whose level was accepted keeps the base interval; one that failed doubles it."""
        depth = self.probing.pop(rid, None)
        if depth is None:
            return
        if accepted >= depth:
            self.probe_every.pop(rid, None)
        else:
            every = self.probe_every.get(rid, self.config.probe_interval)
            self.probe_every[rid] = min(2 * every, PROBE_BACKOFF * self.config.probe_interval)

    # -- reporting ------------------------------------------------------------------------------
    def _may_log(self, kind: str) -> bool:
        now = self.clock()
        if now - self._last_log.get(kind, -math.inf) < self.config.log_interval_s:
            return False
        self._last_log[kind] = now
        return True

    def _report(self, p: Plan) -> None:
        ks = sorted(p.k.values())
        typical = ks[len(ks) // 2] if ks else 0
        if typical != self._typical_k and self._typical_k is not None and self._may_log("adjusted"):
            log.info("draft length adjusted from %d to %d (expected %.2f tokens per step over %d requests, "
                     "%.1f tokens/s predicted vs %.1f without drafting)", self._typical_k, typical,
                     p.expected_tokens / max(1, len(ks)), len(ks), p.tokens_per_s, p.plain_tokens_per_s)
        self._typical_k = typical

    def stats(self) -> dict:
        """For metrics: the last plan and how well its predictions held."""
        p = self.last_plan
        return {
            "chosen_k": dict(self.current),
            "predicted_tokens_per_s": p.tokens_per_s if p and p.step_ms else 0.0,
            "plain_tokens_per_s": p.plain_tokens_per_s if p else 0.0,
            "predicted_tokens": self.predicted_tokens,
            "observed_tokens": self.observed_tokens,
            "proposed_nodes": self.proposed_nodes,
            "kept_nodes": self.kept_nodes,
        }
