"""Training the feature-level head on a tiny target: the trainer raises held-out agreement (in
float32 and bf16), continues from a trained head, the GPU teacher records what the engine's does,
the script writes a head with its ablation, and the batch builders and prompts are what they say."""

from dataclasses import replace

import pytest
import torch

from services.common.loading import load_model, load_weights
from services.draft.training import feature_data, head_trainer, teacher
from tests import tiny
from tests.tiny import target_states

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(str(tiny_target))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trained_head_beats_its_start(target, precision):
    """Teacher data with states, a few training steps (float32 or bf16 autocast matmuls): held-out
    agreement rises."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 64, (6,), generator=gen).tolist() for _ in range(24)]
    samples = teacher.generate(target.model, prompts, [0.0] * 24, (), 24, top_k=8, batch=8, state_layers=LAYERS)
    # decoding recorded the same states a teacher-forced forward computes
    s = samples[0]
    assert torch.allclose(s.states.float(), target_states(target, s.ids[:-1]).half().float(), atol=1e-2)
    head = tiny.make_head(target)
    embed = load_weights(target.path)["model.embed_tokens.weight"]
    t2d = torch.arange(target.config.vocab_size)
    plan = head_trainer.TrainPlan(steps=60, unroll=2, lr=3e-3, batch_tokens=256, seed=0, precision=precision)
    before = head_trainer.evaluate(head, embed, samples[:4], t2d, plan)
    assert head_trainer.train(head, embed, samples[4:], t2d, plan)["precision"] == precision
    after = head_trainer.evaluate(head, embed, samples[:4], t2d, plan)
    assert after[0]["loss"] < before[0]["loss"] and after[0]["top1"] > before[0]["top1"]
    assert after[1]["loss"] < before[1]["loss"]


def test_auto_precision_times_both_and_leaves_no_gradients(target):
    head = tiny.make_head(target)
    embed = load_weights(target.path)["model.embed_tokens.weight"]
    samples = teacher.generate(target.model, [[5, 6, 7, 8]] * 2, [0.0] * 2, (), 8, top_k=8, state_layers=LAYERS)
    batch = head_trainer.make_batch(samples, torch.arange(target.config.vocab_size))
    plan = head_trainer.TrainPlan(steps=1, unroll=2, lr=1e-3, batch_tokens=64, seed=0)
    assert head_trainer.choose_precision(head, embed, lambda: batch, plan) in ("fp32", "bf16")
    assert all(p.grad is None for p in head.parameters())

    def unbuilt():
        raise AssertionError("an explicit choice (or a GPU) needs no probe batch")

    for given in ("fp32", "bf16"):  # an explicit choice is kept untimed
        assert head_trainer.choose_precision(head, embed, unbuilt, replace(plan, precision=given)) == given
    assert head_trainer.choose_precision(head, embed, unbuilt, replace(plan, device="cuda")) == "bf16"


def test_a_continued_head_starts_from_the_trained_one(target):
    """init_from_head: every weight from the trained head; its LM-head rows for the ids both
    vocabularies keep, the target's rows for the others; a head for other layers is refused."""
    from services.draft.feature_head import init_from_head

    trained = tiny.make_head(target, kept=torch.arange(0, 40), seed=1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained": away from the target's start
    fresh = tiny.make_head(target, kept=torch.arange(20, 60), seed=2)
    target_rows = fresh.lm_head.weight.detach().clone()
    init_from_head(fresh, trained)
    assert torch.equal(fresh.wqkv.weight, trained.wqkv.weight) and torch.equal(fresh.fuse.weight, trained.fuse.weight)
    assert torch.equal(fresh.lm_head.weight[:20], trained.lm_head.weight[20:40])  # ids 20..39: both keep them
    assert torch.equal(fresh.lm_head.weight[20:], target_rows[20:])  # ids 40..59: only the new one
    assert fresh.d2t.tolist() == list(range(20, 60))
    with pytest.raises(ValueError, match="layers"):
        init_from_head(tiny.make_head(target, layers=(1,)), trained)


def test_the_gpu_teacher_records_what_the_engine_teacher_records(target):
    """hf_teacher (transformers' generate, for CUDA machines) makes the same Samples as the
    engine's teacher: the same greedy answers, states and top-k, position for position."""
    from services.draft.training import hf_teacher

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    ours = teacher.generate(target.model, prompts, [0.0] * 3, (), 12, top_k=8, batch=3, state_layers=LAYERS)
    model = hf_teacher.load(target.path, "cpu")
    theirs = hf_teacher.generate(model, prompts, [0.0] * 3, (), 12, top_k=8, batch=2, state_layers=LAYERS)
    for a, b in zip(ours, theirs):
        assert a.ids == b.ids and a.prompt_len == b.prompt_len
        assert a.states.shape == b.states.shape == (len(a.ids) - 1, len(LAYERS) * target.config.hidden_size)
        assert torch.allclose(a.states.float(), b.states.float(), atol=1e-2)
        assert torch.equal(a.top_ids, b.top_ids)
        assert torch.allclose(a.top_logp.float(), b.top_logp.float(), atol=1e-2)


def test_train_head_with_the_hf_teacher_writes_a_head_and_its_data_size_ablation(tiny_target, tmp_path):
    """scripts/train_head.py end to end with the two-stage hf teacher: a loadable head, and the
    ablation trained for the same steps as the head, in its card."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import train_head
    from services.draft.feature_head import FeatureHead

    out = tmp_path / "head"
    assert train_head.main(["--target", str(tiny_target), "--teacher", "hf", "--prompts", "12",
                            "--passage-fraction", "0.3", "--max-tokens", "8", "--held-out", "2", "--steps", "4",
                            "--batch-tokens", "256", "--layers", "0,1", "--ablation", "0.5",
                            "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    info = json.loads((out / "train-info.json").read_text())
    assert info["answers"] == 12 and info["steps"] == 4
    assert [a["fraction"] for a in info["ablation"]] == [0.5] and info["ablation"][0]["steps"] == 4
    assert info["ablation"][0]["answers"] == 5  # half of the 10 not held out
    assert "## Data size" in (out / "card.md").read_text()
    assert FeatureHead.load(out).config.target_layers == (0, 1)
    cached = list((tmp_path / "work").glob("hf-*.pt"))
    assert len(cached) == 1  # a second run on the same work directory reads the answers back
    assert train_head.main(["--target", str(tiny_target), "--teacher", "hf", "--prompts", "12",
                            "--passage-fraction", "0.3", "--max-tokens", "8", "--held-out", "2", "--steps", "4",
                            "--batch-tokens", "256", "--layers", "0,1", "--work", str(tmp_path / "work"),
                            "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "train-info.json").read_text())["teacher_seconds"] == info["teacher_seconds"]


def test_the_engine_teacher_answers_passage_prompts_after_the_template_ones(tiny_target, tmp_path):
    """--passage-fraction with the engine's teacher (a CPU run): the second stage's prompts quote
    first-stage answers and are numbered after them; a rerun reads the same cache back."""
    from services.common.loading import load_model

    target = load_model(str(tiny_target))
    plan = feature_data.TeacherPlan((0, 1), prompts=16, tokens=10**6, max_tokens=8, sampled_fraction=0.0,
                                    batch=8, seed=0, passage_fraction=0.5)
    samples, seconds = feature_data.build(target, tmp_path, plan, minutes=5)
    first, foreign, second = plan.stage_one(target.tokenizer)
    assert (len(first), len(foreign), second) == (9, 1, 8)  # the foreign prompt first, then 8 templates
    assert len(samples) == 17 and seconds > 0
    answers = [target.tokenizer.decode(s.ids[s.prompt_len :], skip_special_tokens=True).strip() for s in samples[:9]]
    prompts = [target.tokenizer.decode(s.ids[: s.prompt_len]) for s in samples[9:]]
    quoted = [p for p in prompts if any(a and a[:20] in p for a in answers)]
    assert len(quoted) >= 6  # every passage prompt quotes a first-stage answer (a short one may be cut)
    again, seconds_again = feature_data.build(target, tmp_path, plan, minutes=5)
    assert [s.ids for s in again] == [s.ids for s in samples] and seconds_again == seconds
    assert (tmp_path / plan.key()).name.endswith("-p0.5")  # never mixed with a one-stage cache


def test_device_batches_equal_the_padded_ones():
    """DeviceSamples (the GPU's batches, gathered where the data lives) builds what make_batch
    pads on the CPU: every field, padding included, for ragged samples and a reduced vocabulary."""
    from dataclasses import fields

    gen = torch.Generator().manual_seed(9)
    samples = []
    for n, prompt in ((9, 3), (14, 6), (5, 1), (11, 4)):
        ids = torch.randint(0, 40, (n,), generator=gen).tolist()
        top_ids = torch.randint(0, 40, (n - prompt, 4), generator=gen).int()
        samples.append(teacher.Sample(ids, prompt, top_ids, torch.randn(n - prompt, 4, generator=gen).half(),
                                      torch.randn(n - 1, 6, generator=gen).half()))
    t2d = torch.full((40,), -1, dtype=torch.long)
    t2d[::2] = torch.arange(20)  # even ids kept
    data = head_trainer.DeviceSamples(samples, t2d, "cpu")
    for idx in ([0, 1, 2, 3], [2], [3, 1]):
        want, got = head_trainer.make_batch([samples[i] for i in idx], t2d), data.batch(idx)
        for f in fields(want):
            assert torch.equal(getattr(got, f.name), getattr(want, f.name)), f.name


def test_passage_prompts_quote_the_first_stage_and_name_its_language():
    """The second stage's prompts carry a first-stage answer; a translation names the language
    the answer was asked in; the same seed gives the same prompts."""
    from services.draft.training.prompts import make_foreign_prompts, make_passage_prompts

    foreign = [(f"texte numéro {i}", lang) for i, (_, lang) in enumerate(make_foreign_prompts(4, seed=2))]
    passages = ["The first passage is about tides.", "The second passage is about bees."]
    prompts = make_passage_prompts(passages, foreign, 200, seed=5)
    assert prompts == make_passage_prompts(passages, foreign, 200, seed=5)
    translations = [p for p in prompts if p.startswith("Translate ")]
    assert translations and len(translations) < len(prompts)
    for p in translations:
        text = p.split(": ", 1)[1]
        assert p == f"Translate {dict(foreign)[text]} to English: {text}"
    assert all(any(x in p for x in passages) for p in prompts if p not in translations)


def test_the_held_out_answers_and_the_training_share_come_from_every_stage():
    """The cache holds its stages in turn (foreign-language prompts, templates, passages): the
    held-out answers and an ablation's first quarter are drawn across all of it."""
    samples = [("foreign", i) for i in range(20)] + [("template", i) for i in range(60)] + \
              [("passage", i) for i in range(20)]
    held_out, rest = feature_data.split(samples, 30, seed=4)
    assert sorted(held_out + rest) == sorted(samples)
    assert {kind for kind, _ in held_out} == {"foreign", "template", "passage"}
    assert {kind for kind, _ in rest[: len(rest) // 4]} == {"foreign", "template", "passage"}
    assert feature_data.split(samples, 30, seed=4) == (held_out, rest)  # a resumed run trains on the same


def test_word_topics_take_subjects_from_the_vocabulary():
    """topic_words: the tokenizer's whole lowercase words (the default target's, thousands); with
    them as topics about half the topic prompts (word_share 0.5) name no subject of TOPICS, the
    same seed gives the same prompts, and a plan with word topics caches apart."""
    from services.draft.training.prompts import TOPICS, make_prompts, topic_words

    words = topic_words(load_model("default", weights=False).tokenizer)
    assert len(words) > 5000 and words == sorted(words)
    assert all(w.isascii() and w.isalpha() and w.islower() and len(w) >= 6 for w in words)

    def known(prompts):
        return sum(any(t in p for t in TOPICS) for p in prompts)

    plain, mixed = make_prompts(400, seed=3), make_prompts(400, 3, words, 0.5)
    assert mixed == make_prompts(400, 3, words, 0.5)
    assert 0.3 * known(plain) < known(mixed) < 0.7 * known(plain)
    plan = feature_data.TeacherPlan((0,), 8, 100, 8, 0.0, 8, 0, word_topics=0.5)
    assert plan.key().endswith("-w0.5") and not replace(plan, word_topics=0.0).key().endswith("-w0.0")


def test_news_prompts_name_made_up_people_and_long_documents_join_three_passages():
    """--news: its prompts are distinct and the same for a seed, and their names are ones the
    tokenizer splits (no vocabulary holds them: a draft must copy them); a plan holds that share
    of its templated prompts as news and caches apart, and without it the prompts are the ones an
    older cache was answered on. Passage prompts with long_share join three passages."""
    import random

    from services.draft.training.prompts import NAMES, made_up_name, make_news_prompts, make_passage_prompts

    news = make_news_prompts(60, seed=2)
    assert news == make_news_prompts(60, seed=2) and len(set(news)) == 60 and news != make_news_prompts(60, seed=3)
    tok = load_model("default", weights=False).tokenizer
    names = [made_up_name(random.Random(i)) for i in range(200)]
    assert not set(names) & set(NAMES)
    assert sum(len(tok(" " + n, add_special_tokens=False)["input_ids"]) for n in names) / len(names) >= 2

    plan = feature_data.TeacherPlan((0,), prompts=40, tokens=100, max_tokens=8, sampled_fraction=0.0, batch=8, seed=0,
                                    news=0.5)
    first, _, _ = plan.stage_one(tok)
    assert sum(p in set(make_news_prompts(20, 0)) for p in first) == 20 and plan.key().endswith("-n0.5")
    older = replace(plan, news=0.0)
    assert "-n" not in older.key() and older.stage_one(tok)[0] == feature_data.make_prompts(40, 0)

    passages = [f"Passage number {i} tells its own story." for i in range(30)]
    long = [p for p in make_passage_prompts(passages, [], 60, seed=1, long_share=0.5) if p.count("Passage number") == 3]
    assert 15 <= len(long) <= 45
    assert make_passage_prompts(passages, [], 60, seed=1, long_share=0.0) == make_passage_prompts(passages, [], 60, 1)


def test_the_engine_teacher_answers_a_one_stage_plan(tiny_target, tmp_path):
    """Without --passage-fraction (`make head`'s default) the engine's teacher answers the template
    prompts up to its token cap (it once took the missing second stage for a begun one and
    answered nothing)."""
    target = load_model(str(tiny_target))
    plan = feature_data.TeacherPlan((0,), prompts=6, tokens=10**6, max_tokens=4, sampled_fraction=0.0, batch=8, seed=0)
    samples, seconds = feature_data.build(target, tmp_path, plan, minutes=5)
    assert len(samples) == 6 and seconds > 0


def test_self_written_prompts_keep_only_ended_distinct_turns():
    """self_prompts.write samples the target from the start of a user turn: a turn cut at the cap,
    one of fewer than three words and a repeat are dropped, and it asks again until it has n."""
    from services.draft.training import self_prompts

    tok = load_model("default", weights=False).tokenizer
    prefix, end = self_prompts.user_turn(tok)
    assert tok.decode(prefix).endswith("<|im_start|>user\n") and tok.convert_ids_to_tokens(end) == "<|im_end|>"
    words = [tok(w, add_special_tokens=False)["input_ids"] for w in ("Name three rivers", "Hi there", "Plan a trip")]
    script = [[words[0] + [end], words[1] + [end], words[0] + [end], words[2]],  # ok, short, repeat, cut
              [words[2] + [end]] * 6]
    calls = []

    def answer(prompts, temperatures, eos_ids, max_tokens, seed):
        calls.append((len(prompts), temperatures[0], eos_ids, seed))
        return [teacher.Sample(prefix + ids, len(prefix), None, None) for ids in script[len(calls) - 1]]

    assert self_prompts.write(answer, tok, 2, seed=5) == ["Name three rivers", "Plan a trip"]
    assert [c[1:3] for c in calls] == [(1.0, (end,))] * 2 and calls[0][3] != calls[1][3]


def test_the_target_writes_prompts_that_the_teacher_then_answers(tmp_path):
    """--self-prompts on the default target: the prompts it writes are cached with the plan,
    shuffled in among the templated ones, and answered by the engine's teacher (a rerun reads the
    same prompts and answers back) and by the GPU's."""
    target = load_model("default")
    plan = feature_data.TeacherPlan((2,), prompts=6, tokens=10**6, max_tokens=4, sampled_fraction=0.0, batch=8,
                                    seed=1, self_prompts=0.5)
    samples, seconds = feature_data.build(target, tmp_path, plan, minutes=5)
    written, _ = feature_data.written_prompts(tmp_path, plan, target.tokenizer, None)  # cached: never asks
    assert len(written) == 3 and len(set(written)) == 3 and plan.key().endswith("-m0.5")
    first, _, _ = plan.stage_one(target.tokenizer, written)
    assert sorted(first) == sorted(written + feature_data.make_prompts(3, 1)) and first[:3] != written
    asked = [target.tokenizer.decode(s.ids[: s.prompt_len]) for s in samples]
    assert len(samples) == 6 and all(any(w in a for a in asked) for w in written)
    again, seconds_again = feature_data.build(target, tmp_path, plan, minutes=5)
    assert [s.ids for s in again] == [s.ids for s in samples] and seconds_again == seconds
    # the GPU's teacher (transformers' generate, here on the CPU) writes and answers them too
    samples = feature_data.build_hf(target, tmp_path / "hf", plan, "cpu")[0]
    written, _ = feature_data.written_prompts(tmp_path / "hf", plan, target.tokenizer, None)
    asked = [target.tokenizer.decode(s.ids[: s.prompt_len]) for s in samples]
    assert len(written) == 3 and len(samples) == 6 and all(any(w in a for a in asked) for w in written)


def test_the_schedule_is_refitted_to_the_budget_as_steps_slow_down():
    plan = head_trainer.TrainPlan(steps=4000, unroll=3, lr=1e-3, batch_tokens=64, seed=0, minutes=10)
    run = {"step": 3, "total": 4000, "seconds": 0.0}
    head_trainer._fit_schedule(run, plan, 6.0)  # 2 s a step: 300 steps fit 600 s
    assert run["total"] == 300
    run["step"] = 100
    head_trainer._fit_schedule(run, plan, 300.0)  # 3 s a step so far: 100 more fit the 300 s left
    assert run["total"] == 200
    run["step"] = 199
    head_trainer._fit_schedule(run, plan, 700.0)  # over budget: the schedule ends with the next step
    assert run["total"] == 200
    run["step"] = 3
    head_trainer._fit_schedule(run, replace(plan, steps=50), 3.0)  # never past the steps asked for
    assert run["total"] == 50
