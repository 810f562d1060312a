"""Build the feature-level draft head (EAGLE-3 style) for a target, from the target alone.

    .venv/bin/python scripts/train_head.py --out models/head            (what `make head` runs)
    .venv/bin/python scripts/train_head.py --out /tmp/h --tokens 4000 --steps 20   (a quick check)

1. Teacher data (services/draft/training/feature_data.py): the target answers generated prompts,
   batched, recording three layers' hidden states and its top-k next-token probabilities;
   cached in shards under --work, so an interrupted run resumes where it stopped.
2. Training (services/draft/training/head_trainer.py): the head learns the target's next-token
   distribution from those states, unrolled on its own output states (training-time test).
3. The head is written as a checkpoint directory (safetensors, config, card) that `--draft PATH`
   loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.loading import load_model, load_weights  # noqa: E402
from services.common.machine import cpu_model  # noqa: E402
from services.common.prompt import encode_prompt  # noqa: E402
from services.common.vocab import vocabulary_digest  # noqa: E402
from services.draft.feature_head import FeatureHead, HeadConfig, init_from_head, init_from_target  # noqa: E402
from services.draft.slim import kept_ids  # noqa: E402
from services.draft.training import feature_data, head_trainer, hf_teacher, teacher  # noqa: E402

log = logging.getLogger("train_head")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target checkpoint (a Llama-family model)")
    p.add_argument("--out", default="models/head", help="checkpoint directory to write")
    p.add_argument("--work", default=".head-work", help="cache directory (teacher shards, training state)")
    p.add_argument("--layers", default="2,15,27", help="target layers whose states the head reads")
    p.add_argument("--tokens", type=int, default=300_000, help="answer tokens of teacher data")
    p.add_argument("--prompts", type=int, default=3000, help="prompts generated (answered until --tokens)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap")
    p.add_argument("--sampled-fraction", type=float, default=0.3, help="answers sampled at T=0.8")
    p.add_argument("--teacher-batch", type=int, default=32, help="sequences per teacher step")
    p.add_argument("--teacher-minutes", type=float, default=90.0, help="teacher budget of this run")
    p.add_argument("--teacher-only", action="store_true", help="build the teacher cache and stop")
    p.add_argument("--compression-ratio", type=float, default=0.2,
                   help="SlimSpec: the fraction of the vocabulary the head scores (most generated ids)")
    p.add_argument("--unroll", type=int, default=4, help="training-time test steps (draft depths trained)")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded positions per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train-minutes", type=float, default=60.0, help="training budget of this run")
    p.add_argument("--data-fraction", type=float, default=1.0,
                   help="train on this fraction of the answers (the data-size ablation)")
    p.add_argument("--init", default="", help="continue from this trained head (same target and layers)")
    p.add_argument("--held-out", type=int, default=30,
                   help="answers held out for the card's metrics, drawn across the whole cache (seeded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the teacher runs and the head trains")
    p.add_argument("--teacher", default="", choices=("", "engine", "hf"),
                   help="engine: this engine's batched decoding, cached and resumable (the default on cpu); "
                        "hf: transformers' generate, two stages, cached whole (the default on cuda)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="training matmuls (auto: bf16 on a GPU, the faster of the two, timed, on a CPU)")
    p.add_argument("--passage-fraction", type=float, default=0.0,
                   help="this fraction of --prompts (and of --tokens, for the engine's teacher) are tasks over the "
                        "first stage's answers: summaries, questions over documents, translation")
    p.add_argument("--word-topics", type=float, default=0.0,
                   help="this share of the template prompts take their topics from the target's vocabulary's "
                        "words instead of the templates' few dozen subjects")
    p.add_argument("--self-prompts", type=float, default=0.0,
                   help="this share of the first stage's prompts are written by the target itself (sampled from "
                        "its chat template's user turn) instead of the templates")
    p.add_argument("--news", type=float, default=0.0,
                   help="this share of the template prompts are news about made-up people and places (names to "
                        "copy), and this share of the passage prompts are long documents of three passages")
    p.add_argument("--ablation", default="", help="also train on these data fractions (e.g. 0.25,0.5): metrics only")
    p.add_argument("--eval-questions", default="",
                   help="Spec-Bench JSONL: held-out metrics on its first question per category too (never trained on)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    args.teacher = args.teacher or ("hf" if args.device == "cuda" else "engine")
    # the engine's weights: for its teacher, or for the dev answers of a CPU run
    engine = args.teacher == "engine" or (args.device == "cpu" and bool(args.eval_questions))
    target = load_model(args.target, weights=engine)
    plan = feature_data.TeacherPlan(tuple(int(x) for x in args.layers.split(",")), args.prompts, args.tokens,
                                    args.max_tokens, args.sampled_fraction, args.teacher_batch, args.seed,
                                    args.passage_fraction, args.word_topics, args.self_prompts, args.news)
    if args.teacher == "hf":
        samples, seconds = feature_data.build_hf(target, Path(args.work), plan, args.device)
    else:
        samples, seconds = feature_data.build(target, Path(args.work), plan, args.teacher_minutes)
    log.info("teacher data: %d answers, %d answer tokens, %.0f s of teacher time (%.1f min in all)",
             len(samples), feature_data.answer_tokens(samples), seconds, (time.monotonic() - started) / 60)
    if args.teacher_only:
        return 0
    info = train_head(args, target, samples)
    info.update(teacher_seconds=seconds, total_seconds=time.monotonic() - started, machine=machine(),
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), threads=args.threads)
    write_card(Path(args.out), info)
    log.info("wrote %s in %.1f min", args.out, info["total_seconds"] / 60)
    return 0


def train_head(args, target, samples) -> dict:
    """Vocabulary, split, training (resumable), held-out metrics; writes the checkpoint."""
    weights = load_weights(target.path)
    counts = np.zeros(target.config.vocab_size, dtype=np.int64)
    for s in samples:
        np.add.at(counts, np.asarray(s.ids[s.prompt_len :]), 1)
    trained = FeatureHead.load(Path(args.init)) if args.init else None
    # a continued run keeps its vocabulary: fresh rows beside trained ones would win argmaxes untrained
    kept = trained.d2t.clone() if trained is not None else kept_ids(
        counts, args.compression_ratio, target.config.vocab_size, target.config.eos_token_ids)
    t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d[kept] = torch.arange(len(kept))
    held_out, rest = feature_data.split(samples, args.held_out, args.seed)
    layers = tuple(int(x) for x in args.layers.split(","))
    config = HeadConfig.for_target(target.config, layers, len(kept), args.target, vocabulary_digest(target.tokenizer))
    embed = weights["model.embed_tokens.weight"].float().to(args.device)
    plan = head_trainer.TrainPlan(args.steps, args.unroll, args.lr, args.batch_tokens, args.seed,
                                  minutes=args.train_minutes, device=args.device,
                                  precision=args.precision)
    dev = dev_samples(args, target, layers) if args.eval_questions else []

    def fresh() -> FeatureHead:
        head = FeatureHead(config)
        init_from_target(head, weights, target.config.num_layers, kept)
        if trained is not None:
            init_from_head(head, trained)
        return head.to(args.device)

    def run(fraction: float) -> tuple[FeatureHead, list, dict]:
        train_set = rest[: max(1, round(fraction * len(rest)))]
        key = f"{len(train_set)}-{args.compression_ratio}-{args.unroll}-{args.steps}-{args.lr}-{args.seed}"
        key += "-from-" + Path(args.init).name if args.init else ""
        head = fresh()
        result = head_trainer.train(head, embed, train_set, t2d, plan, Path(args.work) / f"train-{key}.pt")
        metrics = {"fraction": fraction, "answers": len(train_set), "steps": result["steps"],
                   "answer_tokens": feature_data.answer_tokens(train_set),
                   "held_out": head_trainer.evaluate(head, embed, held_out, t2d, plan),
                   "dev": head_trainer.evaluate(head, embed, dev, t2d, plan) if dev else []}
        log.info("trained on %.2f of the data: %s", fraction, metrics)
        return head, train_set, {**metrics, "seconds": result["seconds"], "history": result["history"],
                                 "precision": result["precision"]}

    Path(args.work).mkdir(parents=True, exist_ok=True)
    before = head_trainer.evaluate(fresh(), embed, held_out, t2d, plan)
    head, train_set, result = run(args.data_fraction)
    head.save(Path(args.out))  # before the ablation, which only adds metrics
    plan = replace(plan, steps=result["steps"], minutes=1e9)  # the ablation: the same steps and schedule
    ablation = [run(float(f))[2] for f in args.ablation.split(",") if f]
    for a in ablation:
        a.pop("history")
    coverage = float(counts[kept.numpy()].sum() / max(1, counts.sum()))
    return {"layers": list(layers), "draft_vocab": len(kept), "compression_ratio": args.compression_ratio,
            "coverage": coverage, "answers": len(samples), "train_answers": len(train_set),
            "answer_tokens": result["answer_tokens"], "held_out_answers": len(held_out),
            "init": args.init, "unroll": args.unroll, "steps": result["steps"], "lr": args.lr,
            "batch_tokens": args.batch_tokens, "train_seconds": result["seconds"], "before": before,
            "after": result["held_out"], "dev": result["dev"], "ablation": ablation, "history": result["history"],
            "device": args.device, "precision": result["precision"], "passage_fraction": args.passage_fraction,
            "sampled_fraction": args.sampled_fraction, "word_topics": args.word_topics,
            "self_prompts": args.self_prompts, "news": args.news,
            "bytes": sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())}


def dev_samples(args, target, layers) -> list:
    """The target's greedy answers (128 tokens) to the first question of each category of
    --eval-questions, with their states: metrics only, never trained on."""
    questions, seen = [], set()
    for line in Path(args.eval_questions).read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            questions.append(q["turns"][0])
    encoded = [encode_prompt(target.tokenizer, q, chat=True) for q in questions]
    eos = target.config.eos_token_ids
    if target.model is None:
        model = hf_teacher.load(target.path, args.device)
        return hf_teacher.generate(model, encoded, [0.0] * len(encoded), eos, 128, state_layers=layers, pad_id=eos[0])
    return teacher.generate(target.model, encoded, [0.0] * len(encoded), eos, 128, state_layers=layers)


def write_card(out: Path, info: dict) -> None:
    rows = "\n".join(f"| {d + 1} | {b['top1']:.3f} | {a['top1']:.3f} | {a['accept']:.3f} | {a['loss']:.3f} |"
                     for d, (b, a) in enumerate(zip(info["before"], info["after"])))
    pf, sampled = info.get("passage_fraction", 0.0), 100 * info.get("sampled_fraction", 0.3)
    passages = (f",\n  about {100 * pf:.0f}% of the answer tokens over passages of earlier answers (summaries,"
                " questions over a\n  document, translations)" if pf else "")
    wt = info.get("word_topics", 0.0)
    passages += (f",\n  {100 * wt:.0f}% of the template prompts on two words of the target's vocabulary as topics"
                 if wt else "")
    news = info.get("news", 0.0)
    passages += (f",\n  {100 * news:.0f}% of the template prompts news about made-up people and places, and as many of"
                 " the\n  passage prompts long documents of three passages" if news else "")
    sp = info.get("self_prompts", 0.0)
    source = "prompts from the task templates in services/draft/training/prompts.py (never Spec-Bench)"
    if sp:
        share = "" if sp >= 1 else f" ({100 * sp:.0f}% of the first stage's; the rest from the task templates)"
        source = ("prompts the target wrote itself" + share + ",\n  its chat template sampled from the start of a"
                  " user turn (services/draft/training/self_prompts.py; never Spec-Bench)")
    text = f"""# Feature-level draft head for {info.get('target', 'the default target')}

