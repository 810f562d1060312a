"""Benchmark: the verify cost curve, one target forward of n rows after a cached prompt.

For the default target (or --target) on native GGUF weights and on float32, and native weights
with float32 attention (what the float64 attention that keeps plain decoding and verification
bitwise equal costs; not a served setting), the time of one forward of a chain of n new rows
after a `--context`-token prefix, the cache rolled back after each. The three models run
interleaved per repeat; medians over repeats. This is what the latency model learns at load, and
what decides how many rows speculation can afford.

    python scripts/bench_forward.py [--context 300] [--rows 1,2,4,8,16,32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench.report import meta, stamp  # noqa: E402
from services.common.llama import Chunk, LlamaModel  # noqa: E402
from services.common.loading import load_model  # noqa: E402


def forward_ms(model: LlamaModel, cache, rows: int) -> float:
    """One forward of a chain of `rows` new tokens after the cached prefix; the cache rolled back."""
    start = cache.length
    t0 = time.perf_counter()
    model.forward([Chunk(cache, [5] * rows, [-1] + list(range(rows - 1)), 0)])
    elapsed = (time.perf_counter() - t0) * 1e3
    cache.truncate(start)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--context", type=int, default=300, help="cached prompt tokens before the rows")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    native = load_model(args.target, weight_format="native").model
    models = {"native": native, "float32": load_model(args.target, weight_format="float32").model}
    prompt = list(range(100, 100 + args.context))
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(args.context + max(rows) + 8)
        m.forward([Chunk(caches[name], prompt, [-1] + list(range(len(prompt) - 1)), len(prompt) - 1)])
    settings = {"native": (native, torch.float64), "float32": (models["float32"], None),
                "native_attention_f32": (native, torch.float32)}
    times = {(s, r): [] for s in settings for r in rows}
    for rep in range(args.repeats + 1):  # the first round warms each shape up, untimed
        for s, (m, attention) in settings.items():
            if attention is not None:
                m.attention_dtype = attention
            cache = caches["native" if m is native else "float32"]
            for r in rows:
                ms = forward_ms(m, cache, r)
                if rep:
                    times[(s, r)].append(ms)
    native.attention_dtype = torch.float64
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"One forward of n rows after {args.context} cached tokens, {args.target}, median of {args.repeats} "
          f"interleaved repeats. {stamp(meta(sys.argv))}.\n")
    print("| rows | native ms | float32 ms | native / float32 | native, float32 attention ms "
          "| float64 attention's share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        n, f, a = med[("native", r)], med[("float32", r)], med[("native_attention_f32", r)]
        print(f"| {r} | {n:.1f} | {f:.1f} | {n / f:.2f} | {a:.1f} | {(n - a) / n:.0%} |")


if __name__ == "__main__":
    main()
