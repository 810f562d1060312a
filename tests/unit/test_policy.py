"""The draft-length policy against answers known by construction: brute force over every choice
of k, closed-form optima, and simulated requests whose true acceptance is known."""

import itertools
import random

import pytest

from services.scheduler.acceptance import Acceptance
from services.scheduler.latency import LatencyModel, LinearFit, RowCurve, StepShape, row_context
from services.scheduler.policy import Candidate, evaluate, expected_tokens, plan


def latency(verify=(30.0, 2.0, 2.0), draft=(2.0, 0.5, 0.5, 1.0), route_rows: int = 3) -> LatencyModel:
    return LatencyModel(verify_prior=verify, draft_prior=draft, route_rows=route_rows)


def brute_force(cands, cost):
    best, best_ratio = None, -1.0
    for ks in itertools.product(*(range(min(c.min_k, c.max_k), c.max_k + 1) for c in cands)):
        tok, ms = evaluate(cands, list(ks), cost)
        if tok / ms > best_ratio + 1e-12:
            best, best_ratio = list(ks), tok / ms
    return best, best_ratio


def test_expected_tokens_closed_form():
    assert expected_tokens([0.5] * 4, 0) == 1.0
    # 1 + a + a^2 + a^3 for a constant acceptance a
    assert expected_tokens([0.5] * 4, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(200))
def test_plan_matches_brute_force_on_random_batches(seed):
    # context terms in half the cases: each request's rows then cost by the tokens it holds
    rng = random.Random(seed)
    cost = latency(verify=(rng.uniform(5, 50), rng.uniform(0, 5), rng.uniform(0.1, 8), rng.choice([0, 12, 40]), 1.0,
                           *rng.choice([(0.0, 0.0), (rng.uniform(0, 4), rng.uniform(0, 4))])),
                   draft=(rng.uniform(0, 5), rng.uniform(0, 2), rng.uniform(0, 3), rng.choice([0.0, rng.uniform(0, 6)])),
                   route_rows=rng.choice([0, 1, 3, 5]))
    cands = []
    for i in range(rng.randint(1, 4)):
        rates = [rng.uniform(0.0, 1.0) ** rng.choice([0.3, 1, 3]) for _ in range(5)]
        cands.append(Candidate(f"r{i}", rates, max_k=rng.randint(0, 5), min_k=rng.choice([0, 0, 0, 1]),
                               width=rng.choice([1, 1, 2, 3]), trimmed=rng.random() < 0.3,
                               context=rng.choice([0, 40, 900, 3000]),
                               kept_per_token=rng.choice([0.0, rng.uniform(0.5, 4)])))
    got = plan(cands, cost)
    want, want_ratio = brute_force(cands, cost)
    assert got.tokens_per_s / 1e3 == pytest.approx(want_ratio, rel=1e-9), (got.k, want)


@pytest.mark.parametrize("seed", range(40))
def test_plan_matches_brute_force_with_greedy_requests_under_the_route_step(seed):
    # Greedy requests' trees are trimmed, and the trim crosses the route step only where that
    # pays, so the nodes they keep do not count toward it: every choice of their k stays under the
    # step, where the search must still find the optimum.
    rng = random.Random(1000 + seed)
    cost = latency(verify=(rng.uniform(5, 50), rng.uniform(0, 5), rng.uniform(0.1, 8), rng.choice([0, 12, 40])),
                   draft=(rng.uniform(0, 5), rng.uniform(0, 2), rng.uniform(0, 3), rng.choice([0.0, rng.uniform(0, 6)])),
                   route_rows=rng.choice([3, 5, 8]))
    cands = [Candidate(f"r{i}", [rng.uniform(0.0, 1.0) ** rng.choice([0.3, 1, 3]) for _ in range(4)],
                       max_k=rng.randint(0, 4), min_k=rng.choice([0, 0, 1]), width=rng.choice([1, 2]),
                       trimmed=rng.random() < 0.8, kept_per_token=rng.choice([0.0, rng.uniform(0.5, 3)]))
             for i in range(rng.randint(2, 5))]
    got = plan(cands, cost)
    want, want_ratio = brute_force(cands, cost)
    assert got.tokens_per_s / 1e3 == pytest.approx(want_ratio, rel=1e-9), (got.k, want)


