"""Benchmark: n samples of one prompt (the OpenAI `n`), the later ones copying the prompt's KV
from the first (`shared`, what the scheduler does) against n independent requests that each
prefill it (`separate`), in-process on the default model: plain decoding and the n-gram draft,
greedy, the longest dev question as the prompt. Interleaved, median over repeats: time to the
last sample's first token, and to the end of all n.

    python scripts/bench_samples.py [--n 4] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.common.loading import load_model  # noqa: E402
from services.common.prompt import encode_prompt  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from services.draft.ngram import NgramProposer  # noqa: E402
from services.scheduler.core import StepConfig  # noqa: E402
from services.scheduler.engine import Engine  # noqa: E402

QUESTIONS = ROOT.parent / "shared" / "bench" / "spec_bench_dev.jsonl"


def longest_prompt(tokenizer) -> list[int]:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return max((encode_prompt(tokenizer, r["turns"][0], chat=True) for r in rows), key=len)


def run(engine: Engine, prompt: list[int], n: int, shared: bool, max_tokens: int) -> tuple[float, float, list]:
    """(seconds to the last sample's first token, seconds to the end, the samples' tokens)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.core.submit(f"s{i}", prompt, params, follows="s0" if shared and i else None) for i in range(n)]
    first: dict[str, float] = {}
    while engine.has_work():
        engine.step()
        now = time.perf_counter() - t0
        first.update((r.req_id, now) for r in reqs if r.output_ids and r.req_id not in first)
    return max(first.values()), time.perf_counter() - t0, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    target = load_model("default")
    prompt = longest_prompt(target.tokenizer)
    engines = {"plain": Engine(target, None, StepConfig(draft_length=0), warm_up=False),
               "ngram k4": Engine(target, NgramProposer(), StepConfig(draft_length=4), warm_up=False)}
    times = {(e, s): [] for e in engines for s in ("separate", "shared")}
    tokens = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            for how in ("separate", "shared"):
                ttft, total, out = run(engine, prompt, args.n, how == "shared", args.max_tokens)
                times[(name, how)].append((ttft, total))
                tokens[(name, how)] = out
    print(f"prompt {len(prompt)} tokens, n = {args.n}, {args.max_tokens} tokens each, {args.repeats} repeats")
    print("| draft | prefill | last first token (s) | all n done (s) | shared / separate |")
    print("| --- | --- | --- | --- | --- |")
    for name in engines:
        sep = [statistics.median(t[i] for t in times[(name, "separate")]) for i in (0, 1)]
        for how in ("separate", "shared"):
            ttft, total = (statistics.median(t[i] for t in times[(name, how)]) for i in (0, 1))
            ratio = "" if how == "separate" else f"{ttft / sep[0]:.2f}x / {total / sep[1]:.2f}x"
            print(f"| {name} | {how} | {ttft:.2f} | {total:.2f} | {ratio} |")
        same = tokens[(name, "separate")] == tokens[(name, "shared")]
        print(f"<!-- {name}: identical tokens shared vs separate: {same} -->")


if __name__ == "__main__":
    main()
