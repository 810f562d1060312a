"""In-process workers (services/scheduler/workers.py: LocalWorkers) take the step as remote ones
do: the first item carries every token and the parameters, later ones only the new tokens; a
request's state stays until released; the scheduler's own n-gram draft (--draft-addrs local)
survives a step it cannot take as a broken stream would (state dropped, resent from 0)."""

import pytest

from services.common.sampling import SamplingParams
from services.common.worker import StepWorker
from services.draft.ngram import NgramProposer
from services.draft.proposer import ProposeWork
from services.scheduler.engine import run_now
from services.scheduler.workers import LocalWorkers, Work
from specserve.v1 import common_pb2

INFO = common_pb2.InfoResponse(model="tiny", vocab_size=100, max_positions=64, eos_token_ids=[2], role="draft")
TOKENS = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
P = SamplingParams(max_tokens=8)


def local(proposer=None, contain_errors=True) -> LocalWorkers:
    return LocalWorkers("draft", StepWorker(INFO, 0, ProposeWork(proposer or NgramProposer())),
                        contain_errors=contain_errors)


def test_proposes_the_ngram_tree_and_keeps_state_until_released():
    drafts = local()
    reply = run_now(drafts.step(0, [Work("a", TOKENS, P, 3, 4)]))
    want = NgramProposer().tree(TOKENS, 3, 4)
    assert len(want) > 0 and reply.results["a"].tokens == want.tokens and reply.fresh == {"a"}
    reply = run_now(drafts.step(1, [Work("a", TOKENS + [7], P, 3, 3)]))  # only [7] is new
    assert reply.results["a"].tokens == NgramProposer().tree(TOKENS + [7], 3, 3).tokens and not reply.fresh
    assert drafts.sent == {"a": len(TOKENS) + 1} and drafts.worker.sequences.ids() == ["a"]
    drafts.release("a")
    assert drafts.worker.sequences.ids() == [] and drafts.sent == {}


class Boom(NgramProposer):
    def propose(self, items):
        raise RuntimeError("boom")


def test_a_failed_step_costs_its_trees_and_the_state_when_contained():
    drafts = local()
    run_now(drafts.step(0, [Work("a", TOKENS, P, 3, 3)]))
    drafts.worker.work.proposer = Boom()
    reply = run_now(drafts.step(1, [Work("a", TOKENS + [7], P, 3, 3)]))
    assert reply.results == {} and drafts.worker.sequences.ids() == [] and drafts.sent == {}
    drafts.worker.work.proposer = NgramProposer()
    assert run_now(drafts.step(2, [Work("a", TOKENS + [7], P, 3, 3)])).fresh == {"a"}  # resent from 0


def test_the_engine_s_workers_raise_instead():
    with pytest.raises(RuntimeError, match="boom"):
        run_now(local(Boom(), contain_errors=False).step(0, [Work("a", TOKENS, P, 3, 3)]))
