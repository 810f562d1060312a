"""The warm-up's measurement plan: sizes measured in interleaved rounds, so drift cancels; and
its cache: a second start on the same machine and code reuses what the first measured."""

import asyncio
from types import SimpleNamespace

import pytest

from services.scheduler import calibration, calibration_cache
from services.scheduler.engine import run_now
from services.scheduler.latency import LatencyModel, row_context
from services.scheduler.workers import Reply, Workers


class DriftingVerifier(Workers):
    """Costs base + per_node * nodes ms, and the machine slows by `drift` ms on every call."""

    kind = "verifier"

    def __init__(self, clock, base=20.0, per_node=2.0, drift=0.1):
        self.clock, self.base, self.per_node, self.drift, self.calls = clock, base, per_node, drift, 0

    def cost_ms(self, nodes: int) -> float:
        return self.base + self.per_node * nodes + self.drift * self.calls

    async def step(self, step_id, works):
        self.clock.now += self.cost_ms(len(works[0].tree)) / 1e3
        self.calls += 1
        return Reply(results={works[0].req_id: SimpleNamespace(tokens=[1], states=None)})

    def release(self, req_id):
        pass


def calibrate(latency, verifier, max_k=4):
    run_now(calibration.calibrate(latency, verifier, None, vocab_size=100, max_k=max_k, width=1))


def test_warm_up_fits_the_cost_per_node_on_a_drifting_machine(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    calibrate(latency, DriftingVerifier(clock))
    # Measured one size after another, the drift over a size's 7 runs would add to every size
    # measured later (+0.7 ms per node here); in rounds only the drift within one round remains
    # (+0.1 ms per node: one call's).
    assert (latency.verify_ms(1, 4) - latency.verify_ms(1, 0)) / 4 == pytest.approx(2.0, abs=0.15)


class SteppedVerifier(DriftingVerifier):
    """Costs 20 ms at 1 row, 22 ms at 2-6 rows, 27 ms at 7-12, then +1 ms per row (no drift)."""

    def cost_ms(self, nodes: int) -> float:
        rows = 1 + nodes
        return 20.0 if rows == 1 else 22.0 if rows <= 6 else 27.0 if rows <= 12 else 27.0 + (rows - 12)


def test_warm_up_learns_where_the_verify_cost_steps(monkeypatch):
    """The fit sees the measured row curve: nodes within a plateau cost nothing, the step costs
    what it costs (a line through these points would charge ~0.6 ms for every node)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    calibrate(latency, SteppedVerifier(clock))
    ms = [latency.verify_ms(1, n) for n in range(20)]
    assert ms[0] == pytest.approx(20.0, abs=0.1) and ms[1] == pytest.approx(22.0, abs=0.1)
    assert ms[5] - ms[1] == pytest.approx(0.0, abs=0.1)  # 2-6 rows: one plateau
    assert ms[6] - ms[5] == pytest.approx(5.0, abs=0.1)  # the step at 7 rows
    assert ms[16] - ms[11] == pytest.approx(5.0, abs=0.1)  # measured up to 17 rows whatever max_k
    assert ms[19] > ms[16]  # beyond: the curve's average slope


class AttendingVerifier(DriftingVerifier):
    """Costs 20 ms + 0.5 ms per node, + 0.0018 ms per token the request holds for its first row
    and 0.0002 for each node (no drift)."""

    async def step(self, step_id, works):
        nodes, held = len(works[0].tree), len(works[0].tokens)
        self.clock.now += (20.0 + 0.5 * nodes + 0.0018 * held + 0.0002 * nodes * held) / 1e3
        self.calls += 1
        return Reply(results={works[0].req_id: SimpleNamespace(tokens=[1], states=None)})


def test_warm_up_learns_what_a_row_costs_per_token_it_attends_to(monkeypatch):
    """Measured after the short prompt alone, every row would look alike; the long prompt's
    sizes show the fit what holding 1000 tokens adds to a request's first row and to a node."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    run_now(calibration.calibrate(latency, AttendingVerifier(clock), None, vocab_size=100, max_k=4, width=1,
                                  max_positions=2048))
    assert latency.node_ms(1000) - latency.node_ms(20) == pytest.approx(0.0002 * 980, rel=0.1)
    one_row = latency.verify_ms(1, 0, row_context(1, 1000)) - latency.verify_ms(1, 0, row_context(1, 20))
    assert one_row == pytest.approx(0.0018 * 980, rel=0.1)


