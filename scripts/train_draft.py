"""Build the default draft: distill a few of the target's layers into a small draft model.

    .venv/bin/python scripts/train_draft.py --out models/draft          (what `make draft` runs)
    .venv/bin/python scripts/train_draft.py --out /tmp/d --prompts 64 --steps 30   (a quick check)

1. The target answers generated prompts (services/draft/training/prompts.py; never Spec-Bench),
   greedy and sampled, recording its top-k next-token log-probabilities at every answer position.
2. A draft of a few decoder layers initialized from the target's (on the target's frozen tied
   embedding) is trained to match those distributions (cross-entropy to the teacher's top-k).
3. The draft is written as a GGUF file (the target's tokenizer and metadata, Q8_0 layers),
   reloaded through services/common/loading.py and checked against the trained weights; the
   token counts of the answers (SlimSpec's frequency table) and a card go next to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.prompt import encode_prompt  # noqa: E402
from services.common.loading import default_gguf_path, load_model, load_weights  # noqa: E402
from services.common.machine import cpu_model  # noqa: E402
from services.draft.slim import COUNTS_NAME  # noqa: E402
from services.draft.training import teacher  # noqa: E402
from services.draft.training.export import write_gguf  # noqa: E402
from services.draft.training.prompts import make_prompts  # noqa: E402
from services.draft.training.student import Student, evaluate, train  # noqa: E402

log = logging.getLogger("train_draft")
GGUF_NAME = "SmolLM2-135M-Instruct-draft.Q8_0.gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/draft", help="checkpoint directory to write")
    p.add_argument("--work", default=".draft-work", help="teacher data cache directory")
    p.add_argument("--prompts", type=int, default=1400, help="training prompts")
    p.add_argument("--max-tokens", type=int, default=160, help="answer length cap")
    p.add_argument("--sampled-fraction", type=float, default=0.3, help="answers sampled at T=0.8")
    p.add_argument("--teacher-batch", type=int, default=32)
    p.add_argument("--teacher-minutes", type=float, default=14.0,
                   help="data budget of this run (stops early; a rerun extends the cached data; 0 = cache only)")
    p.add_argument("--layers", default="0,1", help="target layers the draft starts from")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per step")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--train-minutes", type=float, default=20.0, help="training budget (stops early)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default="auto",
                   help="torch threads; auto = 2, or 1 when the machine is already busy (load average >= "
                        "cores): on an oversubscribed CPU, threads waiting for each other at every small op "
                        "made teacher decoding about 20x slower")
    return p.parse_args(argv)


def teacher_data(args, target, work: Path):
    """The teacher answers, cached in `work`; a later run with the same settings extends the cache
    with answers to the prompts not answered yet (another --teacher-minutes of generation)."""
    key = f"p{args.prompts}-t{args.max_tokens}-s{args.seed}-f{args.sampled_fraction}"
    cache = work / f"teacher-{key}.pt"
    data = {"samples": [], "seconds": 0.0, "prompts": args.prompts}
    if cache.exists():
        data = torch.load(cache, weights_only=False)
        log.info("teacher data cache %s: %d answers", cache, len(data["samples"]))
    if args.teacher_minutes <= 0:
        return data
    prompts = make_prompts(args.prompts, seed=args.seed)
    rng = random.Random(args.seed)
    temps = [0.8 if rng.random() < args.sampled_fraction else 0.0 for _ in prompts]
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    answered = {tuple(s.ids[: s.prompt_len]) for s in data["samples"]}
    todo = [i for i, e in enumerate(encoded) if tuple(e) not in answered]
    if not todo:
        return data
    started = time.monotonic()
    samples = teacher.generate(target.model, [encoded[i] for i in todo], [temps[i] for i in todo],
                               target.config.eos_token_ids, args.max_tokens, batch=args.teacher_batch,
                               seed=args.seed + len(answered), deadline=started + 60 * args.teacher_minutes)
    data = {"samples": data["samples"] + samples, "seconds": data["seconds"] + time.monotonic() - started,
            "prompts": args.prompts}
    work.mkdir(parents=True, exist_ok=True)
    torch.save(data, cache)
    return data


def token_counts(samples, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, dtype=np.int64)
    for s in samples:
        np.add.at(counts, np.asarray(s.ids[s.prompt_len :]), 1)
    return counts


@torch.no_grad()
def check_export(out: Path, student: Student, samples) -> dict:
    """Reload the written checkpoint with the serving loader; compare its logits with the trained
    float32 draft on a few answers."""
    from services.common.llama import Chunk

    draft = load_model(str(out))
    worst, agree, rows = 0.0, 0, 0
    for s in samples[:4]:
        ids = torch.tensor([s.ids])
        ref = torch.nn.functional.linear(student.hidden(ids)[0], student.embed)  # [seq, vocab]
        got = draft.model.forward([Chunk(draft.model.new_cache(len(s.ids)), s.ids,
                                         list(range(-1, len(s.ids) - 1)), 0)])[0]
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        rows += len(s.ids)
    return {"max_rel_logit_error": worst, "argmax_agreement": agree / rows}


def write_card(out: Path, info: dict) -> None:
    e0, e1 = info["eval_before"], info["eval_after"]
    text = f"""# SpecServe default draft for SmolLM2-135M-Instruct

