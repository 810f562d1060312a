"""The warm-up's measurement plan: sizes measured in interleaved rounds, so drift cancels."""

from types import SimpleNamespace

import pytest

from services.scheduler import calibration
from services.scheduler.latency import LatencyModel


class DriftingVerifier:
    """Costs base + per_node * nodes ms, and the machine slows by `drift` ms on every call."""

    def __init__(self, clock, base=20.0, per_node=2.0, drift=0.1):
        self.clock, self.base, self.per_node, self.drift, self.calls = clock, base, per_node, drift, 0

    def verify(self, items):
        self.clock.now += (self.base + self.per_node * len(items[0].tree) + self.drift * self.calls) / 1e3
        self.calls += 1
        return [SimpleNamespace(tokens=[1])]

    def release(self, req_id):
        pass


def test_warm_up_fits_the_cost_per_node_on_a_drifting_machine(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    calibration.calibrate_local(latency, DriftingVerifier(clock), None, vocab_size=100, max_k=4, width=1)
    # Measured one size after another, the drift over a size's 7 runs would add to every size
    # measured later (+0.7 ms per node here); in rounds only the drift within one round remains
    # (+0.1 ms per node: one call's).
    assert (latency.verify_ms(1, 4) - latency.verify_ms(1, 0)) / 4 == pytest.approx(2.0, abs=0.15)


class SteppedVerifier(DriftingVerifier):
    """Costs 20 ms at 1 row, 22 ms at 2-6 rows, 27 ms at 7-12, then +1 ms per row (no drift)."""

    def verify(self, items):
        rows = 1 + len(items[0].tree)
        ms = 20.0 if rows == 1 else 22.0 if rows <= 6 else 27.0 if rows <= 12 else 27.0 + (rows - 12)
        self.clock.now += ms / 1e3
        return [SimpleNamespace(tokens=[1])]


def test_warm_up_learns_where_the_verify_cost_steps(monkeypatch):
    """The fit sees the measured row curve: nodes within a plateau cost nothing, the step costs
    what it costs (a line through these points would charge ~0.6 ms for every node)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    calibration.calibrate_local(latency, SteppedVerifier(clock), None, vocab_size=100, max_k=4, width=1)
    ms = [latency.verify_ms(1, n) for n in range(20)]
    assert ms[0] == pytest.approx(20.0, abs=0.1) and ms[1] == pytest.approx(22.0, abs=0.1)
    assert ms[5] - ms[1] == pytest.approx(0.0, abs=0.1)  # 2-6 rows: one plateau
    assert ms[6] - ms[5] == pytest.approx(5.0, abs=0.1)  # the step at 7 rows
    assert ms[16] - ms[11] == pytest.approx(5.0, abs=0.1)  # measured up to 17 rows whatever max_k
    assert ms[19] > ms[16]  # beyond: the curve's average slope


def test_every_size_up_to_16_is_measured_and_larger_trees_spread():
    assert calibration.tree_sizes(4, 1, route_rows=0) == list(range(17))
    assert calibration.tree_sizes(16, 4, route_rows=3) == list(range(17)) + [32, 48, 64]
