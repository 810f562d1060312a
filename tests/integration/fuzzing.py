"""What the fuzz tests share (tests/integration/test_fuzz_*.py): hypothesis settings, protobuf
strategies for sampling parameters and texts, byte mutation, and gRPC helpers with deadlines."""

from __future__ import annotations

import os
import time

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from specserve.v1 import common_pb2, scheduler_pb2

# SPECSERVE_FUZZ_EXAMPLES: examples per property (derandomized, so a run is reproducible).
EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
VOCAB, CONTEXT = 64, 256  # the stack's tiny target (tests/tiny.py)
CALL_TIMEOUT = 60.0  # a call still running after this is a hang: DEADLINE_EXCEEDED fails the test
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT

# -- strategies ---------------------------------------------------------------------------------
int32s = st.integers(-(2**31), 2**31 - 1)
int64s = st.integers(-(2**63), 2**63 - 1)
tokens_in_vocab = st.integers(0, VOCAB - 1)
any_token = tokens_in_vocab | int32s | st.sampled_from([-1, VOCAB, 2**31 - 1])
float32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
texts = st.text(max_size=30) | st.sampled_from(["", "w5 w6 w7", "w5 " * 300, "\x00", "<s></s>", "\U0001f600"])


def mostly(valid, wild):
    """Three times in four `valid`, else `wild` (so that deep paths run, not only refusals)."""
    return st.sampled_from([False, False, False, True]).flatmap(lambda w: wild if w else valid)


stops = mostly(st.lists(st.sampled_from(["w9", "w20 w21", "\n", "\U0001f600"]), max_size=2),
               st.lists(texts, max_size=5))


@st.composite
def sampling(draw, small_max_tokens: bool = True):
    """SamplingParams: two in three valid (max_tokens <= 8: cheap), else any field extreme."""
    wild = draw(st.integers(0, 2)) == 0
    pick = (lambda valid, extreme: draw(valid | extreme)) if wild else (lambda valid, extreme: draw(valid))
    p = common_pb2.SamplingParams(
        max_tokens=pick(st.integers(1, 8), st.integers(1, 8) if small_max_tokens else int32s),
        temperature=pick(st.just(0.0) | st.floats(0.0, 2.0, width=32), float32s),
        top_p=pick(st.just(0.0) | st.floats(0.125, 1.0, width=32), float32s),
        top_k=pick(st.integers(0, VOCAB + 2), int32s),
        stop=draw(stops), ignore_eos=draw(st.booleans()))
    seed = pick(st.none() | st.integers(0, 1000), int64s)
    if seed is not None:
        p.seed = seed
    return p


@st.composite
def mutated(draw, raw: bytes):
    """A valid request's bytes with a few bytes changed, dropped or cut off."""
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(out) - 1))
        out[at] = draw(st.integers(0, 255))
    return bytes(out[: draw(st.integers(0, len(out)))] if draw(st.booleans()) else out)


# -- helpers ------------------------------------------------------------------------------------
def run_stream(method, messages: list) -> tuple[list, grpc.StatusCode, str]:
    """Send every message on a bidirectional stream; (answers read, final status, details)."""
    out = []
    call = method(iter(messages), timeout=CALL_TIMEOUT)
    try:
        for answer in call:
            out.append(answer)
        return out, OK, ""
    except grpc.RpcError as e:
        return out, e.code(), e.details() or ""


def held_fuzz_ids(channel, stub_cls) -> list[str]:
    state = stub_cls(channel).State(common_pb2.StateRequest(), timeout=10)
    return [rid for rid in state.request_ids if rid.startswith("fuzz-")]


def assert_freed(channel, stub_cls, timeout: float = 3.0) -> None:
    """No `fuzz-` request is held once its calls ended (freeing runs right after a stream ends)."""
    deadline = time.monotonic() + timeout
    while held := held_fuzz_ids(channel, stub_cls):
        assert time.monotonic() < deadline, f"leaked state: {held}"
        time.sleep(0.02)


def served(stub, timeout: float = 15.0) -> None:
    """Wait until the scheduler serves a small request again (a replica that failed a step is
    retried after workers.RETRY_AFTER_S)."""
    deadline = time.monotonic() + timeout
    good = scheduler_pb2.GenerateRequest(request_id="fuzz-probe", prompt_ids=[5, 6],
                                         params=common_pb2.SamplingParams(max_tokens=2))
    while True:
        try:
            list(stub.Generate(good, timeout=CALL_TIMEOUT))
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the scheduler does not serve requests any more"
            time.sleep(0.2)