`{GGUF_NAME}`: an ordinary GGUF checkpoint (Llama architecture, the target's tokenizer and
chat template) with {info['num_layers']} decoder layers, hidden size 576, vocabulary 49152, tied
embeddings. Load it like any draft: `--draft models/draft` (or `--draft default`).

## How it was made (`make draft`, scripts/train_draft.py)

- Layers initialized from the target's layers {info['source_layers']}; the token embedding (tied
  LM head) is the target's, frozen, stored with the target's own Q8_0 bytes.
- Data: {info['samples']} answers ({info['answer_tokens']} tokens) the target generated with
  the lean forward from {info['prompts']} prompts built from task templates in
  `services/draft/training/prompts.py` (writing, QA, math, code, summarizing, translation,
  reasoning, roleplay); chat template applied as the server does; {int(100 * info['sampled_fraction'])}%
  sampled at T=0.8 / top-p 0.95, the rest greedy; at most {info['max_tokens']} tokens each.
  Nothing from Spec-Bench, nothing downloaded. Teacher time: {info['teacher_seconds']:.0f} s.
- Objective: cross-entropy to the target's top-32 next-token probabilities at every answer position
  (KL up to the teacher's entropy). AdamW, lr {info['lr']}, warmup + cosine, {info['steps']} steps of
  about {info['batch_tokens']} padded tokens, seed {info['seed']}. Training time: {info['train_seconds']:.0f} s.
- Held-out answers ({e1['rows']} positions): loss {e0['loss']:.3f} -> {e1['loss']:.3f}; top-1
  agreement with the target {e0['top1_agreement']:.3f} -> {e1['top1_agreement']:.3f}.
- Export check (reloaded through services/common/loading.py vs the float32 trained draft): max
  relative logit error {info['export']['max_rel_logit_error']:.4f}, argmax agreement
  {info['export']['argmax_agreement']:.4f}.
- `slimspec-token-counts.npy`: how often each token id occurs in the target's answers above;
  SlimSpec keeps the most frequent ids.
- Machine: {info['machine']}; {info['threads']} torch threads; built {info['date']}; total {info['total_seconds'] / 60:.1f} min.
"""
    (out / "card.md").write_text(text)
    (out / "README.md").write_text(text)
    (out / "train-info.json").write_text(json.dumps(info, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.threads = _threads(args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    out, work = Path(args.out), Path(args.work)
    target = load_model("default")
    data = teacher_data(args, target, work)
    samples = data["samples"]
    log.info("teacher data: %d answers, %d tokens, %.0f s", len(samples),
             sum(len(s.ids) - s.prompt_len for s in samples), data["seconds"])
    n_eval = max(2, len(samples) // 25)
    eval_samples, train_samples = samples[:n_eval], samples[n_eval:]
    layers = [int(x) for x in args.layers.split(",")]
    student = Student(target.config, load_weights(target.path), layers)
    del target
    before = evaluate(student, eval_samples, args.batch_tokens)
    log.info("before training: %s", before)
    result = train(student, train_samples, eval_samples, args.steps, args.lr, args.batch_tokens,
                   args.seed, deadline=time.monotonic() + 60 * args.train_minutes)
    log.info("after training: %s", result["eval"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    c = student.config
    write_gguf(default_gguf_path(), student.hf_weights(), len(layers), out / GGUF_NAME,
               f"SmolLM2-135M-Instruct draft ({len(layers)} layers)", c.num_heads, c.num_kv_heads)
    np.save(out / COUNTS_NAME, token_counts(samples, c.vocab_size))
    export = check_export(out, student, eval_samples)
    log.info("export check: %s", export)
    info = {
        "num_layers": len(layers), "source_layers": layers, "samples": len(samples),
        "answer_tokens": sum(len(s.ids) - s.prompt_len for s in samples), "prompts": data["prompts"],
        "sampled_fraction": args.sampled_fraction, "max_tokens": args.max_tokens,
        "teacher_seconds": data["seconds"], "lr": args.lr, "steps": result["steps"],
        "batch_tokens": args.batch_tokens, "seed": args.seed, "train_seconds": result["seconds"],
        "eval_before": before, "eval_after": result["eval"], "export": export,
        "history": result["history"], "threads": args.threads,
        "load_average": list(os.getloadavg()),
        "machine": f"{platform.machine()} {platform.processor() or ''} {cpu_model()}".strip(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "total_seconds": time.monotonic() - started,
        "gguf_bytes": (out / GGUF_NAME).stat().st_size,
    }
    write_card(out, info)
    log.info("wrote %s (%.1f MB) in %.1f min", out / GGUF_NAME, info["gguf_bytes"] / 1e6,
             info["total_seconds"] / 60)
    return 0


def _threads(value: str) -> int:
    if value != "auto":
        return max(1, int(value))
    cores = min(2, os.cpu_count() or 1)
    return 1 if os.getloadavg()[0] >= cores else cores


if __name__ == "__main__":
    raise SystemExit(main())
