"""Fuzzing every gRPC service of the real stack with random protobuf messages (hypothesis).

- draft Propose and verifier Verify: random step streams (offsets beyond the ledger, tokens
  outside the vocabulary, trees with bad parents or q, absurd draft_length / tree_size, empty
  items, duplicate request ids, releases of unknown ids);
- scheduler Generate: random GenerateRequests (prompt ids, sampling extremes, draft overrides);
- the gateway's public Generate / GenerateStream: random TextRequests (with and without the API
  key) and random bytes.

Invariants: every call ends within its deadline with OK or a documented refusal (never UNKNOWN
or INTERNAL); answers are well formed (one result per step, in order; trees and verdicts keep
their invariants); the service stays SERVING; once the streams close no service holds a `fuzz-`
request. Request ids start with `fuzz-` so that they never clash with other tests.

SPECSERVE_FUZZ_EXAMPLES sets the examples per property (default 100; derandomized, so a run is
reproducible). Run with -s to print the calls per target and final status.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st

from services.common import codec
from services.common.tree import MAX_TREE_NODES
from specserve.v1 import (common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, scheduler_pb2,
                          scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc)
from tests.integration.fuzzing import (CALL_TIMEOUT, CONTEXT, FUZZ, INVALID, OK, VOCAB, any_token, assert_freed,
                                       float32s, int32s, mostly, mutated, run_stream, sampling, served, texts,
                                       tokens_in_vocab)
from tests.integration.stack import grpc_health

POOL = ["fuzz-a", "fuzz-b", "fuzz-c"]  # worker request ids: repeats make steps continue a request
OUTCOMES: defaultdict[str, Counter] = defaultdict(Counter)  # target -> final status -> calls (-s prints it)

token_lists = mostly(st.lists(tokens_in_vocab, min_size=1, max_size=12),
                     st.lists(any_token, max_size=6) | st.lists(tokens_in_vocab, min_size=CONTEXT - 8,
                                                                max_size=CONTEXT + 8))
item_ids = mostly(st.lists(st.sampled_from(POOL), unique=True, max_size=3),
                  st.lists(st.sampled_from(POOL), max_size=4))  # the same request twice in a step
offsets = st.just(0) | st.integers(-3, 40) | int32s
releases = st.lists(st.sampled_from(POOL + ["fuzz-unknown", ""]), max_size=3)


@st.composite
def propose_steps(draw):
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        items = [draft_pb2.ProposeItem(
            request_id=rid, offset=draw(offsets), tokens=draw(token_lists),
            draft_length=draw(st.integers(0, 5) | int32s), tree_size=draw(st.integers(0, 8) | int32s),
            params=draw(sampling()), traceparent=draw(texts)) for rid in draw(item_ids)]
        steps.append(draft_pb2.ProposeStep(step_id=draw(st.integers(0, 2**64 - 1)), items=items,
                                           release=draw(releases)))
    return steps


@st.composite
def trees(draw):
    """Draft trees: mostly valid (point-mass q), else bad parents, tokens or q, or too many nodes."""
    if draw(st.integers(0, 20)) == 0:
        n = draw(st.sampled_from([MAX_TREE_NODES, MAX_TREE_NODES + 1, 400]))  # a chain of point masses
        toks = [5 + i % 50 for i in range(n)]
        return common_pb2.DraftTree(tokens=toks, parents=list(range(-1, n - 1)),
                                    q=[common_pb2.QDistribution(ids=[t], probs=[1.0]) for t in toks])
    n = draw(st.integers(0, 5))
    toks = draw(st.lists(tokens_in_vocab if draw(st.booleans()) else any_token, min_size=n, max_size=n))
    parents = [draw(st.integers(-1, i - 1) if draw(st.integers(0, 4)) else st.integers(-3, n + 1) | int32s)
               for i in range(n)]
    q = []
    for t in toks[: draw(st.integers(max(0, n - 1), n))]:
        if draw(st.integers(0, 3)):
            q.append(common_pb2.QDistribution(ids=[t], probs=[1.0]))
        else:
            q.append(common_pb2.QDistribution(ids=draw(st.lists(any_token, max_size=4)),
                                              probs=draw(st.lists(float32s, max_size=4))))
    return common_pb2.DraftTree(tokens=toks, parents=parents, q=q)


@st.composite
def verify_steps(draw):
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        items = [verifier_pb2.VerifyItem(
            request_id=rid, offset=draw(offsets), tokens=draw(token_lists),
            tree=draw(trees()), params=draw(sampling()), traceparent=draw(texts)) for rid in draw(item_ids)]
        steps.append(verifier_pb2.VerifyStep(step_id=draw(st.integers(0, 2**64 - 1)), items=items,
                                             release=draw(releases)))
    return steps


VALID_BYTES = gateway_pb2.TextRequest(
    prompt="w5 w6", messages=[gateway_pb2.ChatMessage(role="user", content="w7")],
    params=common_pb2.SamplingParams(max_tokens=2, temperature=0.5)).SerializeToString()


# -- helpers ------------------------------------------------------------------------------------
def check_tree(tree: common_pb2.DraftTree, item: draft_pb2.ProposeItem) -> None:
    t = codec.tree_from_pb(tree)
    t.validate(VOCAB)
    assert len(t) <= max(0, min(item.tree_size, MAX_TREE_NODES))
    assert max(t.depths(), default=0) <= max(0, item.draft_length)


def check_verdict(v: verifier_pb2.Verdict, item: verifier_pb2.VerifyItem) -> None:
    if v.need_resync:
        assert not v.tokens and not v.accepted_nodes
        return
    nodes, parents = list(v.accepted_nodes), list(item.tree.parents)
    assert len(v.tokens) == len(nodes) + 1 and all(0 <= t < VOCAB for t in v.tokens)
    for i, node in enumerate(nodes):  # a path from the root down
        assert parents[node] == (nodes[i - 1] if i else -1)
        assert v.tokens[i] == item.tree.tokens[node]


@pytest.fixture(scope="module")
def channels(stack):
    chans = {name: grpc.insecure_channel(addr) for name, addr in (
        ("draft", stack.draft_addr), ("verifier", stack.verifier_addr), ("scheduler", stack.scheduler_addr),
        ("gateway", stack.grpc_addr))}
    yield chans
    for ch in chans.values():
        ch.close()
    for addr in (stack.draft_addr, stack.verifier_addr, stack.scheduler_addr, stack.grpc_addr):
        assert grpc_health(addr, timeout=5) == health_pb2.HealthCheckResponse.SERVING, addr
    print(f"\ngRPC fuzz calls per target and status: { {k: dict(v) for k, v in OUTCOMES.items()} }")


# -- workers ------------------------------------------------------------------------------------
def test_draft_propose_streams(channels):
    stub, outcomes = draft_pb2_grpc.DraftServiceStub(channels["draft"]), OUTCOMES["draft.Propose"]

    @FUZZ
    @given(steps=propose_steps())
    def run(steps):
        results, code, details = run_stream(stub.Propose, steps)
        assert code in (OK, INVALID), (code, details)
        assert len(results) == len(steps) if code == OK else len(results) < len(steps)
        for step, res in zip(steps, results):
            assert res.step_id == step.step_id
            assert [p.request_id for p in res.proposals] == [i.request_id for i in step.items]
            for item, prop in zip(step.items, res.proposals):
                check_tree(prop.tree, item)
        assert_freed(channels["draft"], draft_pb2_grpc.DraftServiceStub)
        outcomes[code.name] += 1

    run()
    assert outcomes[OK.name] and outcomes[INVALID.name], outcomes


def test_verifier_verify_streams(channels):
    stub, outcomes = verifier_pb2_grpc.VerifierServiceStub(channels["verifier"]), OUTCOMES["verifier.Verify"]

    @FUZZ
    @given(steps=verify_steps())
    def run(steps):
        results, code, details = run_stream(stub.Verify, steps)
        assert code in (OK, INVALID), (code, details)
        assert len(results) == len(steps) if code == OK else len(results) < len(steps)
        for step, res in zip(steps, results):
            assert res.step_id == step.step_id
            assert [v.request_id for v in res.verdicts] == [i.request_id for i in step.items]
            for item, verdict in zip(step.items, res.verdicts):
                check_verdict(verdict, item)
        assert_freed(channels["verifier"], verifier_pb2_grpc.VerifierServiceStub)
        outcomes[code.name] += 1

    run()
    assert outcomes[OK.name] and outcomes[INVALID.name], outcomes


@pytest.mark.parametrize("service,method,message", [
    ("draft", "/specserve.v1.DraftService/Propose", draft_pb2.ProposeStep(items=[draft_pb2.ProposeItem(
        request_id="fuzz-a", tokens=[5, 6, 5], draft_length=2, tree_size=3,
        params=common_pb2.SamplingParams(max_tokens=4))])),
    ("verifier", "/specserve.v1.VerifierService/Verify", verifier_pb2.VerifyStep(items=[verifier_pb2.VerifyItem(
        request_id="fuzz-a", tokens=[5, 6, 5], params=common_pb2.SamplingParams(max_tokens=4))]))],
    ids=["draft", "verifier"])
def test_worker_streams_of_random_bytes(channels, service, method, message):
    """Step messages as bytes: valid ones, mutated ones (bad UTF-8 in a string field, cut
    varints) and random ones; what does not parse is INVALID_ARGUMENT (it was UNKNOWN)."""
    stub_cls = draft_pb2_grpc.DraftServiceStub if service == "draft" else verifier_pb2_grpc.VerifierServiceStub
    call = channels[service].stream_stream(method)  # bytes in, bytes out
    valid = message.SerializeToString()

    @FUZZ
    @given(raws=st.lists(st.just(valid) | mutated(valid) | st.binary(max_size=100), min_size=1, max_size=3))
    def run(raws):
        _, code, details = run_stream(call, raws)
        assert code in (OK, INVALID), (code, details)
        assert_freed(channels[service], stub_cls)
        OUTCOMES[f"{service} stream (bytes)"][code.name] += 1

    run()
    assert OUTCOMES[f"{service} stream (bytes)"][INVALID.name], OUTCOMES


# -- scheduler ----------------------------------------------------------------------------------
@st.composite
def generate_requests(draw):
    # Prompt ids stay inside the vocabulary here: ids outside it take the verifier's step stream
    # down for everyone (test_scheduler_refuses_prompt_ids_outside_the_vocabulary).
    req = scheduler_pb2.GenerateRequest(
        request_id=f"fuzz-{draw(st.text(max_size=8))}",
        prompt_ids=draw(mostly(st.lists(tokens_in_vocab, min_size=1, max_size=12),
                               st.lists(tokens_in_vocab, max_size=2) | st.lists(tokens_in_vocab, min_size=240,
                                                                                  max_size=260))),
        params=draw(sampling(small_max_tokens=False)), request_class=draw(texts))
    for name in ("draft_length", "tree_size"):
        value = draw(st.none() | st.integers(0, 6) | int32s)
        if value is not None:
            setattr(req, name, value)
    return req


def test_scheduler_generate(channels):
    stub, outcomes = scheduler_pb2_grpc.SchedulerServiceStub(channels["scheduler"]), OUTCOMES["scheduler.Generate"]

    @FUZZ
    @given(req=generate_requests())
    def run(req):
        events = []
        try:
            for ev in stub.Generate(req, timeout=CALL_TIMEOUT):
                events.append(ev)
            code, details = OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        assert code in (OK, INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details)
        if code == OK:
            assert events and events[-1].finish_reason in ("stop", "length"), events[-1:]
            assert not any(ev.finish_reason for ev in events[:-1])
            ids = [t for ev in events for t in ev.token_ids]
            assert all(0 <= t < VOCAB for t in ids) and 1 <= len(ids) <= req.params.max_tokens
            assert events[-1].usage.completion_tokens == len(ids)
        outcomes[code.name] += 1

    run()
    assert outcomes[OK.name] and outcomes[INVALID.name], outcomes
    for name, stub_cls in (("scheduler", scheduler_pb2_grpc.SchedulerServiceStub),
                           ("draft", draft_pb2_grpc.DraftServiceStub),
                           ("verifier", verifier_pb2_grpc.VerifierServiceStub)):
        assert_freed(channels[name], stub_cls)


def test_scheduler_refuses_a_running_request_id(channels):
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channels["scheduler"])
    req = scheduler_pb2.GenerateRequest(request_id="fuzz-twice", prompt_ids=[5, 6, 7],
                                        params=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
    first = stub.Generate(req, timeout=CALL_TIMEOUT)
    next(first)  # running
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=CALL_TIMEOUT))
    assert e.value.code() == INVALID and "already running" in e.value.details()
    first.cancel()
    assert_freed(channels["scheduler"], scheduler_pb2_grpc.SchedulerServiceStub)


# -- gateway public gRPC ------------------------------------------------------------------------
@st.composite
def text_requests(draw):
    roles = mostly(st.sampled_from(["user", "system", "assistant", "developer"]), st.sampled_from(["tool", ""]) | texts)
    messages = draw(st.lists(st.builds(gateway_pb2.ChatMessage, role=roles, content=texts), max_size=3))
    return gateway_pb2.TextRequest(model=draw(mostly(st.sampled_from(["", "target"]), st.just("gpt-4") | texts)),
                                   prompt=draw(mostly(st.just("w5 w6 w7"), texts)), messages=messages,
                                   params=draw(sampling(small_max_tokens=False)))


GATEWAY_CODES = (OK, INVALID, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)


def gateway_metadata(stack, which: str) -> tuple:
    return {"key": (("authorization", f"Bearer {stack.api_key}"),), "none": (),
            "wrong": (("authorization", "Bearer sk-wrong"),),
            "garbage": (("authorization", "Basic Zm9vOmJhcg=="),)}[which]


def test_gateway_generate(stack, channels):
    stub = gateway_pb2_grpc.GenerationStub(channels["gateway"])

    @FUZZ
    @given(req=text_requests(), streamed=st.booleans(),
           key=mostly(st.just("key"), st.sampled_from(["none", "wrong", "garbage"])))
    def run(req, streamed, key):
        md = gateway_metadata(stack, key)
        try:
            if streamed:
                chunks = list(stub.GenerateStream(req, metadata=md, timeout=CALL_TIMEOUT))
                assert chunks and chunks[-1].finish_reason in ("stop", "length")
            else:
                assert stub.Generate(req, metadata=md, timeout=CALL_TIMEOUT).finish_reason in ("stop", "length")
            code, details = OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        assert code in GATEWAY_CODES, (code, details)
        if key != "key":
            assert code == grpc.StatusCode.UNAUTHENTICATED
        OUTCOMES["gateway.GenerateStream" if streamed else "gateway.Generate"][code.name] += 1

    run()
    outcomes = OUTCOMES["gateway.Generate"] + OUTCOMES["gateway.GenerateStream"]
    assert outcomes[OK.name] and outcomes[INVALID.name], outcomes


def test_gateway_random_bytes(stack, channels):
    md = gateway_metadata(stack, "key")
    unary = channels["gateway"].unary_unary("/specserve.v1.Generation/Generate")  # bytes in, bytes out

    @FUZZ
    @given(raw=st.binary(max_size=300) | mutated(VALID_BYTES) | st.sampled_from([
        VALID_BYTES, b"\x12\x02\xff\xfe", b"\x12\xff\xff\xff\xff\x0f", b"\x0a" * 50, b"\x22\x05\x08\x80\x80\x80\x80"]))
    def run(raw):
        try:
            gateway_pb2.TextResponse.FromString(unary(raw, metadata=md, timeout=CALL_TIMEOUT))
            code = OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in GATEWAY_CODES, (code, e.details())
        OUTCOMES["gateway.Generate(bytes)"][code.name] += 1

    run()
    assert OUTCOMES["gateway.Generate(bytes)"][OK.name], OUTCOMES  # valid bytes were served too


def test_scheduler_refuses_prompt_ids_outside_the_vocabulary(channels):
    """Bad ids must be refused at submit: sent on, they make the workers refuse the whole step
    stream, and every request sharing it fails with them."""
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channels["scheduler"])
    try:
        for prompt in ([5, VOCAB], [5, -1], [2**31 - 1]):
            bad = scheduler_pb2.GenerateRequest(request_id="fuzz-oov", prompt_ids=prompt,
                                                params=common_pb2.SamplingParams(max_tokens=4))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=CALL_TIMEOUT))
            assert e.value.code() == INVALID and "vocabulary" in e.value.details(), prompt
    finally:
        served(stub)  # leave a working stack to the tests that follow
