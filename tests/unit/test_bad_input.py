"""Regression tests for the bad input the fuzz tests (tests/integration/test_fuzz_*.py) found:
each was a crash (an HTTP 500, a gRPC UNKNOWN) or unbounded work before its fix."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError

from services.common import codec
from services.common.loading import load_model
from services.common.sampling import SamplingParams, warp_probs
from services.common.sequence import Sequence, Sequences
from services.common.step_servicer import StepServicer
from services.common.tree import MAX_TREE_NODES, DraftTree
from services.common.worker import StepWorker, WorkItem, check_items
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.draft.proposer import ProposeItem, ProposeWork
from services.gateway.validation import MAX_JSON_DEPTH, check_json_depth
from specserve.v1 import common_pb2, draft_pb2
from tests.unit.test_gateway_http import assert_openai_error, run


# -- workers: their sequences, step messages, the step stream -----------------------------------
P = SamplingParams(max_tokens=4)


def test_sequences_refuse_tokens_the_model_cannot_take_and_change_nothing():
    seqs = Sequences(1, vocab_size=64, max_positions=8)
    assert seqs.update("r", 0, [1, 2, 3], P).tokens == [1, 2, 3]
    for offset, tokens, message in [(3, [64], "outside the vocabulary"), (3, [-1], "outside the vocabulary"),
                                    (3, [5] * 6, "exceed the context of 8"), (0, [], "no committed token")]:
        with pytest.raises(ValueError, match=message):
            seqs.update("r", offset, tokens, P if offset == 0 else None)
    assert seqs.update("r", 3, [63] * 5).tokens == [1, 2, 3] + [63] * 5  # the refusals left it as it was
    assert seqs.update("r", 9, [1]) is None  # an offset it never saw is still a resync, not an error
    assert Sequences(1).update("r", 0, [10**6], P).tokens == [10**6]  # no limits given: no checks
    with pytest.raises(ValueError, match="no sampling parameters"):  # a first item carries them
        Sequences(1).update("s", 0, [5])


def test_a_step_naming_a_request_twice_is_refused():
    a, b = WorkItem("a", 0, [5], P), WorkItem("b", 0, [5], P)
    check_items(1, [a, b])
    with pytest.raises(ValueError, match="'a' appears more than once"):
        check_items(1, [a, a])


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    async def abort(self, code, details, metadata=()):
        raise Aborted(code, details)


class FailingProposer(NgramProposer):
    def propose(self, items):
        raise RuntimeError("boom")


def draft_stream(steps: list, proposer=None) -> tuple[list, grpc.StatusCode, StepServicer]:
    """Run a Propose stream of `steps` in process (an exception among them is raised by the
    request iterator, as gRPC does for bytes that do not parse): (results, status, the servicer)."""
    info = common_pb2.InfoResponse(vocab_size=64, max_positions=32, role="draft", proposer="ngram")
    servicer = StepServicer(StepWorker(info, 0, ProposeWork(proposer or NgramProposer())), codec.DRAFT)

    async def go():
        async def steps_in():
            for s in steps:
                if isinstance(s, Exception):
                    raise s
                yield s
        out = []
        try:
            async for result in servicer.Propose(steps_in(), FakeContext()):
                out.append(result)
        except Aborted as e:
            return out, e.code
        return out, grpc.StatusCode.OK

    out, code = asyncio.run(go())
    servicer.worker.executor.shutdown()
    return out, code, servicer


def item(rid: str, offset: int, tokens: list[int], k: int = 2) -> draft_pb2.ProposeItem:
    return draft_pb2.ProposeItem(request_id=rid, offset=offset, tokens=tokens, draft_length=k, tree_size=k,
                                 params=common_pb2.SamplingParams(max_tokens=4))


def test_a_request_released_and_sent_again_in_one_step_is_freed_when_the_stream_ends():
    steps = [draft_pb2.ProposeStep(step_id=1, items=[item("a", 0, [5, 6, 5])]),
             draft_pb2.ProposeStep(step_id=2, items=[item("a", 0, [7, 8, 9, 7, 8])], release=["a"])]
    out, code, servicer = draft_stream(steps)
    assert code == grpc.StatusCode.OK and [r.step_id for r in out] == [1, 2]
    assert list(out[1].proposals[0].tree.tokens) == [9, 7]  # proposed from the tokens sent again
    assert servicer.worker.sequences.ids() == []  # which are freed with the stream (they leaked)


def test_releases_of_a_step_refused_before_it_ran_are_still_freed():
    """The step releasing `a` is refused as a whole (a duplicate id), so it never freed `a`: the
    end of the stream must (found by the 1000-example fuzz run)."""
    steps = [draft_pb2.ProposeStep(step_id=1, items=[item("a", 0, [5, 6, 5])]),
             draft_pb2.ProposeStep(step_id=2, items=[item("b", 0, [5]), item("b", 0, [5])], release=["a"])]
    out, code, servicer = draft_stream(steps)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(out) == 1
    assert servicer.worker.sequences.ids() == []


@pytest.mark.parametrize("bad,code", [
    (item("a", 0, [5, 64]), grpc.StatusCode.INVALID_ARGUMENT),  # was an IndexError: UNKNOWN
    (item("a", 0, []), grpc.StatusCode.INVALID_ARGUMENT),
    (item("a", 0, [5] * 33), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_step_input_is_invalid_argument_and_frees_the_stream(bad, code):
    steps = [draft_pb2.ProposeStep(step_id=1, items=[item("b", 0, [5, 6, 5])]),
             draft_pb2.ProposeStep(step_id=2, items=[bad])]
    out, got, servicer = draft_stream(steps)
    assert got == code and len(out) == 1
    assert servicer.worker.sequences.ids() == []


def test_a_step_message_that_does_not_parse_is_invalid_argument_not_unknown():
    bad_bytes = DecodeError("String field had bad UTF-8")
    out, code, servicer = draft_stream([draft_pb2.ProposeStep(step_id=1, items=[item("a", 0, [5, 6, 5])]),
                                        bad_bytes])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(out) == 1
    assert servicer.worker.sequences.ids() == []


def test_an_unexpected_failure_is_internal_not_unknown_and_frees_the_stream():
    out, code, servicer = draft_stream([draft_pb2.ProposeStep(step_id=1, items=[item("a", 0, [5, 6, 5])])],
                                       FailingProposer())
    assert code == grpc.StatusCode.INTERNAL and out == []
    assert servicer.worker.sequences.ids() == []


def test_model_proposer_caps_the_node_budget(tiny_draft):
    """A tree_size of 2**31 - 1 used to size the request's draft cache (hundreds of GB)."""
    proposer = ModelProposer(load_model(str(tiny_draft)).model, 64)
    seq = Sequence("r", SamplingParams(max_tokens=8), None, tokens=[5, 6, 7, 8])
    tree = proposer.propose([ProposeItem(seq, 4, 2**31 - 1)])[0]
    assert 0 < len(tree) <= MAX_TREE_NODES and max(tree.depths()) <= 4
    assert seq.nbytes() < 1 << 20


