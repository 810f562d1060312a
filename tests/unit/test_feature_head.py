"""The feature-level head on a tiny target: training-time test computes what serving computes,
the engine stays the target's greedy decoding with it, and bad or missing states are handled."""

import pytest
import torch

from services.common.hidden_states import HiddenStates
from services.common.loading import load_model, load_weights
from services.common.sampling import SamplingParams, warp_probs
from services.common.sequence import Sequence
from services.common.vocab import VocabularyMismatch
from services.draft.factory import build_head_proposer
from services.draft.head_proposer import HeadProposer
from services.draft.proposer import ProposeItem
from services.draft.training import head_trainer, teacher
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.tiny import target_states, tiny_chunk

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(str(tiny_target))


@pytest.mark.parametrize("greedy", [True, False])
def test_training_unroll_computes_what_serving_drafts(target, greedy, monkeypatch):
    """A drafted chain's q at depth d equals the training unroll's distribution at step d - 1
    (served on float weights: the native routes round them)."""
    monkeypatch.setenv("SPECSERVE_HEAD_WEIGHTS", "float")
    head = tiny.make_head(target)
    proposer = tiny.head_proposer(target, head)
    ids = torch.randint(3, 64, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    states = target_states(target, ids)  # [12, 2 * hidden]
    params = SamplingParams(max_tokens=8) if greedy else SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    seq = Sequence("r", params, None if greedy else torch.Generator().manual_seed(3), tokens=list(ids))
    # the target has committed ids (the last one not yet fed): states of positions 0 .. n - 2
    tree = proposer.propose([ProposeItem(seq, 3, 3, [HiddenStates(0, states[:-1].half())])])[0]
    assert tree.is_chain() and len(tree) == 3
    n = len(ids) - 1  # the last committed position
    full = ids + tree.tokens[:2]  # the chain's tokens continue the sequence
    sample = teacher.Sample(full + [0], len(full), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1),
                            torch.cat([states[:-1].half(), torch.zeros(3, states.shape[1], dtype=torch.half)]))
    batch = head_trainer.make_batch([sample], torch.arange(target.config.vocab_size))
    with torch.no_grad():
        outs = head_trainer.unroll(head, proposer.embed, batch, 3)
        for d in range(3):  # depth d + 1 is read at position n - 1 + d, step d
            logits = head.logits(outs[d][0, n - 1 + d])[None]
            if greedy:
                assert int(logits.argmax()) == tree.tokens[d]
            else:
                q = warp_probs(logits, 1.0, 0, 1.0)[0]
                top = q.topk(32)
                want = dict(zip(top.indices.tolist(), (top.values / top.values.sum()).tolist()))
                got = dict(zip(tree.q_ids[d], tree.q_probs[d]))
                assert set(got) <= set(want)
                for t, p in got.items():
                    assert abs(p - want[t]) < 1e-4