def test_plan_work_does_not_grow_with_the_greedy_requests_choices():
    # 8 greedy requests, each free to draft 0..16 deep, all under a route step of 8 rows: 17 ** 8
    # shapes fit under it, so the plan must not enumerate them.
    cost = latency(route_rows=8)
    calls = 0
    step_ms = cost.step_ms

    def counted(shape):
        nonlocal calls
        calls += 1
        return step_ms(shape)

    cost.step_ms = counted
    cands = [Candidate(f"r{i}", [0.9 - 0.05 * i] * 16, max_k=16, trimmed=True, kept_per_token=1.5)
             for i in range(8)]
    got = plan(cands, cost)
    assert calls < 2000
    assert any(got.k.values())


def test_a_trimmed_request_pays_for_the_nodes_the_trim_keeps():
    """A trimmed request's levels cost drafting (free here) and the nodes the trim keeps for what
    they add: kept_per_token nodes per draft token accepted, 3 ms a node on a 10 ms step, alpha 0.2
    (E(4) = 1.25). Alone, 2 nodes a token pay (1.25 tokens in 11.5 ms against 1 in 10) and 4 do
    not; two requests share the step's 10 ms, so their drafts must pay against 2 tokens in 10 ms:
    1 node a token does, 2 do not. Charged, a request drafts all 4 levels or none. (Charging no
    node let 8 streams plan steps that ran 0.85x plain decoding's tokens per ms: BENCHMARKS.md.)"""
    cost = latency(verify=(10.0, 0.0, 3.0), draft=(0.0, 0.0, 0.0, 0.0), route_rows=0)
    for n, cheap, dear in ((1, 2.0, 4.0), (2, 1.0, 2.0)):
        for per_token, want in ((cheap, {4}), (dear, {0})):
            cands = [Candidate(f"r{i}", [0.2] * 4, 4, trimmed=True, kept_per_token=per_token) for i in range(n)]
            assert set(plan(cands, cost).k.values()) == want, (n, per_token)
            assert plan(cands, cost).tokens_per_s == pytest.approx(1e3 * max(brute_force(cands, cost)[1], 0))


def test_route_step_keeps_a_single_request_below_it():
    # 25 ms for up to 3 rows, then a 12 ms step: with acceptance 0.6 drafting 2 (3 rows) beats 4,
    # which the same costs without the step would pick.
    rates = [0.6] * 4
    with_step = plan([Candidate("a", rates, max_k=4)], latency(verify=(25.0, 0.0, 1.0, 12.0), draft=(0, 0, 0, 0)))
    without = plan([Candidate("a", rates, max_k=4)], latency(verify=(25.0, 0.0, 1.0, 0.0), draft=(0, 0, 0, 0)))
    assert with_step.k == {"a": 2} and without.k == {"a": 4}
    # A verifier with one matmul route at every row count (route_rows 0) has no step to avoid,
    # whatever weight the prior gave it.
    no_route = plan([Candidate("a", rates, max_k=4)], latency(verify=(25.0, 0.0, 1.0, 12.0), draft=(0, 0, 0, 0),
                                                            route_rows=0))
    assert no_route.k == {"a": 4}


def test_plain_decoding_when_drafting_never_pays():
    # A draft token costs as much as a whole verify step: even alpha = 0.9 loses.
    cost = latency(verify=(10.0, 0.0, 10.0), draft=(10.0, 0.0, 0.0, 0.0))
    p = plan([Candidate("a", [0.9] * 4, max_k=4)], cost)
    assert p.k == {"a": 0}
    assert p.tokens_per_s == pytest.approx(p.plain_tokens_per_s)


def test_deepest_draft_when_it_is_free_and_accepted():
    cost = latency(verify=(30.0, 0.0, 0.01), draft=(0.0, 0.0, 0.0, 0.0))
    p = plan([Candidate("a", [0.95] * 6, max_k=6), Candidate("b", [0.0] * 6, max_k=6)], cost)
    assert p.k == {"a": 6, "b": 0}  # b's draft is never accepted: drafting it only costs


def test_single_request_optimum_in_closed_form():
    # Verify: 20 ms + 3 ms per node; no draft cost. For constant alpha the best k maximizes
    # (1 - a^(k+1)) / (1 - a) / (20 + 3k); check against the formula over k.
    cost = latency(verify=(20.0, 0.0, 3.0), draft=(0.0, 0.0, 0.0, 0.0))
    for a in (0.2, 0.5, 0.7, 0.9):
        want = max(range(9), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (20 + 3 * k))
        assert plan([Candidate("a", [a] * 8, max_k=8)], cost).k["a"] == want


def test_min_draft_length_is_honoured():
    cost = latency(verify=(10.0, 0.0, 10.0))
    p = plan([Candidate("a", [0.1] * 4, max_k=4, min_k=2)], cost)
    assert p.k == {"a": 2}


