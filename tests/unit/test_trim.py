"""Trimming draft trees to the nodes worth verifying (services/scheduler/trim.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from services.common.tree import DraftTree
from services.scheduler.acceptance import NodeCalibration
from services.scheduler.latency import LatencyModel, row_context
from services.scheduler.trim import node_confidence, node_values, trim


def chain(tokens: list[int], confs: list[float]) -> DraftTree:
    t = DraftTree()
    for i, (tok, c) in enumerate(zip(tokens, confs)):
        t.add(tok, i - 1, [tok], [1.0])
    t.confidence = list(confs)
    return t


def random_chain(rng: random.Random, r: int) -> DraftTree:
    """Request r's chain of 0 to 4 nodes, confidences falling along it."""
    n = rng.randint(0, 4)
    return chain([10 * r + i for i in range(n)], sorted((rng.random() for _ in range(n)), reverse=True))


def latency(node_ms: float, one_ms: float = 20.0, route_ms: float = 0.0, route_rows: int = 3) -> LatencyModel:
    return LatencyModel(verify_prior=(one_ms, 0.0, node_ms, route_ms), route_rows=route_rows)


def test_confidence_is_sent_or_q_of_the_token():
    t = DraftTree()
    t.add(5, -1, [5, 6], [0.7, 0.3])
    t.add(6, -1, [6, 9], [0.4, 0.6])  # a sibling drawn from the residual: q(6) = 0.4
    assert node_confidence(t) == [0.7, 0.4]
    t.confidence = [0.2, 0.9]
    assert node_confidence(t) == [0.2, 0.9]


def test_values_never_exceed_a_parent_or_an_earlier_sibling():
    rng = random.Random(3)
    calib = NodeCalibration()
    for _ in range(50):
        t = DraftTree()
        for i in range(12):
            parent = rng.randrange(-1, i)
            tok = 100 * i + 1  # distinct everywhere
            t.add(tok, parent, [tok], [1.0])
        t.confidence = [rng.random() for _ in range(12)]
        values = node_values(t, node_confidence(t), calib)
        prev: dict[int, int] = {}
        for i, p in enumerate(t.parents):
            if p >= 0:
                assert values[i] <= values[p]
            if p in prev:
                assert values[i] <= values[prev[p]]
            prev[p] = i


def test_subtree_reindexes_parents_and_keeps_q():
    t = DraftTree()
    a = t.add(1, -1, [1], [1.0])
    t.add(2, -1, [2], [1.0])
    b = t.add(3, a, [3, 4], [0.5, 0.5])
    t.add(4, b, [4], [1.0])
    s = t.subtree([0, 2, 3])
    assert s.tokens == [1, 3, 4] and s.parents == [-1, 0, 1]
    assert s.q_ids[1] == [3, 4] and s.q_probs[1] == [0.5, 0.5]
    s.validate(vocab_size=10)


def test_free_nodes_are_all_kept_and_dear_ones_none():
    trees = [chain([1, 2, 3], [0.9, 0.5, 0.1]), chain([4, 5], [0.3, 0.3])]
    kept, confs = trim(trees, NodeCalibration(), latency(node_ms=0.0), spent_ms=1.0)
    assert [len(t) for t in kept] == [3, 2] and confs[0] == [0.9, 0.5, 0.1]
    kept, _ = trim(trees, NodeCalibration(), latency(node_ms=1e6), spent_ms=1.0)
    assert [len(t) for t in kept] == [0, 0]


def ratio(trees, keep_counts, calib, lat, spent_ms) -> float:
    """Expected tokens per ms when each chain keeps its first keep_counts[r] nodes."""
    tokens = len(trees)
    for t, n in zip(trees, keep_counts):
        tokens += sum(node_values(t, node_confidence(t), calib)[:n])
    return tokens / (spent_ms + lat.verify_ms(len(trees), sum(keep_counts)))


def test_trim_matches_brute_force_on_chains():
    """For chains every valid subset is a prefix per request: enumerate them all."""
    rng = random.Random(11)
    calib = NodeCalibration()
    for _ in range(60):
        trees = [random_chain(rng, r) for r in range(rng.randint(1, 3))]
        lat = latency(node_ms=rng.uniform(0.5, 15.0), one_ms=rng.uniform(5, 40), route_ms=rng.choice([0, 10]))
        spent = rng.uniform(0, 10)
        best = max(ratio(trees, ks, calib, lat, spent)
                   for ks in itertools.product(*(range(len(t) + 1) for t in trees)))
        kept, _ = trim(trees, calib, lat, spent)
        got = ratio(trees, [len(t) for t in kept], calib, lat, spent)
        assert abs(got - best) <= 1e-9 * best


