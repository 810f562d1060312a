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
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.loading import load_model, load_weights  # noqa: E402
from services.common.machine import cpu_model  # noqa: E402
from services.common.vocab import vocabulary_digest  # noqa: E402
from services.draft.feature_head import FeatureHead, HeadConfig, init_from_head, init_from_target  # noqa: E402
from services.draft.slim import kept_ids  # noqa: E402
from services.draft.training import feature_data, head_trainer  # noqa: E402

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
                   help="answers held out for the card's metrics (the first ones, whatever the cache holds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    target = load_model(args.target)
    plan = feature_data.TeacherPlan(tuple(int(x) for x in args.layers.split(",")), args.prompts, args.tokens,
                                    args.max_tokens, args.sampled_fraction, args.teacher_batch, args.seed)
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
    held_out, train_set = samples[: args.held_out], samples[args.held_out :]
    train_set = train_set[: max(1, round(args.data_fraction * len(train_set)))]
    layers = tuple(int(x) for x in args.layers.split(","))
    config = HeadConfig.for_target(target.config, layers, len(kept), args.target, vocabulary_digest(target.tokenizer))
    head = FeatureHead(config)
    init_from_target(head, weights, target.config.num_layers, kept)
    if trained is not None:
        init_from_head(head, trained)
    embed = weights["model.embed_tokens.weight"].float()
    plan = head_trainer.TrainPlan(args.steps, args.unroll, args.lr, args.batch_tokens, args.seed,
                                  minutes=args.train_minutes)
    before = head_trainer.evaluate(head, embed, held_out, t2d, plan)
    log.info("held out before training: %s", before)
    key = f"{len(train_set)}-{args.compression_ratio}-{args.unroll}-{args.steps}-{args.lr}-{args.seed}"
    key += "-from-" + Path(args.init).name if args.init else ""
    result = head_trainer.train(head, embed, train_set, t2d, plan, Path(args.work) / f"train-{key}.pt")
    after = head_trainer.evaluate(head, embed, held_out, t2d, plan)
    log.info("held out after training: %s", after)
    head.save(Path(args.out))
    coverage = float(counts[kept.numpy()].sum() / max(1, counts.sum()))
    return {"layers": list(layers), "draft_vocab": len(kept), "compression_ratio": args.compression_ratio,
            "coverage": coverage, "answers": len(samples), "train_answers": len(train_set),
            "answer_tokens": feature_data.answer_tokens(train_set), "held_out_answers": len(held_out),
            "init": args.init, "unroll": args.unroll, "steps": result["steps"], "lr": args.lr, "batch_tokens": args.batch_tokens,
            "train_seconds": result["seconds"], "before": before, "after": after, "history": result["history"],
            "bytes": sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())}


def write_card(out: Path, info: dict) -> None:
    rows = "\n".join(f"| {d + 1} | {b['top1']:.3f} | {a['top1']:.3f} | {a['accept']:.3f} | {a['loss']:.3f} |"
                     for d, (b, a) in enumerate(zip(info["before"], info["after"])))
    text = f"""# Feature-level draft head for {info.get('target', 'the default target')}

An EAGLE-3-style head (services/draft/feature_head.py): the target's states after layers
{info['layers']}, fused, plus the next token's embedding, into one decoder layer; an LM head over
{info['draft_vocab']} ids (SlimSpec ratio {info['compression_ratio']}: the ids the target generated most,
{100 * info['coverage']:.1f}% of its answer tokens). Load it with `--draft {out}`.

## How it was made (`make head`, scripts/train_head.py)

- Data: {info['answers']} answers the target generated (greedy, 30% sampled at T=0.8 / top-p 0.95) to
  prompts from the task templates in services/draft/training/prompts.py (never Spec-Bench),
  batched {info.get('teacher_batch', 32)} wide, recording three layers' states and the top-32 next-token
  probabilities; {info['train_answers']} answers ({info['answer_tokens']} answer tokens) trained on,
  {info['held_out_answers']} held out. Teacher time: {info['teacher_seconds']:.0f} s.
- Objective: cross-entropy to the target's top-32 distribution (over the head's ids), with
  training-time test: {info['unroll']} unrolled steps, step s reading the head's own output states
  (loss weight 0.8^s). AdamW, lr {info['lr']}, warmup + cosine, {info['steps']} steps of about
  {info['batch_tokens']} padded positions. Training time: {info['train_seconds']:.0f} s.
- Held out, per draft depth (top-1: the head's argmax is the target's; accept: sum min(p, q) over
  the target's top-32 at T = 1, both with the true tokens before it):

| depth | top-1 before | top-1 after | accept (T=1) | loss |
|---|---|---|---|---|
{rows}

- Size: {info['bytes'] / 1e6:.1f} MB (bfloat16). Machine: {info['machine']}; {info['threads']} torch threads;
  built {info['date']}; {info['total_seconds'] / 60:.1f} min in all.
"""
    (out / "card.md").write_text(text)
    (out / "train-info.json").write_text(json.dumps(info, indent=1))


def machine() -> str:
    return f"{platform.machine()} {cpu_model()}".strip()


if __name__ == "__main__":
    raise SystemExit(main())