def test_linear_fit_recovers_a_latency_law():
    rng = random.Random(0)
    fit = LinearFit(prior=(1.0, 1.0, 1.0), decay=1.0)
    for _ in range(200):
        x = (1.0, float(rng.randint(1, 16)), float(rng.randint(0, 64)))
        fit.observe(x, 25.0 + 4.0 * x[1] + 1.5 * x[2] + rng.gauss(0, 0.1))
    assert fit.weights == pytest.approx([25.0, 4.0, 1.5], rel=0.02)


def test_linear_fit_forgets_an_old_machine_speed():
    fit = LinearFit(prior=(1.0, 1.0), decay=0.9)
    for n in range(100):
        fit.observe((1.0, float(n % 8)), 10.0 + 2.0 * (n % 8))
    for n in range(100):
        fit.observe((1.0, float(n % 8)), 20.0 + 4.0 * (n % 8))  # twice as slow now
    assert fit.predict((1.0, 4.0)) == pytest.approx(36.0, rel=0.01)


def test_one_far_outlier_barely_moves_the_latency_model_and_a_real_slowdown_still_does():
    """A head's draft took 150 ms once (a cold call) where it takes 2: unclipped, the fit priced
    every later draft at about 4 ms and the planner stopped drafting; clipped, the price stays
    near 2 ms, and a machine that really runs twice as slow is still followed."""
    def fitted(clip):
        fit = LinearFit(prior=(2.0, 0.5, 0.5, 1.0), clip=clip)
        for n in range(40):
            fit.observe((1.0, 1.0, float(2 + n % 4), float(2 + n % 4)), 1.5 + 0.1 * (2 + n % 4))
        return fit
    x = (1.0, 1.0, 4.0, 4.0)
    for clip, most in ((None, 1e9), (3.0, 2.6)):
        fit = fitted(clip)
        assert fit.predict(x) == pytest.approx(1.9, rel=0.02)
        fit.observe(x, 150.0)
        moved = fit.predict(x)
        assert moved <= most
        if clip is None:
            assert moved > 3.0  # what the unclipped fit did
    slower = {}
    for clip in (None, 3.0):
        fit = fitted(clip)
        for n in range(60):
            fit.observe((1.0, 1.0, float(2 + n % 4), float(2 + n % 4)), 2 * (1.5 + 0.1 * (2 + n % 4)))
        slower[clip] = fit.predict(x)
    assert slower[3.0] == pytest.approx(slower[None], rel=1e-9) and slower[3.0] > 3.0
    model = LatencyModel()
    assert model.verify.clip and model.draft.clip  # the scheduler's fits are the clipped kind


def test_linear_fit_keeps_weights_non_negative():
    fit = LinearFit(prior=(0.0, 0.0, 0.0), decay=1.0)
    for n in range(50):
        fit.observe((1.0, float(n % 5), float(n % 7)), 30.0 - 0.5 * (n % 7))  # noise that would give < 0
    assert all(w >= 0 for w in fit.weights)


def test_acceptance_counts_only_judged_depths():
    acc = Acceptance(max_depth=4, prior=[0.5] * 4, prior_weight=0.0, decay=1.0)
    acc.observe(k=4, accepted=1)  # depth 1 accepted, depth 2 rejected, 3 and 4 never judged
    acc.observe(k=4, accepted=4)
    assert acc.judged == [2.0, 2.0, 1.0, 1.0]
    assert acc.rates() == [1.0, 0.5, 1.0, 1.0]


def test_acceptance_drifts_to_new_behaviour_and_back_to_prior():
    acc = Acceptance(max_depth=2, prior=[0.5, 0.5], prior_weight=2.0, decay=0.9)
    for _ in range(60):
        acc.observe(k=2, accepted=2)
    assert acc.rates()[0] > 0.9
    for _ in range(60):
        acc.observe(k=2, accepted=0)
    assert acc.rates()[0] < 0.1
    for _ in range(200):
        acc.observe(k=0, accepted=0)  # steps without drafting: what it knew fades to the prior
    assert acc.rates()[0] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("alpha,want", [(0.05, 0), (0.6, None), (0.97, 8)])
