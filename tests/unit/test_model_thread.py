"""Workers load their model on the thread that runs it (services/common/worker.py: a second
OpenMP thread team slows every forward), and then step on that same thread."""

import argparse
import asyncio
import socket
import threading

import pytest

from services import serve
from services.common import loading
from tests.integration.stack import free_port


@pytest.mark.parametrize("role, extra", [("verifier", {}), ("draft", {"draft": "self"})])
def test_a_worker_loads_its_model_on_its_model_thread(monkeypatch, role, extra):
    seen = []

    def load(*args, **kwargs):
        seen.append(threading.current_thread().name)
        raise RuntimeError("loaded")  # ends the role's start-up here

    monkeypatch.setattr(loading, "load_model", load)
    port = free_port()
    args = argparse.Namespace(target="default", device="cpu", dtype="auto", weights="native", host="127.0.0.1",
                              port=port, **extra)
    with pytest.raises(RuntimeError, match="loaded"):
        asyncio.run(serve.ROLE_MAIN[role](args))
    assert len(seen) == 1 and seen[0].startswith(role) and seen[0] != threading.main_thread().name
    with pytest.raises(ConnectionRefusedError):  # a role that failed to start leaves nothing listening
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_steps_run_on_the_thread_the_model_was_loaded_on():
    from services.common.worker import StepWorker, model_thread, on_model_thread
    from services.draft.ngram import NgramProposer
    from services.draft.proposer import ProposeWork
    from specserve.v1 import common_pb2

    thread = model_thread("verifier")
    loaded_on = asyncio.run(on_model_thread(thread, lambda: threading.current_thread().ident))
    worker = StepWorker(common_pb2.InfoResponse(role="verifier", vocab_size=10, max_positions=8), 1,
                        ProposeWork(NgramProposer()), executor=thread)
    assert worker.executor.submit(lambda: threading.current_thread().ident).result() == loaded_on
    assert loaded_on != threading.main_thread().ident


@pytest.mark.parametrize("runs_model", [False, True])
def test_a_worker_without_a_model_steps_on_its_event_loop(runs_model):
    """The n-gram draft (no model) answers steps on the event loop: handing a 0.1 ms lookup to the
    model thread and back cost more than the lookup. A model worker steps on its model thread."""
    from services.common import codec
    from services.common.step_servicer import StepServicer
    from services.common.worker import StepWorker
    from services.draft.ngram import NgramProposer
    from services.draft.proposer import ProposeWork
    from specserve.v1 import common_pb2, draft_pb2

    proposer = NgramProposer()
    proposer.runs_model = runs_model
    servicer = StepServicer(StepWorker(common_pb2.InfoResponse(role="draft", vocab_size=10, max_positions=8), 0,
                                       ProposeWork(proposer)), codec.DRAFT)
    assert servicer.inline == (not runs_model)
    servicer.step = lambda msg: threading.current_thread().ident

    async def steps():
        yield draft_pb2.ProposeStep(step_id=1)

    async def go():
        loop_thread = threading.current_thread().ident
        ran_on = [r async for r in servicer.stream(steps(), None)]
        return loop_thread, ran_on

    loop_thread, ran_on = asyncio.run(go())
    assert (ran_on == [loop_thread]) == (not runs_model)
