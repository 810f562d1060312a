"""Workers load their model on the thread that runs it (services/common/worker.py: a second
OpenMP thread team slows every forward), and then step on that same thread."""

import argparse
import asyncio
import threading

import pytest

from services import serve
from services.common import loading


@pytest.mark.parametrize("role, extra", [("verifier", {}), ("draft", {"draft": "self"})])
def test_a_worker_loads_its_model_on_its_model_thread(monkeypatch, role, extra):
    seen = []

    def load(*args, **kwargs):
        seen.append(threading.current_thread().name)
        raise RuntimeError("loaded")  # ends the role's start-up here

    monkeypatch.setattr(loading, "load_model", load)
    args = argparse.Namespace(target="default", device="cpu", dtype="auto", **extra)
    with pytest.raises(RuntimeError, match="loaded"):
        asyncio.run(serve.ROLE_MAIN[role](args))
    assert len(seen) == 1 and seen[0].startswith(role) and seen[0] != threading.main_thread().name


def test_steps_run_on_the_thread_the_model_was_loaded_on():
    from services.common.worker import StepWorker, model_thread, on_model_thread
    from specserve.v1 import common_pb2

    thread = model_thread("verifier")
    loaded_on = asyncio.run(on_model_thread(thread, lambda: threading.current_thread().ident))
    worker = StepWorker(common_pb2.InfoResponse(role="verifier", vocab_size=10, max_positions=8), 1,
                        lambda rid: None, lambda: 0, executor=thread)
    assert worker.executor.submit(lambda: threading.current_thread().ident).result() == loaded_on
    assert loaded_on != threading.main_thread().ident
