"""Benchmark: the verify cost curve, one target forward of n rows after a cached prompt.

For the default target (or --target) as served (native GGUF weights: 4-bit layers on the tile
kernel's integer dot products, q8matmul.cpp; the whole decoder stack in one call, layers.cpp,
with attention.cpp), the same on the float32 block kernel
(SPECSERVE_NATIVE_MATMUL=float, as served before the tile kernel), the served model with its Q8_0
LM head on the float block kernel (as served before that took tiles too), the served model op by op
from Python, on torch's int4 route (the fallback: bfloat16 activations, float64 attention) and
on float32 weights, the time of one forward of a chain of n new rows after a `--context`-token
prefix, the cache rolled back after each. The models run interleaved per repeat; medians
over repeats. This is what the latency model learns at load, and what decides how many rows
speculation can afford.

    python scripts/bench_forward.py [--context 300] [--rows 1,2,4,8,16,32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
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
from services.common import qmatmul  # noqa: E402
from services.common.matmul import Weight  # noqa: E402
from services.common.quant import ROUTE_ENV  # noqa: E402


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
    models = {"native": load_model(args.target, weight_format="native").model}
    for name, route in (("native_float", "float"), ("int4", "int4")):
        os.environ[ROUTE_ENV] = route
        models[name] = load_model(args.target, weight_format="native").model
        del os.environ[ROUTE_ENV]
    models["head_float"] = load_model(args.target, weight_format="native").model
    head = models["head_float"].head_blocks
    if head is not None and qmatmul.supports(head):
        models["head_float"].lm_head = Weight(None, None, qmatmul.BlockWeight(head))
    models["native_ops"] = load_model(args.target, weight_format="native").model
    models["native_ops"].stack = None  # the layers op by op from Python
    models["float32"] = load_model(args.target, weight_format="float32").model
    prompt = list(range(100, 100 + args.context))
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(args.context + max(rows) + 8)
        m.forward([Chunk(caches[name], prompt, [-1] + list(range(len(prompt) - 1)), len(prompt) - 1)])
    times = {(name, r): [] for name in models for r in rows}
    for rep in range(args.repeats + 1):  # the first round warms each shape up, untimed
        for name, m in models.items():
            for r in rows:
                ms = forward_ms(m, caches[name], r)
                if rep:
                    times[(name, r)].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"One forward of n rows after {args.context} cached tokens, {args.target}, median of {args.repeats} "
          f"interleaved repeats. {stamp(meta(sys.argv))}.\n")
    names = ("native", "head_float", "native_float", "native_ops", "int4", "float32")
    print("| rows | native ms | LM head on the float block kernel ms | float block kernel ms | op by op ms "
          "| int4 route ms | float32 ms | native / float block kernel | native / float32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        n, h, b, o, i, f = (med[(name, r)] for name in names)
        print(f"| {r} | {n:.2f} | {h:.2f} | {b:.1f} | {o:.1f} | {i:.1f} | {f:.1f} | {n / b:.2f} | {n / f:.2f} |")


if __name__ == "__main__":
    main()
