"""The scheduler's in-process n-gram draft replica (--draft-addrs local) answers step messages
as a remote draft service would, keeps per-request state until released, and fails like a
broken stream (WorkerDown, state dropped) on a step it cannot take."""

import asyncio

import pytest

from services.common import codec
from services.draft.ngram import NgramProposer
from services.scheduler.local_draft import LocalDraft
from services.scheduler.workers import ReplicaSet, WorkerDown
from specserve.v1 import common_pb2, draft_pb2

INFO = common_pb2.InfoResponse(model="tiny", vocab_size=100, max_positions=64, eos_token_ids=[2], role="verifier")
TOKENS = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]


def item(rid: str, offset: int, tokens: list[int], k: int = 3, size: int = 3) -> draft_pb2.ProposeItem:
    return draft_pb2.ProposeItem(request_id=rid, offset=offset, tokens=tokens, draft_length=k, tree_size=size,
                                 params=common_pb2.SamplingParams(max_tokens=8))


def test_proposes_the_ngram_tree_and_keeps_state_until_released():
    local = LocalDraft(INFO)
    assert asyncio.run(local.info()).proposer == "ngram"
    res = asyncio.run(local.step(draft_pb2.ProposeStep(step_id=0, items=[item("a", 0, TOKENS, 3, 4)])))
    want = NgramProposer().tree(TOKENS, 3, 4)
    assert len(want) > 0 and codec.tree_from_pb(res.proposals[0].tree).tokens == want.tokens
    # The next step sends only the new tokens, as over a stream.
    res = asyncio.run(local.step(draft_pb2.ProposeStep(step_id=1, items=[item("a", len(TOKENS), [7])])))
    assert codec.tree_from_pb(res.proposals[0].tree).tokens == NgramProposer().tree(TOKENS + [7], 3, 3).tokens
    assert local.servicer.worker.ledger.ids() == ["a"]
    asyncio.run(local.step(draft_pb2.ProposeStep(step_id=2, release=["a"])))
    assert local.servicer.worker.ledger.ids() == []


def test_a_bad_step_is_worker_down_and_drops_state():
    local = LocalDraft(INFO)
    asyncio.run(local.step(draft_pb2.ProposeStep(step_id=0, items=[item("a", 0, TOKENS)])))
    local.sent["a"] = len(TOKENS)
    with pytest.raises(WorkerDown):  # one request twice in a step
        asyncio.run(local.step(draft_pb2.ProposeStep(step_id=1, items=[item("b", 0, TOKENS), item("b", 0, TOKENS)])))
    assert local.servicer.worker.ledger.ids() == [] and local.sent == {}
    res = asyncio.run(local.step(draft_pb2.ProposeStep(step_id=2, items=[item("a", 5, [1])])))
    assert res.proposals[0].need_resync  # a stale offset asks the scheduler to resend from 0


def test_replica_set_takes_it_in_place_of_addresses():
    drafts = ReplicaSet("draft", [], replicas=[LocalDraft(INFO)])
    assert drafts.assign("r").address == "local"
    with pytest.raises(ValueError):
        ReplicaSet("draft", [])