@pytest.mark.parametrize("temperature", [1e-45, 1e-38])  # float32 subnormals the APIs accept
def test_a_vanishing_temperature_samples_the_argmax_not_nan(temperature):
    """logits / T overflowed to inf and softmax gave NaN: the verifier's multinomial raised, and
    the scheduler lost the replica's step stream (and with it every request on it)."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0], [0.5, -1.0, 2.0, 0.0]])
    probs = warp_probs(logits, temperature, 0, 1.0)
    assert torch.equal(probs, torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]]))
    assert torch.isfinite(warp_probs(logits, temperature, 2, 0.3)).all()
    usual = warp_probs(logits, 0.7, 0, 1.0)
    assert torch.equal(usual, (logits / 0.7).softmax(-1))  # ordinary temperatures: unchanged, bit for bit


# -- trees on the wire ----------------------------------------------------------------------------
@pytest.mark.parametrize("ids,probs,message", [
    ([99], [1.0], "outside the vocabulary"),  # the verifier indexed its distributions with it
    ([-1], [1.0], "outside the vocabulary"),  # ... silently the last token
    ([5, 5], [0.5, 0.5], "repeat"),
    ([5], [math.nan], "finite"),
    ([5, 6], [0.25, 0.25], "sum to 0.5"),
    ([], [], "empty"),
    ([5, 6], [1.0], "differ in length"),
])
def test_trees_with_a_bad_q_are_refused(ids, probs, message):
    tree = DraftTree([5], [-1], [ids], [probs])
    with pytest.raises(ValueError, match=message):
        tree.validate(vocab_size=64)


def test_valid_q_passes():
    DraftTree([5, 6], [-1, 0], [[5, 9], [6]], [[0.25, 0.75], [1.0]]).validate(vocab_size=64)


def test_wire_trees_beyond_the_node_cap_are_refused_before_copying():
    def chain(n: int) -> common_pb2.DraftTree:
        return codec.tree_to_pb(DraftTree([5] * n, list(range(-1, n - 1)), [[5]] * n, [[1.0]] * n))

    assert len(codec.tree_from_pb(chain(MAX_TREE_NODES), MAX_TREE_NODES)) == MAX_TREE_NODES
    assert len(codec.tree_from_pb(chain(MAX_TREE_NODES + 1))) == MAX_TREE_NODES + 1  # no cap asked
    with pytest.raises(ValueError, match="257 nodes"):
        codec.tree_from_pb(chain(MAX_TREE_NODES + 1), MAX_TREE_NODES)
    lopsided = common_pb2.DraftTree(tokens=[5], parents=[-1] * 10_000)
    with pytest.raises(ValueError, match="10000 nodes"):
        codec.tree_from_pb(lopsided, MAX_TREE_NODES)


# -- the gateway's HTTP bodies --------------------------------------------------------------------
def nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_json_depth_limit_is_exact():
    assert check_json_depth({"a": nested(MAX_JSON_DEPTH - 1)}) is not None
    with pytest.raises(Exception, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json_depth({"a": nested(MAX_JSON_DEPTH)})
    assert check_json_depth("scalar") == "scalar"


def test_deep_json_and_int32_overflow_are_400_not_500():
    """json.loads raised RecursionError (a 500); top_k 2**31 failed in the protobuf (a 500)."""
    async def s(client, fake, gw):
        post = client.post
        return [await post("/v1/completions", content=b"[" * 100_000),
                await post("/v1/completions", content=b'{"a":' * 100_000),
                await post("/v1/completions", json={"prompt": "w5", "user": nested(MAX_JSON_DEPTH)}),
                await post("/v1/completions", json={"prompt": "w5", "top_k": 2**31})], fake.requests

    (arrays, objects, deep, top_k), reqs = run(s)
    for r in (arrays, objects, deep):
        assert_openai_error(r, 400, code="json_too_deep")
    assert_openai_error(top_k, 400, param="top_k")
    assert reqs == []