An EAGLE-3-style head (services/draft/feature_head.py): the target's states after layers
{info['layers']}, fused, plus the next token's embedding, into one decoder layer; an LM head over
{info['draft_vocab']} ids (SlimSpec ratio {info['compression_ratio']}: the ids the target generated most,
{100 * info['coverage']:.1f}% of its answer tokens). Load it with `--draft {out}`.

## How it was made (`make head`, scripts/train_head.py)

- Data: {info['answers']} answers the target generated (greedy, {sampled:.0f}% sampled at T=0.8 / top-p 0.95) to
  {source}{passages},
  batched {info.get('teacher_batch', 32)} wide, recording three layers' states and the top-32 next-token
  probabilities; {info['train_answers']} answers ({info['answer_tokens']} answer tokens) trained on,
  {info['held_out_answers']} held out. Teacher time: {info['teacher_seconds']:.0f} s.
- Objective: cross-entropy to the target's top-32 distribution (over the head's ids), with
  training-time test: {info['unroll']} unrolled steps, step s reading the head's own output states
  (loss weight 0.8^s). AdamW, lr {info['lr']}, warmup + cosine, {info['steps']} steps of about
  {info['batch_tokens']} padded positions, matmuls in {info.get('precision', 'fp32')}. Training time:
  {info['train_seconds']:.0f} s.
