"""DraftController: the per-request decisions around the plan (probes, the greedy hint)."""

import pytest

from services.scheduler.controller import ControllerConfig, DraftController
from services.scheduler.latency import LatencyModel, StepShape


def costly_nodes() -> LatencyModel:
    """Verifying a node costs 3 ms on a 10 ms step; drafting is free. A level pays when alpha is
    above ~0.3 (alpha ~ 0.5 pays for k = 4) and never at alpha ~ 0."""
    return LatencyModel(verify_prior=(10.0, 0.0, 3.0), draft_prior=(0.0, 0.0, 0.0, 0.0))


def run(ctl: DraftController, rid: str, steps: int, accept_all: bool) -> list[int]:
    """Drive one request: every step drafts the chosen k and has all of it accepted (or none)."""
    ks = []
    for _ in range(steps):
        k = ctl.choose({rid: 4})[rid].k
        ks.append(k)
        accepted = k if accept_all else 0
        ctl.observe(StepShape(1, 1 if k else 0, k, k), 0.0, 10.0 + 3.0 * k, {rid: (k, k, accepted, accepted + 1, k)})
    return ks


def controller(probe_interval: int = 8, prior: float = 0.0) -> DraftController:
    cfg = ControllerConfig(max_draft_length=4, probe_interval=probe_interval)
    ctl = DraftController(cfg, latency=costly_nodes(), priors=lambda cls: [prior] * 4)
    ctl.latency.verify.observe = lambda *a: None  # keep the latency law fixed
    ctl.latency.draft.observe = lambda *a: None
    return ctl


def test_a_request_with_a_hopeless_prior_probes_and_finds_its_draft_good():
    """A shared prior of 0 (say, written by requests whose drafts all failed) must not stop a new
    request from drafting for ever: after `probe_interval` steps without reaching past its plan it
    probes one level deeper, and a request whose draft is always right climbs level by level (each
    level's estimate still leans on the prior; the class's prior itself learns from the probes'
    telemetry, which this test holds fixed)."""
    ctl = controller(probe_interval=8)
    ctl.add("r")
    ks = run(ctl, "r", 96, accept_all=True)
    assert ks[:8] == [0] * 8  # the prior says do not draft
    assert ks[8] == 1  # the probe
    assert min(ks[-16:]) >= 2 and max(ks[-16:]) >= 3


def test_without_probes_the_same_request_never_drafts():
    """The same setting with probes pushed out of reach: the prior holds it at k = 0 (what the
    test above guards against)."""
    ctl = controller(probe_interval=10**9)
    ctl.add("r")
    assert run(ctl, "r", 96, accept_all=True) == [0] * 96


def test_probes_of_a_draft_that_is_never_right_are_rare_and_one_level_deep():
    ctl = controller(probe_interval=8)
    ctl.add("r")
    ks = run(ctl, "r", 64, accept_all=False)
    assert set(ks) <= {0, 1}
    assert 1 <= sum(ks) <= 64 // 8


def test_probes_of_a_draft_that_never_pays_back_off():
    """Each rejected probe doubles the request's interval (8, 16, 32, 64, then 64 at the cap),
    and a request planned at k = 0 probes on a multiple of 8 steps (probe_interval): 6 probes in
    256 steps, where a fixed interval would probe 28 times, each a drafted and verified level
    that pays nothing (in-process at batch 8, a step of 8 head probes cost 30 ms against a 15 ms
    plain step). The hopeless-prior test above keeps its probes: accepted ones do not back off."""
    ctl = controller(probe_interval=8)
    ctl.add("r")
    ks = run(ctl, "r", 256, accept_all=False)
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [8, 24, 56, 120, 184, 248]


def test_undrafted_requests_probe_together():
    """Eight requests planned at k = 0 that joined at different steps: each probes about once
    every 16 steps, all in the same steps (each step that drafts costs the batch a draft call),
    where probing by each request's own count made every other step draft."""
    ctl = DraftController(ControllerConfig(max_draft_length=4, probe_interval=16), latency=costly_nodes(),
                          priors=lambda cls: [0.0] * 4)
    ctl.latency.verify.observe = ctl.latency.draft.observe = lambda *a: None
    drafted_steps, probes = [], 0
    for step in range(160):
        if step < 8:
            ctl.add(f"r{step}")
        caps = {f"r{i}": 4 for i in range(min(step + 1, 8))}
        chosen = ctl.choose(caps)
        ks = {rid: d.k for rid, d in chosen.items()}
        probes += sum(1 for k in ks.values() if k)
        if any(ks.values()):
            drafted_steps.append(step)
        ctl.observe(StepShape(len(caps), 0, 0, 0), 0.0, 10.0,
                    {rid: (k, k, k, k + 1, k) for rid, k in ks.items()})  # every probe accepted
    assert all(s % 16 == 0 for s in drafted_steps) and len(drafted_steps) <= 10
    assert probes >= 8 * 8