def test_every_size_up_to_16_is_measured_and_larger_trees_spread():
    assert calibration.tree_sizes(4, 1, route_rows=0) == list(range(17))
    assert calibration.tree_sizes(16, 4, route_rows=3) == list(range(17)) + [32, 48, 64]


def test_a_second_start_reuses_the_cached_calibration(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)

    def start(pair):
        latency, verifier = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0)), SteppedVerifier(clock)
        warm = asyncio.run(calibration.warm_up(latency, verifier, None, 100, pair, max_k=4, width=1))
        return warm, latency, verifier.calls

    first, measured, calls = start("t|ngram")
    assert not first.cached and calls > 17
    second, reused, calls = start("t|ngram")
    assert second.cached and calls == 0  # nothing measured: the cached fit is loaded
    assert [reused.verify_ms(1, n) for n in range(20)] == [measured.verify_ms(1, n) for n in range(20)]
    assert reused.verify.samples == measured.verify.samples  # and it goes on learning from there
    third, _, calls = start("t|model")  # another model pair measures for itself
    assert not third.cached and calls > 17


def test_the_cache_key_names_the_machine_and_the_code(monkeypatch):
    key = calibration_cache.cache_key("t|ngram", 3, 16, 1)
    assert key["cpu"] == calibration_cache.cpu_model() and key["cores"] >= 1 and key["torch_threads"] >= 1
    assert len(key["code"]) == 16 and key["route_rows"] == 3
    assert calibration_cache.load({**key, "code": "another"}) is None
    monkeypatch.setenv("SPECSERVE_NATIVE_MATMUL", "int4")  # another matmul, other costs
    assert calibration_cache.cache_key("t|ngram", 3, 16, 1) != key


class SharedVerifier(DriftingVerifier):
    """Computes 20 + 0.5 ms per node; the steps of odd sizes wait 25 ms more behind another
    scheduler's step, in every round (which the worker's own compute time does not count)."""

    async def step(self, step_id, works):
        nodes = len(works[0].tree)
        compute = 20.0 + 0.5 * nodes
        self.clock.now += (compute + (25.0 if nodes % 2 else 0.0)) / 1e3
        self.calls += 1
        return Reply(results={works[0].req_id: SimpleNamespace(tokens=[1], states=None)}, compute_ms=compute)


def test_a_wait_behind_another_scheduler_does_not_tilt_the_row_curve(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock.now)
    latency = LatencyModel(verify_prior=(30.0, 0.0, 0.0, 0.0))
    calibrate(latency, SharedVerifier(clock))
    # Timed by the round trip, odd sizes would look 25 ms dearer, and the non-decreasing
    # row curve would charge +25 ms from 2 rows on.
    assert latency.curve(2) < 2.0 and latency.curve(17) == pytest.approx(8.0, abs=0.5)
    assert [latency.verify_ms(1, n) - latency.verify_ms(1, 0) for n in (1, 8, 16)] == \
        pytest.approx([0.5, 4.0, 8.0], abs=0.3)


class Yielding(Workers):
    """In-process workers that let the event loop run between steps, as a remote stream does."""

    kind = "verifier"

    def __init__(self, inner):
        self.inner = inner

    async def step(self, step_id, works):
        await asyncio.sleep(0)
        return await self.inner.step(step_id, works)

    def release(self, req_id):
        self.inner.release(req_id)


def test_two_schedulers_warm_up_at_once_through_one_verifier(tiny_target):
    """Schedulers sharing a verifier replica warm up under request ids of their own: the first to
    finish releases only its own, and the other's warm-up goes on (the same ids once failed it)."""
    from services.common.loading import load_model
    from services.common.worker import StepWorker
    from services.scheduler.workers import LocalWorkers
    from services.verifier.verifier import Verifier, VerifyWork
    from specserve.v1 import common_pb2

    model = load_model(str(tiny_target)).model
    info = common_pb2.InfoResponse(model="tiny", vocab_size=model.config.vocab_size,
                                   max_positions=model.config.max_positions)
    worker = StepWorker(info, 1, VerifyWork(Verifier(model)))
    schedulers = [Yielding(LocalWorkers("verifier", worker)) for _ in range(2)]

    async def both():
        # one measures trees up to 16 nodes, the other up to 64: it is still measuring when the first ends
        await asyncio.gather(*(calibration.calibrate(LatencyModel(), s, None, info.vocab_size, max_k=4, width=w,
                                                     max_positions=info.max_positions)
                               for s, w in zip(schedulers, (1, 4))))

    asyncio.run(both())
    assert worker.sequences.ids() == []  # every warm-up request released
