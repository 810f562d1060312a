"""No verifier replica for a while (one died, the launcher or Kubernetes restarts it): a request
that is streaming waits for it and then goes on from its committed tokens with the text it would
have had; one that has streamed nothing fails at once (its caller may try another scheduler); a
wait longer than HOLD_WITHOUT_VERIFIER_S ends in an error."""

import pytest

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.scheduler import core
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from services.scheduler.workers import Reply

PROMPT = [5, 6, 7, 8, 5, 6]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class Outage:
    """The engine's verifiers, with no replica to take any request while `gone`."""

    def __init__(self, inner):
        self.inner, self.gone = inner, False

    async def step(self, step_id, works):
        if self.gone:
            return Reply(unplaced=[w.req_id for w in works])
        return await self.inner.step(step_id, works)

    def back_empty(self) -> None:
        """A restarted replica: it holds nothing (the core resends each request from offset 0)."""
        self.gone = False
        self.inner.worker.release_all(self.inner.worker.sequences.ids())
        self.inner.sent.clear()

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def engine(tiny_target):
    eng = Engine(load_model(str(tiny_target)), None, StepConfig(draft_length=0), warm_up=False)
    eng.core.verifiers = Outage(eng.verifiers)
    return eng


def test_a_streaming_request_waits_for_a_verifier_and_goes_on_unchanged(engine):
    want = engine.generate([PROMPT], PARAMS)[0].output_ids
    req = engine.add_request(PROMPT, PARAMS)
    for _ in range(3):
        engine.step()
    assert 0 < len(req.output_ids) < PARAMS.max_tokens
    engine.core.verifiers.gone = True
    fresh = engine.add_request(PROMPT, PARAMS)
    for _ in range(5):
        engine.step()
    assert fresh.finished and fresh.unavailable and "no verifier" in fresh.error  # nothing streamed yet
    assert not req.finished and req.held_since is not None and engine.core.all_held()
    engine.core.verifiers.back_empty()
    while engine.has_work():
        engine.step()
    assert req.finish_reason == "length" and req.output_ids == want and req.held_since is None


def test_a_wait_past_the_limit_fails_the_request(engine, monkeypatch):
    req = engine.add_request(PROMPT, PARAMS)
    engine.step()
    assert req.output_ids
    monkeypatch.setattr(core, "HOLD_WITHOUT_VERIFIER_S", 0.0)
    engine.core.verifiers.gone = True
    engine.step()
    assert req.finish_reason == "error" and "no verifier replica" in req.error and not engine.has_work()
