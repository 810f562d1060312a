"""Teacher data for the feature-level head, cached in shards so an interrupted run resumes.

The target answers generated prompts (templates from services/draft/training/prompts.py, or
prompts it wrote itself: self_prompts.py; never Spec-Bench) with continuous batching, recording
at every position it was fed the residual stream of the head's layers, and at every answer
position its top-k next-token log-probabilities. Each shard holds 64 finished answers with their
prompt indices; a rerun skips the prompts already answered.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.prompt import encode_prompt
from services.draft.training import hf_teacher, self_prompts, teacher
from services.draft.training.prompts import (make_foreign_prompts, make_news_prompts, make_passage_prompts, make_prompts,
                                             topic_words)

log = logging.getLogger(__name__)
SHARD = 64  # answers per shard file


@dataclass
class TeacherPlan:
    layers: tuple[int, ...]
    prompts: int  # prompts generated (at most this many answered)
    tokens: int  # stop starting prompts once this many answer tokens are cached
    max_tokens: int
    sampled_fraction: float  # answers sampled at T=0.8 / top-p 0.95; the rest greedy
    batch: int
    seed: int
    passage_fraction: float = 0.0  # prompts (and answer tokens) of the second stage: tasks over a passage
    word_topics: float = 0.0  # template prompts whose topics are words of the target's vocabulary
    self_prompts: float = 0.0  # share of the first stage's prompts the target writes (self_prompts.py)
    # share of the templated prompts that are news (made-up names); the same share of the passage
    # prompts are long documents of three passages
    news: float = 0.0

    def key(self) -> str:
        layers = "-".join(map(str, self.layers))
        passages = f"-p{self.passage_fraction}" if self.passage_fraction else ""
        words = f"-w{self.word_topics}" if self.word_topics else ""
        written = f"-m{self.self_prompts}" if self.self_prompts else ""
        news = f"-n{self.news}" if self.news else ""
        return f"L{layers}-t{self.max_tokens}-s{self.seed}-f{self.sampled_fraction}{passages}{words}{written}{news}"

    def passage_count(self) -> int:
        """How many prompts the second stage asks (tasks over the first stage's answers)."""
        return round(self.passage_fraction * self.prompts)

    def written_count(self) -> int:
        """How many of the first stage's prompts the target writes."""
        return round(self.self_prompts * (self.prompts - self.passage_count()))

    def stage_one(self, tokenizer, written: list[str] = ()) -> tuple[list[str], list[tuple[str, str]], int]:
        """(the first stage's prompts, the foreign-language ones among them with their language,
        how many second-stage prompts follow). The foreign prompts come first: the first stage
        may stop at its share of tokens, and the second stage translates their answers. The
        prompts the target wrote (`written`) and the news prompts are shuffled in among the templated
        ones, so a stage cut short by its token share holds every kind."""
        second = self.passage_count()
        foreign = make_foreign_prompts(second // 8, seed=self.seed) if second else []
        words = topic_words(tokenizer) if self.word_topics else []
        templated = self.prompts - second - len(written)
        news = make_news_prompts(round(self.news * templated), self.seed)
        mixed = list(written) + news + make_prompts(templated - len(news), self.seed, words, self.word_topics)
        if written or news:
            random.Random(self.seed + 3).shuffle(mixed)
        return [p for p, _ in foreign] + mixed, foreign, second


def written_prompts(work: Path, plan: TeacherPlan, tokenizer, answer) -> tuple[list[str], float]:
    """The prompts the target writes for this plan (self_prompts.write with `answer`, a
    teacher's generate) and the seconds that took, cached in the plan's folder: its answers are
    numbered by prompt, so a resumed run must see the same prompts."""
    count = plan.written_count()
    if not count:
        return [], 0.0
    path = work / plan.key() / "self-prompts.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return cached["prompts"], cached["seconds"]
    started = time.monotonic()
    prompts = self_prompts.write(answer, tokenizer, count, plan.seed)
    seconds = time.monotonic() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps({"prompts": prompts, "seconds": seconds}, indent=0))
    path.with_suffix(".tmp").rename(path)
    log.info("the target wrote %d prompts in %.0f s", len(prompts), seconds)
    return prompts, seconds


def passage_prompts(target, plan: TeacherPlan, answers: list[teacher.Sample | None], foreign: list[tuple[str, str]],
                    second: int) -> list[str]:
    """The second stage's prompts over the first stage's answers (answers[i]: prompt i's, None if
    unanswered; the foreign ones first): summaries, questions over documents, extraction and
    translation back to English."""
    def text(s):
        return target.tokenizer.decode(s.ids[s.prompt_len :], skip_special_tokens=True).strip()

    long_enough = min(48, plan.max_tokens // 2)
    foreign_text = [(text(s), lang) for s, (_, lang) in zip(answers, foreign) if s is not None]
    passages = [text(s) for s in answers[len(foreign) :]
                if s is not None and len(s.ids) - s.prompt_len >= long_enough]
    if len(passages) < 2:
        raise ValueError(f"only {len(passages)} first-stage answers of {long_enough}+ tokens to build passages from")
    return make_passage_prompts(passages, foreign_text, second, plan.seed, long_share=plan.news)


def load_shards(work: Path, plan: TeacherPlan) -> tuple[dict[int, teacher.Sample], float]:
    """The cached answers by prompt index, and the teacher seconds they took."""
    done, seconds = {}, 0.0
    for path in sorted((work / plan.key()).glob("shard-*.pt")):
        shard = torch.load(path, weights_only=False)
        done.update(shard["samples"])
        seconds += shard["seconds"]
    return done, seconds


def answer_tokens(samples) -> int:
    return sum(len(s.ids) - s.prompt_len for s in samples)


def split(samples: list, held_out: int, seed: int) -> tuple[list, list]:
    """(held-out answers, the rest), both drawn across the whole cache in a seeded order: the
    cache holds its stages in turn (foreign-language prompts, templates, passages), so a slice
    from its front would hold out one kind of answer, and a data-size ablation's first quarter
    would miss the passages."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    return [samples[i] for i in order[:held_out]], [samples[i] for i in order[held_out:]]


def build(target, work: Path, plan: TeacherPlan, minutes: float) -> tuple[list[teacher.Sample], float]:
    """Extend the cache (at most `minutes` of generation) and return every cached answer, in
    prompt order, with the total teacher seconds. With plan.passage_fraction, two stages as
    build_hf's: the first answers the template prompts up to its share of plan.tokens; once it
    has (its answers never change after), the second answers the passage prompts built from them,
    numbered after the first stage's, up to plan.tokens in all."""
    done, seconds = load_shards(work, plan)
    have = answer_tokens(done.values())
    log.info("teacher cache %s: %d answers, %d answer tokens", work / plan.key(), len(done), have)

    def answer(prompts, temperatures, eos_ids, max_tokens, seed):
        return teacher.generate(target.model, prompts, temperatures, eos_ids, max_tokens, batch=plan.batch, seed=seed)

    written, seconds_written = written_prompts(work, plan, target.tokenizer, answer)
    seconds += seconds_written
    first, foreign, second = plan.stage_one(target.tokenizer, written)
    share = round(plan.tokens * (1 - plan.passage_fraction)) if second else plan.tokens
    deadline = time.monotonic() + 60 * minutes
    started = bool(second) and any(i >= len(first) for i in done)  # the second stage has begun
    if not started and have < share and minutes > 0:
        seconds += _extend(target, work, plan, first, 0, done, share, deadline)
    one = [done.get(i) for i in range(len(first))]
    answered = [s for s in one if s is not None]
    if second and (started or answer_tokens(answered) >= share or len(answered) == len(first)) \
            and time.monotonic() < deadline:
        prompts = passage_prompts(target, plan, one, foreign, second)
        seconds += _extend(target, work, plan, prompts, len(first), done, plan.tokens, deadline)
    return [done[i] for i in sorted(done)], seconds


def _extend(target, work: Path, plan: TeacherPlan, prompts: list[str], offset: int, done: dict, cap: int,
            deadline: float) -> float:
    """Answer prompts[j] as prompt index offset + j (those not cached) until the cache holds
    `cap` answer tokens or the deadline."""
    rng = random.Random(plan.seed + offset)
    temps = [0.8 if rng.random() < plan.sampled_fraction else 0.0 for _ in prompts]
    todo = [offset + j for j in range(len(prompts)) if offset + j not in done]
    encoded = [encode_prompt(target.tokenizer, prompts[i - offset], chat=True) for i in todo]
    folder = work / plan.key()
    folder.mkdir(parents=True, exist_ok=True)
    pending: dict[int, teacher.Sample] = {}
    tokens = [answer_tokens(done.values())]
    clock = [time.monotonic()]
    total = [0.0]

    def flush():
        if pending:
            now = time.monotonic()
            shard = {"samples": dict(pending), "seconds": now - clock[0]}
            name = folder / f"shard-{min(pending):05d}-{time.time_ns()}.pt"
            torch.save(shard, name.with_suffix(".tmp"))
            name.with_suffix(".tmp").rename(name)  # a killed run never leaves half a shard
            total[0] += now - clock[0]
            clock[0] = now
            pending.clear()

    def on_sample(j: int, sample: teacher.Sample):
        pending[todo[j]] = sample
        done[todo[j]] = sample
        tokens[0] += len(sample.ids) - sample.prompt_len
        if len(pending) >= SHARD:
            flush()
            log.info("teacher: %d answers, %d answer tokens cached", len(done), tokens[0])

    if not todo or tokens[0] >= cap:
        return 0.0
    teacher.generate(target.model, encoded, [temps[i - offset] for i in todo], target.config.eos_token_ids,
                     plan.max_tokens, batch=plan.batch, seed=plan.seed + 7919 + offset,
                     deadline=deadline, state_layers=plan.layers, on_sample=on_sample, enough=lambda: tokens[0] >= cap)
    flush()
    return total[0]


def build_hf(target, work: Path, plan: TeacherPlan, device: str) -> tuple[list[teacher.Sample], float]:
    """Teacher data on a CUDA machine (hf_teacher), in two stages: the template prompts (and some
    asking for text in another language), then plan.passage_fraction of plan.prompts over their
    answers (passage_prompts). Every prompt is answered (no token cap); the whole set is cached
    in one file under `work` (a GPU makes it in minutes, so no shards). Returns the samples,
    stage one first, and the seconds they took."""
    path = work / f"hf-{plan.key()}-n{plan.prompts}-b{plan.batch}.pt"
    if path.exists():
        cached = torch.load(path, weights_only=False)
        log.info("teacher cache %s: %d answers", path, len(cached["samples"]))
        return cached["samples"], cached["seconds"]
    started = time.monotonic()
    model = hf_teacher.load(target.path, device)

    def answer(prompts, temperatures, eos_ids, max_tokens, seed):
        return hf_teacher.generate(model, prompts, temperatures, eos_ids, max_tokens, batch=plan.batch, seed=seed,
                                   pad_id=target.config.eos_token_ids[0])

    written, _ = written_prompts(work, plan, target.tokenizer, answer)
    first, foreign, second = plan.stage_one(target.tokenizer, written)
    samples = _answer_hf(model, target, first, plan)
    if second:
        samples += _answer_hf(model, target, passage_prompts(target, plan, samples, foreign, second), plan)
    seconds = time.monotonic() - started
    work.mkdir(parents=True, exist_ok=True)
    torch.save({"samples": samples, "seconds": seconds}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return samples, seconds


def _answer_hf(model, target, prompts: list[str], plan: TeacherPlan) -> list[teacher.Sample]:
    rng = random.Random(plan.seed + len(prompts))
    temps = [0.8 if rng.random() < plan.sampled_fraction else 0.0 for _ in prompts]
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    eos = target.config.eos_token_ids
    return hf_teacher.generate(model, encoded, temps, eos, plan.max_tokens, batch=plan.batch, seed=plan.seed,
                               state_layers=plan.layers, pad_id=eos[0])
