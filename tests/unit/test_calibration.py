"""The warm-up's measurement plan: sizes measured in interleaved rounds, so drift cancels."""

from types import SimpleNamespace

import pytest

from services.scheduler import calibration
from services.scheduler.policy import LatencyModel


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
    assert latency.verify.weights[2] == pytest.approx(2.0, abs=0.15)


def test_small_trees_are_measured_at_every_size_and_large_ones_spread():
    assert calibration.tree_sizes(4, 1, route_rows=0) == [0, 1, 2, 3, 4]
    assert calibration.tree_sizes(8, 2, route_rows=3) == [0, 1, 2, 3, 4, 8, 12, 16]