def test_simulated_request_converges_to_the_best_k(alpha, want):
    """A request whose draft tokens are accepted independently with probability alpha, a known
    latency law, and the policy learning alpha online from Bernoulli outcomes."""
    rng = random.Random(1)
    true_cost = latency(verify=(20.0, 0.0, 2.0), draft=(1.0, 0.0, 0.5, 0.5))
    best = max(range(9), key=lambda k: expected_tokens([alpha] * 8, k)
               / true_cost.step_ms(StepShape(1, int(k > 0), k, k)))
    want = best if want is None else want
    acc = Acceptance(max_depth=8, prior=[None] * 8)
    chosen = []
    for _ in range(400):
        k = plan([Candidate("a", acc.rates(), max_k=8)], true_cost).k["a"]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        acc.observe(k, accepted)
        chosen.append(k)
    tail = chosen[-100:]
    assert max(set(tail), key=tail.count) == want


def test_row_curve_interpolates_never_falls_and_extends_at_its_average_slope():
    curve = RowCurve({1: 0.0, 2: 1.5, 3: 1.2, 5: 1.5, 9: 5.5})  # 2 rows measured dearer than 3: noise
    assert curve(1) == 0.0 and curve(2) == 1.2 and curve(3) == 1.2  # non-decreasing
    assert curve(7) == 1.5 + 4.0 * 2 / 4  # between the points at 5 and 9
    assert curve(13) == 5.5 + 4 * (5.5 / 8)  # beyond the last: 5.5 ms over 8 rows


def test_a_noisy_spike_in_the_row_curve_is_lowered_to_what_more_rows_cost():
    """One point measured while another process held the cores would, kept as measured and
    carried to every larger row count, price out trees that the online fit never gets to see."""
    curve = RowCurve({1: 0.0, 2: 0.5, 5: 18.6, 9: 1.0, 17: 1.4})
    assert curve(5) == 1.0 and curve(9) == 1.0 and curve(17) == 1.4
    assert RowCurve({1: 0.0, 2: -0.3, 3: 0.4})(2) == 0.0  # never cheaper than one row


def test_single_request_plan_is_exact_under_a_row_curve():
    """With a stepped curve the cost is not linear in k: one request's plan tries every k."""
    cost = LatencyModel(verify_prior=(10.0, 0.0, 0.0, 0.0, 1.0), draft_prior=(0.0, 0.0, 0.0, 0.0))
    cost.set_curve(RowCurve({1: 0.0, 2: 1.0, 6: 1.0, 7: 8.0, 12: 8.0}))  # 1-5 nodes: +1 ms; 6+: +8
    cand = Candidate("r", [0.7] * 8, max_k=8)
    k = plan([cand], cost).k["r"]
    want = max(range(9), key=lambda k: expected_tokens(cand.rates, k) / cost.step_ms(StepShape(1, 1 if k else 0, k, k)))
    assert k == want == 5


@pytest.mark.parametrize("width,kept", [(1, None), (2, None), (2, 0.0), (2, 1.5), (2, 9.0)])  # kept: per token, trimmed
def test_single_request_costs_equal_the_step_shape_costs(width, kept):
    """The planner's fast price list for a lone request is step_ms of each shape, bit for bit,
    with a route step (crossed by the last case's trimmed nodes), a row curve and weights fitted
    from noisy steps (drafting's per-node and per-level terms apart)."""
    rng = random.Random(3)
    cost = LatencyModel(route_rows=6)
    cost.set_curve(RowCurve({1: 0.0, 2: 1.5, 6: 1.6, 7: 4.0, 13: 8.0}))
    for _ in range(50):
        n = rng.randint(0, 12)
        m, tokens, depth = rng.randint(0, n), rng.randint(10, 2000), rng.randint(1, max(n, 1))
        cost.observe(StepShape(1, 1 if n else 0, n, depth if n else 0, m, context=row_context(1, tokens),
                               node_context=row_context(m, tokens)), 0.1 * n + 0.5 * depth + rng.random(),
                     17 + 0.4 * n + 0.002 * tokens + 0.0003 * m * tokens + 3.0 * (m > 5) + rng.random())
    assert min(cost.draft.weights[2:]) > 0 and cost.verify.weights[3] > 0
    cand = Candidate("r", [0.5] * 16, max_k=16, width=width, trimmed=kept is not None, kept_per_token=kept or 0.0)
    for tokens in (0, 700):
        want = [cost.step_ms(StepShape(1, 1 if k else 0, k * width, k, cand.verified(k), context=row_context(1, tokens),
                                       node_context=row_context(cand.verified(k), tokens),
                                       routed=0.0 if cand.trimmed else None)) for k in range(17)]
        assert cost.single_ms(16, width, cand.nodes if cand.trimmed else None, tokens) == want
        assert want[0] < want[1]  # drafting costs something: the shapes differ