def test_trim_matches_brute_force_when_requests_hold_different_contexts():
    """Each row attends to its request's tokens: a long request's nodes cost more to verify, so
    the best set is no longer the best values; with a linear cost it is the best values per ms."""
    rng = random.Random(12)
    calib = NodeCalibration()
    for _ in range(100):
        trees = [random_chain(rng, r) for r in range(rng.randint(2, 3))]
        contexts = [rng.choice([10, 300, 3000]) for _ in trees]
        lat = LatencyModel(verify_prior=(rng.uniform(2, 10), 0.0, rng.uniform(0.1, 1.0), 0.0, 0.0,
                                         rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0)))
        held = sum(row_context(1, c) for c in contexts)
        spent = rng.uniform(0, 10)

        def ratio_of(ks):
            tokens = len(trees) + sum(sum(node_values(t, node_confidence(t), calib)[:n]) for t, n in zip(trees, ks))
            nodes = sum(row_context(n, c) for n, c in zip(ks, contexts))
            return tokens / (spent + lat.verify_ms(len(trees), sum(ks), held, nodes))

        best = max(ratio_of(ks) for ks in itertools.product(*(range(len(t) + 1) for t in trees)))
        kept, _ = trim(trees, calib, lat, spent, contexts=contexts, context=held)
        assert ratio_of([len(t) for t in kept]) == pytest.approx(best, rel=1e-9)


def test_calibration_learns_what_passes():
    calib = NodeCalibration(prior_weight=4.0)
    assert abs(calib.rate(1, 0.95) - 0.95) < 1e-9  # the prior: the bin's own confidence
    t = chain([1, 2], [0.95, 0.95])
    for _ in range(200):  # confident first nodes that always fail
        calib.observe(t, [0.95, 0.95], accepted_nodes=[])
    assert calib.rate(1, 0.95) < 0.1
    assert abs(calib.rate(2, 0.95) - 0.95) < 1e-9  # never judged: depth 2 was never reached
    for _ in range(200):
        calib.observe(t, [0.95, 0.95], accepted_nodes=[0, 1])
    assert calib.rate(2, 0.95) > 0.9


def test_min_depth_keeps_the_first_chain_whatever_it_costs():
    t = DraftTree()
    a = t.add(1, -1, [1], [1.0])
    t.add(2, -1, [2], [1.0])  # a sibling: not on the first chain
    b = t.add(3, a, [3], [1.0])
    t.add(4, b, [4], [1.0])
    t.confidence = [0.1, 0.1, 0.1, 0.1]
    kept, confs = trim([t], NodeCalibration(), latency(node_ms=1e6), spent_ms=1.0, min_depth=2)
    assert kept[0].tokens == [1, 3] and kept[0].parents == [-1, 0] and confs[0] == [0.1, 0.1]
    kept, _ = trim([t], NodeCalibration(), latency(node_ms=0.0), spent_ms=1.0, min_depth=2)
    assert kept[0].tokens == [1, 2, 3, 4]


def test_a_request_that_fails_the_calibration_is_trimmed_harder():
    from services.scheduler.acceptance import RequestScale

    calib, scale = NodeCalibration(), RequestScale()
    t = chain([1, 2], [0.75, 0.75])
    lat = latency(node_ms=2.0, one_ms=20.0)
    kept, _ = trim([t], calib, lat, spent_ms=0.0, scales=[scale.value])
    assert len(kept[0]) == 2  # at the calibration's word (0.75 a node) both nodes pay
    for _ in range(20):  # this request's first node, 75% sure by the calibration, keeps failing
        scale.observe(expected=0.75, passed=0)
    assert scale.value < 0.3
    kept, _ = trim([t], NodeCalibration(), lat, spent_ms=0.0, scales=[scale.value])
    assert len(kept[0]) < 2


def test_confidence_travels_with_the_tree():
    from services.common import codec

    t = chain([4, 5], [0.8, 0.25])
    back = codec.tree_from_pb(codec.tree_to_pb(t))
    assert back.tokens == [4, 5] and back.confidence == pytest.approx([0.8, 0.25])
    assert codec.tree_from_pb(codec.tree_to_pb(DraftTree())).confidence == []


def test_the_prefix_costs_equal_one_call_each():
    """LatencyModel.verify_ms_from (the trim's every-prefix pricing) gives exactly verify_ms per
    node count: across the route step, along a measured row curve and past its last point."""
    from services.scheduler.latency import RowCurve

    lat = LatencyModel(verify_prior=(9.0, 1.5, 0.7, 4.0, 1.0), route_rows=7)
    for curve in (None, RowCurve({1: 0.0, 4: 0.5, 8: 3.0, 13: 4.5})):
        if curve is not None:
            lat.set_curve(curve)
        for batch, nodes in ((1, 0), (3, 2), (8, 0)):
            assert lat.verify_ms_from(batch, nodes, 30) == [lat.verify_ms(batch, n) for n in range(nodes, nodes + 30)]
