"""The real stack for integration tests: Redis, verifier, draft, scheduler and gateway processes
on loopback, serving a tiny model built here (with a real draft model), plus the in-process
engine configured identically, to compare their outputs."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft.model_proposer import ModelProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.integration.stack import Stack, free_port, stack_env

DRAFT_LENGTH, TREE_SIZE = 3, 5
API_KEY = "sk-test-integration"


@dataclass
class RunningStack:
    stack: Stack
    http_url: str
    grpc_addr: str
    api_key: str
    target: Path
    draft: Path
    engine: Engine

    @property
    def scheduler_addr(self) -> str:
        return self.stack.services["scheduler"][0].addr

    @property
    def draft_addr(self) -> str:
        return self.stack.services["draft"][0].addr

    @property
    def verifier_addr(self) -> str:
        return self.stack.services["verifier"][0].addr

    def engine_generate_ids(self, prompt_ids: list[int], **sampling) -> dict:
        req = self.engine.generate([prompt_ids], SamplingParams(**sampling))[0]
        return {"text": req.text, "token_ids": req.output_ids, "finish_reason": req.finish_reason}

    def engine_generate(self, prompt_text: str, **sampling) -> dict:
        ids = self.engine.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        return self.engine_generate_ids(ids, **sampling)


def start_services(st: Stack, target: Path, draft: Path) -> tuple[str, str]:
    """Verifier, draft, scheduler and gateway serving `target` with the `draft` model: the
    gateway's HTTP URL and gRPC address once all are healthy."""
    verifier = st.start("verifier", "--target", str(target))
    # The full LM head, as the in-process engines use: seeded samples then match token for token
    # (SlimSpec's own equality tests are in tests/unit).
    drafter = st.start("draft", "--target", str(target), "--draft", str(draft), "--compression-ratio", "1.0")
    st.wait_healthy(verifier)
    st.wait_healthy(drafter)
    sched = st.start("scheduler", "--target", str(target), "--draft-addrs", drafter.addr,
                     "--verifier-addrs", verifier.addr, "--draft-length", str(DRAFT_LENGTH),
                     "--tree-size", str(TREE_SIZE))
    st.wait_healthy(sched)
    http_port = free_port()
    gateway = st.start("gateway", "--target", str(target), "--scheduler-addrs", sched.addr,
                       "--http-port", str(http_port))
    st.wait_healthy(gateway)
    http_url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{http_url}/health", timeout=2).status_code == 200:
                return http_url, gateway.addr
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway HTTP not healthy:\n{gateway.log_tail()}")


def speculative_engine(target: Path, draft: Path) -> Engine:
    """The in-process engine configured as the stack's scheduler."""
    target_model = load_model(str(target))
    proposer = ModelProposer(load_model(str(draft)).model, target_model.config.vocab_size)
    return Engine(target_model, proposer, StepConfig(draft_length=DRAFT_LENGTH, tree_size=TREE_SIZE))


@contextmanager
def running_stack(root: Path, target: Path, draft: Path, redis_url: str):
    """The four services on `target` and `draft`, and the in-process engine beside them."""
    st = Stack(root, stack_env(root / "home", REDIS_URL=redis_url, SPECSERVE_API_KEYS=API_KEY))
    try:
        http_url, grpc_addr = start_services(st, target, draft)
        yield RunningStack(st, http_url, grpc_addr, API_KEY, target, draft, speculative_engine(target, draft))
    finally:
        st.stop_all()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, redis_url, home):
    root = tmp_path_factory.mktemp("stack")
    target = tiny.make_checkpoint(root / "target", seed=1)
    draft = tiny.make_checkpoint(root / "draft", seed=2, noise_from=target, noise_std=0.08)
    with running_stack(root, target, draft, redis_url) as running:
        yield running


@pytest.fixture(scope="session")
def topology(tmp_path_factory, home, tiny_target, tiny_draft):
    """2 gateways, 2 schedulers, 2 drafts, 2 verifiers and a Redis of its own (see topology.py).
    Fault tests kill parts of it; each starts with `topology.heal()`."""
    from tests.conftest import redis_server_binary
    from tests.integration.topology import start_topology

    topo = start_topology(tmp_path_factory.mktemp("topology"), home, tiny_target, tiny_draft,
                          redis_server_binary())
    try:
        yield topo
    finally:
        topo.stop()
