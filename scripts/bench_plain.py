"""Benchmark: same-engine plain decoding against HF `generate`, and n-gram drafting, side by side.

For each Spec-Bench question (first turn, chat template) and each repeat, the configurations run
back to back in one process, in a rotating order, so machine drift cancels in the ratios. Reports
medians over repeats of tokens/s, MAL and acceptance rate, checks that every configuration produced
the same tokens as HF greedy decoding, and writes JSON plus a Markdown table (optionally into
BENCHMARKS.md between markers).

    python scripts/bench_plain.py --questions ../shared/bench/spec_bench_dev.jsonl --per-category 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

from services.cli import encode_prompt
from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft.ngram import NgramProposer
from services.scheduler.engine import Engine, EngineConfig



def update_section(path: Path, name: str, table: str) -> None:
    """Replace the section between `<!-- name:begin -->` and `<!-- name:end -->` (or append it)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def load_questions(path: Path, per_category: int) -> list[dict]:
    taken: dict[str, int] = defaultdict(int)
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if taken[q["category"]] < per_category:
            taken[q["category"]] += 1
            out.append(q)
    return out


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--update", type=Path, default=None, help="rewrite this Markdown file's section")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    target = load_model("default")
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    questions = load_questions(args.questions, args.per_category)
    prompts = [encode_prompt(target.tokenizer, q["turns"][0], chat=True) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens)

    def hf_generate(ids):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist(), None

    def engine_run(proposer, k, tree):
        def run(ids):
            engine = Engine(target, proposer, EngineConfig(draft_length=k, tree_size=tree))
            req = engine.generate([ids], params)[0]
            return req.output_ids, req.summary()
        return run

    configs = {
        "hf_generate": hf_generate,
        "plain": engine_run(None, 0, None),
        "ngram_k4": engine_run(NgramProposer(), 4, None),
        "ngram_k4_tree8": engine_run(NgramProposer(), 4, 8),
    }
    engine_run(None, 0, None)(prompts[0])  # warm-up
    hf_generate(prompts[0])
    rows = []  # one per (question, config, repeat)
    mismatches = []
    names = list(configs)
    for rep in range(args.repeats):
        for qi, (q, ids) in enumerate(zip(questions, prompts)):
            order = names[(qi + rep) % len(names):] + names[: (qi + rep) % len(names)]
            ref = None
            results = {}
            for name in order:
                t0 = time.perf_counter()
                tokens, summary = configs[name](ids)
                elapsed = time.perf_counter() - t0
                results[name] = tokens
                rows.append({"question_id": q["question_id"], "category": q["category"], "config": name,
                             "repeat": rep, "tokens": len(tokens), "elapsed_s": elapsed,
                             "steps": summary["steps"] if summary else len(tokens),
                             "accepted": summary["accepted_tokens"] if summary else 0,
                             "drafted": summary["drafted_tokens"] if summary else 0})
            ref = results["hf_generate"]
            for name, tokens in results.items():
                if tokens != ref:
                    mismatches.append({"question_id": q["question_id"], "config": name, "repeat": rep})
            print(f"repeat {rep + 1}/{args.repeats} question {qi + 1}/{len(questions)}", flush=True)

    summary = {}
    for name in names:
        mine = [r for r in rows if r["config"] == name]
        per_rep = []
        for rep in range(args.repeats):
            rr = [r for r in mine if r["repeat"] == rep]
            per_rep.append((sum(r["tokens"] for r in rr), sum(r["elapsed_s"] for r in rr),
                            sum(r["steps"] for r in rr), sum(r["accepted"] for r in rr), sum(r["drafted"] for r in rr)))
        tps = statistics.median(t / e for t, e, *_ in per_rep)
        summary[name] = {"tokens_per_s": tps,
                         "mal": statistics.median(t / s for t, _, s, _, _ in per_rep),
                         "acceptance_rate": statistics.median((a / d) if d else 0.0 for *_, a, d in per_rep)}
    # Ratios per repeat (same repeat = interleaved runs), then the median.
    for name in names:
        ratios_hf, ratios_plain = [], []
        for rep in range(args.repeats):
            def total(cfg):
                rr = [r for r in rows if r["config"] == cfg and r["repeat"] == rep]
                return sum(r["tokens"] for r in rr) / sum(r["elapsed_s"] for r in rr)
            ratios_hf.append(total(name) / total("hf_generate"))
            ratios_plain.append(total(name) / total("plain"))
        summary[name]["x_hf_generate"] = statistics.median(ratios_hf)
        summary[name]["x_plain"] = statistics.median(ratios_plain)

    meta = {"date": dt.date.today().isoformat(), "commit": commit(), "machine": machine(),
            "questions": len(questions), "max_tokens": args.max_tokens, "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_plain.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows,
                                                           "mismatches": mismatches}, indent=1))
    lines = [f"Default model (SmolLM2-135M-Instruct, float32), {meta['questions']} Spec-Bench dev questions "
             f"(first turn, one per category), greedy, max {meta['max_tokens']} tokens, median of "
             f"{meta['repeats']} interleaved repeats. {meta['date']}, commit {meta['commit']}, {meta['machine']}.",
             "", "| configuration | tokens/s | x HF generate | x plain | MAL | acceptance |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        s = summary[name]
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {s['x_hf_generate']:.2f} | {s['x_plain']:.2f} | "
                     f"{s['mal']:.2f} | {s['acceptance_rate']:.2f} |")
    lines.append("")
    lines.append(f"Token identity with HF greedy: {'all identical' if not mismatches else f'{len(mismatches)} mismatching runs: ' + json.dumps(mismatches)}.")
    table = "\n".join(lines)
    (args.out / "bench_plain.md").write_text(table + "\n")
    print(table)
    if args.update:
        update_section(args.update, "bench_plain", table)


if __name__ == "__main__":
    main()