@pytest.mark.parametrize("k,tree_size", [(3, 3), (3, 8)])
def test_engine_with_head_is_greedy_decoding(target, k, tree_size):
    head = tiny.make_head(target, kept=torch.arange(2, 50))  # a reduced vocabulary: q = 0 elsewhere
    prompts = [[5, 9, 11, 3, 7], [12, 13, 14, 12, 13, 14, 12], [40, 41]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(target, None, StepConfig(draft_length=0), warm_up=False).generate(prompts, params)
    engine = Engine(target, tiny.head_proposer(target, head), StepConfig(draft_length=k, tree_size=tree_size),
                    warm_up=False)
    spec = engine.generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert sum(r.stats.drafted for r in spec) > 0  # the states reached the head: it drafted


def test_bad_states_are_refused(target):
    proposer = tiny.head_proposer(target, tiny.make_head(target))
    ids = [5, 6, 7, 8]
    width = proposer.width
    seq = Sequence("r", SamplingParams(max_tokens=4), None, tokens=ids)
    with pytest.raises(ValueError, match="expected"):
        proposer.propose([ProposeItem(seq, 2, 2, [HiddenStates(0, torch.zeros(3, width + 1, dtype=torch.half))])])
    bad = torch.zeros(3, width, dtype=torch.half)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        proposer.propose([ProposeItem(seq, 2, 2, [HiddenStates(0, bad)])])
    with pytest.raises(ValueError, match="bytes"):
        HiddenStates.from_bytes(0, 3, width, b"\0" * 10)


def test_missing_states_propose_nothing_until_they_arrive(target):
    """A replica that lost a request (states of early positions never came) drafts again once it
    holds the states up to the last committed position."""
    proposer = tiny.head_proposer(target, tiny.make_head(target))
    ids = list(range(5, 17))
    states = target_states(target, ids).half()
    seq = Sequence("r", SamplingParams(max_tokens=4), None, tokens=ids[:8])
    assert len(proposer.propose([ProposeItem(seq, 2, 2, [])])[0]) == 0  # nothing yet
    seq.tokens = list(ids)  # positions 0..6 were never sent; 7..10 arrive
    tree = proposer.propose([ProposeItem(seq, 2, 2, [HiddenStates(7, states[7:11])])])[0]
    assert len(tree) == 2
    assert seq.scratch.slots == 4 and seq.scratch.last == 10


def test_held_states_are_fed_at_the_next_draft_as_if_fed_every_step(target):
    """The hybrid's n-gram steps: the head holds the states it gets and drafts nothing; at its next
    draft it reads them all, and drafts what a head fed at every step drafts."""
    head = tiny.make_head(target)
    ids = list(range(5, 21))
    states = target_states(target, ids).half()
    every, held = tiny.head_proposer(target, head), tiny.head_proposer(target, head)
    a = Sequence("a", SamplingParams(max_tokens=4), None, tokens=ids[:8])
    b = Sequence("b", SamplingParams(max_tokens=4), None, tokens=ids[:8])
    first = [HiddenStates(0, states[:7])]
    every.propose([ProposeItem(a, 2, 2, first)])
    held.hold([ProposeItem(b, 2, 2, first)])
    assert b.scratch.slots == 0 and len(b.scratch.held) == 1
    for end in (10, 13):  # two more steps: 2 and 3 committed tokens
        a.tokens, b.tokens = ids[:end], ids[:end]
        more = [HiddenStates(len(a.tokens) - (3 if end == 10 else 4), states[end - (3 if end == 10 else 4) : end - 1])]
        tree_a = every.propose([ProposeItem(a, 2, 2, more)])[0]
        if end == 10:
            held.hold([ProposeItem(b, 2, 2, more)])
    tree_b = held.propose([ProposeItem(b, 2, 2, more)])[0]
    assert (b.scratch.slots, b.scratch.last, b.scratch.held) == (a.scratch.slots, a.scratch.last, [])
    assert tree_b.tokens == tree_a.tokens and len(tree_b) == 2


def test_a_greedy_tree_stops_where_its_levels_cannot_pay(target):
    head = tiny.make_head(target)
    ids = list(range(5, 15))
    states = [HiddenStates(0, target_states(target, ids).half()[:9])]
    sizes = {}
    for mass in (0.0, 1.01):  # never stop; stop after the first level (a level's mass is at most 1)
        proposer = HeadProposer(head, load_weights(target.path)["model.embed_tokens.weight"],
                                target.config.vocab_size, min_level_mass=mass)
        seq = Sequence("r", SamplingParams(max_tokens=8), None, tokens=list(ids))
        sizes[mass] = len(proposer.propose([ProposeItem(seq, 4, 8, states)])[0])
    assert sizes == {0.0: 8, 1.01: 2}


def test_checkpoint_round_trip_and_vocabulary_check(target, tmp_path, tiny_target):
    head = tiny.make_head(target)
    head.save(tmp_path / "head")
    proposer = build_head_proposer(str(tmp_path / "head"), target)
    assert proposer.feature_layers == LAYERS
    for a, b in zip(head.state_dict().values(), proposer.head.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-2 * (1 + float(a.float().abs().max())))
    other = tiny.make_checkpoint(tmp_path / "other", seed=1, rename={10: "zz"})
    with pytest.raises(VocabularyMismatch):
        build_head_proposer(str(tmp_path / "head"), load_model(str(other)))


def test_hybrid_takes_the_ngram_on_long_matches_and_stays_lossless(target):
    """Long matches: the n-gram alone; short ones: both in one tree (greedy); none: the head. (A
    threshold of 0.9, so that this tiny model's short matches take the union's branch too.)"""
    from services.draft.hybrid import HybridProposer

    hybrid = HybridProposer(tiny.head_proposer(target, tiny.make_head(target)), long_match=0.9)
    loop = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    prompts = [loop * 3, [5, 9, 11, 3, 7], [20, 21, 5, 30, 20, 21, 6, 31, 20]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = Engine(target, None, StepConfig(draft_length=0), warm_up=False).generate(prompts, params)
    spec = Engine(target, hybrid, StepConfig(draft_length=4, tree_size=8), warm_up=False).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert min(hybrid.chosen.values()) > 0, hybrid.chosen


def test_the_union_of_two_greedy_trees_keeps_their_most_likely_paths():
    from services.common.tree import DraftTree
    from services.draft.hybrid import union

    def tree(nodes):  # (token, parent, confidence)
        t = DraftTree()
        for tok, parent, c in nodes:
            t.add(tok, parent, [tok], [1.0])
            t.confidence.append(c)
        return t

    head = tree([(5, -1, 0.5), (6, 0, 0.5), (7, 1, 0.5)])
    ngram = tree([(5, -1, 0.9), (9, 0, 0.9), (8, -1, 0.3)])
    # path confidences: 5 0.95 (1 - 0.5 * 0.1: both propose it), 5-9 0.855, 5-6 0.475, 8 0.3, 5-6-7 0.2375
    u = union(head, ngram, 4)
    assert (u.tokens, u.parents) == ([5, 8, 9, 6], [-1, -1, 0, 0])
    assert u.confidence == pytest.approx([0.95, 0.3, 0.9, 0.5])
    # agreement outranks a single draft's more confident guess: 8 is 1 - 0.4 * 0.5 = 0.8 > 0.7
    assert union(tree([(8, -1, 0.6)]), tree([(5, -1, 0.7), (8, -1, 0.5)]), 1).tokens == [8]
    assert union(head, ngram, 2).tokens == [5, 9] and len(union(head, ngram, 9)) == 5
    assert all(q == [t] for q, t in zip(u.q_ids, u.tokens)) and all(p == [1.0] for p in u.q_probs)


@pytest.mark.parametrize("rows,width,data,nan", [(3, None, 10, False), (3, None, None, True), (2, 7, None, False)])
def test_malformed_states_on_the_wire_are_invalid_argument(target, rows, width, data, nan):
    """Through the draft's step stream: a size that does not match, NaN, the wrong width."""
    import grpc
    import numpy as np

    from specserve.v1 import common_pb2, draft_pb2
    from tests.unit.test_bad_input import draft_stream, item

    proposer = tiny.head_proposer(target, tiny.make_head(target))
    width = width or proposer.width
    values = np.zeros((rows, width), dtype="<f2")
    if nan:
        values[1, 1] = np.nan
    raw = values.tobytes() if data is None else b"\0" * data
    bad = item("a", 0, [5, 6, 7, 8])
    bad.states.append(common_pb2.HiddenStates(start=0, rows=rows, width=width, data=raw))
    steps = [draft_pb2.ProposeStep(step_id=1, items=[item("b", 0, [5, 6, 5])]),
             draft_pb2.ProposeStep(step_id=2, items=[bad])]
    out, code, servicer = draft_stream(steps, proposer)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(out) == 1
    assert servicer.worker.sequences.ids() == []


def test_the_verifier_returns_the_states_of_what_it_committed(target):
    """Verdict states: the pending tokens' rows, then the accepted nodes', equal to a plain forward's."""
    from services.common.tree import DraftTree
    from services.verifier.verifier import Verifier, VerifyItem

    ids = [5, 9, 11, 3, 7]
    verifier = Verifier(target.model)
    seq = Sequence("r", SamplingParams(max_tokens=8), None, tokens=list(ids))
    first = verifier.verify([VerifyItem(seq, DraftTree(), LAYERS)])[0]
    assert first.states.start == 0 and first.states.rows == len(ids)
    nxt = first.tokens[0]
    seq.tokens.append(nxt)
    greedy = target_states(target, ids + [nxt])
    best = int(target.model.forward([tiny_chunk(target.model, ids + [nxt])])[0][-1].argmax())
    wrong = 3 if best != 3 else 4
    tree = DraftTree()  # a wrong guess at depth 1, and the target's own token next to it
    tree.add(wrong, -1, [wrong], [1.0])
    tree.add(best, -1, [best], [1.0])
    v = verifier.verify([VerifyItem(seq, tree, LAYERS)])[0]
    assert v.accepted_nodes == [1] and v.states.start == len(ids) and v.states.rows == 2
    assert torch.allclose(v.states.data[0].float(), greedy[-1].half().float(), atol=1e-2)
    with pytest.raises(ValueError, match="state_layers"):
        verifier.verify([VerifyItem(seq, DraftTree(), (0, 5))])


def test_states_of_skipped_steps_are_joined_into_runs():
    from services.common.hidden_states import join

    rows = torch.arange(18, dtype=torch.half).view(9, 2)
    parts = [HiddenStates(0, rows[0:3]), HiddenStates(3, rows[3:5]), HiddenStates(7, rows[7:9])]
    runs = join(parts)
    assert [(r.start, r.rows) for r in runs] == [(0, 5), (7, 2)]
    assert torch.equal(runs[0].data, rows[0:5]) and torch.equal(runs[1].data, rows[7:9])


def test_an_unknown_head_weight_kind_is_refused(target, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HEAD_WEIGHTS", "int3")
    with pytest.raises(ValueError, match="SPECSERVE_HEAD_WEIGHTS"):
        tiny.make_head(target).prepare_serving()
