"""Benchmark: `specserve generate` as a new user runs it, defaults against `--draft none`.

For each of N Spec-Bench questions (the first of each category, chat template, greedy), one
`specserve generate --json` process per configuration, the two in alternating order, repeated;
per question the median over repeats of (tokens/s with the defaults) / (tokens/s with --draft
none). tokens/s is the request's own (from its submission; loading and the latency warm-up are
`load_s`). Before the first repeat the warm-up cache is emptied, so the first defaults run
measures the warm-up and the later ones reuse it: their `load_s` are reported side by side.

    python scripts/bench_generate.py --questions ../shared/bench/spec_bench_dev.jsonl --update BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench import questions as _questions, report as _report  # noqa: E402
from services.common.loading import specserve_home  # noqa: E402

CONFIGS = {"defaults": [], "draft_none": ["--draft", "none"]}


def generate(prompt: str, max_tokens: int, extra: list[str]) -> dict:
    cmd = [str(ROOT / ".venv" / "bin" / "specserve"), "generate", "--prompt", prompt, "--chat", "--json",
           "--max-tokens", str(max_tokens), *extra]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--count", type=int, default=5, help="questions (the first of each category)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update", type=Path, default=None)
    args = ap.parse_args()
    questions = _questions.load_questions(args.questions, limit=1)[: args.count]
    shutil.rmtree(specserve_home() / "calibration", ignore_errors=True)  # the first run measures
    runs = {q.question_id: {name: [] for name in CONFIGS} for q in questions}
    for rep in range(args.repeats):
        for i, q in enumerate(questions):
            order = list(CONFIGS) if (i + rep) % 2 == 0 else list(CONFIGS)[::-1]
            for name in order:
                runs[q.question_id][name].append(generate(q.text, args.max_tokens, CONFIGS[name]))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rows, loads = [], [r["load_s"] for q in questions for r in runs[q.question_id]["defaults"]]
    for q in questions:
        r = runs[q.question_id]
        ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(r["defaults"], r["draft_none"]))
        tps = {name: statistics.median(x["tokens_per_s"] for x in r[name]) for name in CONFIGS}
        mal = statistics.median(x["mean_accepted_length"] for x in r["defaults"])
        rows.append(f"| {q.category} | {tps['draft_none']:.1f} | {tps['defaults']:.1f} | {mal:.2f} | {ratio:.2f} |")
    m = _report.machine()
    head = (f"{len(questions)} Spec-Bench dev questions (first of each category, chat, greedy, max {args.max_tokens} "
            f"tokens), one `specserve generate` process per run, median of {args.repeats} interleaved repeats. "
            f"{time.strftime('%Y-%m-%d')}, commit {_report.commit()['commit']}, {_report.machine_line(m)}.")
    none_loads = [r["load_s"] for q in questions for r in runs[q.question_id]["draft_none"]]
    table = "\n".join([head, "", "| category | --draft none tok/s | defaults tok/s | MAL | defaults / none |",
                       "| --- | --- | --- | --- | --- |", *rows, "",
                       f"`load_s` with the defaults: first run {loads[0]:.1f} s (warm-up measured), later runs "
                       f"median {statistics.median(loads[1:]):.1f} s (cached calibration); `--draft none` median "
                       f"{statistics.median(none_loads):.1f} s."])
    print(table)
    if args.update:
        _report.update_section(args.update, "bench_generate", table)


if __name__ == "__main__":
    main()