def test_a_greedy_request_pays_for_the_nodes_its_trimmed_trees_keep():
    """A greedy request's tree is trimmed once proposed; its levels are charged for the nodes the
    trim keeps per draft token accepted, which its own trees teach the controller, over what every
    request's trees held lately (before any: 1). Two requests whose first draft token is always
    accepted and the second never (E(4) about 2), 3 ms a node on a 10 ms step: trees that hold 4
    nodes per accepted token do not pay (2 tokens in 22 ms against 1 in 10), 1 node does."""
    ctl = controller(prior=0.5)
    ctl.config.probe_interval = 10**9
    assert ctl._kept_prior() == 1.0
    ctl.add("a", greedy=True)
    ctl.add("b", greedy=True)
    for _ in range(40):
        ctl.observe(StepShape(2, 2, 8, 4), 0.0, 25.0, {"a": (4, 4, 1, 2, 4), "b": (4, 1, 1, 2, 1)})
    assert ctl.choose({"a": 4})["a"].k == 0
    assert ctl.choose({"b": 4})["b"].k == 4
    assert ctl.accept["a"].kept_per_token(1.0) == pytest.approx(4.0, rel=0.15)  # 4 over a fading prior
    assert ctl._kept_prior() == pytest.approx(2.5, rel=0.01)  # a newcomer's: (4 + 1) / (1 + 1)


def test_a_draft_that_stops_early_is_priced_by_what_it_offers():
    """A draft that always stops after one (accepted) token, whatever k it is given: the depths
    it never reaches count as not accepted, so the plan stops asking for them once each level
    costs drafting time, re-trying depth 2 now and then. (Counting only the depths a tree
    reached kept alpha_2..4 at their prior and the plan at k = 4: a head that stops when unsure
    drafted 4 levels it never used.)"""
    cost = LatencyModel(verify_prior=(10.0, 0.0, 0.5), draft_prior=(0.0, 0.0, 0.0, 1.0))
    ctl = DraftController(ControllerConfig(max_draft_length=4, probe_interval=10**9), latency=cost,
                          priors=lambda cls: [0.8] * 4)
    ctl.latency.verify.observe = ctl.latency.draft.observe = lambda *a: None
    ks = []
    for _ in range(64):
        k = ctl.choose({"r": 4})["r"].k
        ks.append(k)
        depth = min(k, 1)
        ctl.observe(StepShape(1, 1 if k else 0, depth, depth), float(k), 10.0,
                    {"r": (k, depth, depth, depth + 1, depth)})
    assert ks[0] == 4  # the prior says every level pays
    tail = ks[-32:]  # depth 2 is re-tried as its failures fade toward the prior
    assert max(tail) <= 2 and tail.count(1) >= 24


def test_arms_keep_their_own_estimates_and_go_with_the_request():
    """A request whose draft is always right on one kind of step (say, where its end recurs) and
    never on the other: with the steps in two arms it drafts deep on the first kind and rarely on
    the second (its probes); pooled in one estimate (no arms), every step drafts alike."""
    def drive(ctl: DraftController, arms: bool) -> dict[str, list[int]]:
        ks = {"recurs": [], "new": []}
        for step in range(160):
            arm = "recurs" if step % 2 else "new"
            ctl.set_arms({"r": arm} if arms else {})
            k = ctl.choose({"r": 4})["r"].k
            ks[arm].append(k)
            accepted = k if arm == "recurs" else 0
            ctl.observe(StepShape(1, 1 if k else 0, k, k), 0.0, 10.0 + 3.0 * k, {"r": (k, k, accepted, accepted + 1, k)})
        return ks

    ctl = controller(prior=0.5)
    ctl.add("r")
    ks = drive(ctl, arms=True)
    assert min(ks["recurs"][-20:]) >= 3 and sum(k > 0 for k in ks["new"][-40:]) <= 4
    assert set(ctl.accept) == {"r", "r#recurs", "r#new"}
    ctl.remove("r")
    assert not ctl.accept and not ctl.current and not ctl.idle
    pooled = controller(prior=0.5)
    pooled.add("r")
    ks = drive(pooled, arms=False)
    assert min(ks["new"][-20:]) >= 2  # the steps whose drafts all fail draft as deep as the others