- Held out, per draft depth (top-1: the head's argmax is the target's; accept: sum min(p, q) over
  the target's top-32 at T = 1, both with the true tokens before it):

| depth | top-1 before | top-1 after | accept (T=1) | loss |
|---|---|---|---|---|
{rows}

- Size: {info['bytes'] / 1e6:.1f} MB (bfloat16). Machine: {info['machine']}; {info['threads']} torch threads;
  built {info['date']}; {info['total_seconds'] / 60:.1f} min in all.
"""
    (out / "card.md").write_text(text + card_extras(info))
    (out / "train-info.json").write_text(json.dumps(info, indent=1))


def card_extras(info: dict) -> str:
    """The card's dev metrics and data-size ablation, when the run made them."""
    text = ""
    if info.get("dev"):
        text += ("\n- On the first Spec-Bench dev question of each category (greedy answers, 128 tokens; "
                 "never trained on), top-1 / accept per depth: ")
        text += ", ".join(f"{m['top1']:.3f} / {m['accept']:.3f}" for m in info["dev"]) + ".\n"
    if info.get("ablation"):
        text += "\n## Data size (same steps and schedule; held-out and dev top-1 at depths 1 and 4)\n\n"
        text += "| data | answers | answer tokens | held-out d1 | held-out d4 | dev d1 | dev d4 |\n"
        text += "|---|---|---|---|---|---|---|\n"
        everything = {"fraction": 1.0, "answers": info["train_answers"], "answer_tokens": info["answer_tokens"],
                      "held_out": info["after"], "dev": info.get("dev", [])}
        for a in info["ablation"] + [everything]:
            dev = f"{a['dev'][0]['top1']:.3f} | {a['dev'][-1]['top1']:.3f}" if a["dev"] else "- | -"
            text += (f"| {a['fraction']:g} | {a['answers']} | {a['answer_tokens']} | "
                     f"{a['held_out'][0]['top1']:.3f} | {a['held_out'][-1]['top1']:.3f} | {dev} |\n")
    return text


def machine() -> str:
    return f"{platform.machine()} {cpu_model()}".strip()


if __name__ == "__main__":
    raise SystemExit(main())
