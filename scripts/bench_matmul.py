"""Benchmark: one step's matmuls over a model's weights, by route and row count, and the
memory-bandwidth floor they sit on (why `services.common.matmul` picks its routes).

For each row count (the new tokens of a step), every linear weight of the model (layers and
head) is multiplied once by each route, interleaved, median over repeats:
  F.linear           MKL on the plain weights (the route for <= small_rows rows),
  oneDNN             oneDNN's linear on the plain weights (the engine's old route),
  oneDNN blocked     oneDNN on weights reordered once into its blocked layout (> small_rows),
where small_rows is what the engine's `Matmul.tune` chose for this machine at load, and on the
GGUF file's own blocks (`--weights native`):
  block native       the CPU kernels' block matmul (`services/common/qmatmul.cpp`, served),
  int4 native        torch's int4 matmul (the fallback; bfloat16 copies of the same inputs).
The floors are the weights' bytes (float32; native as held) over the bandwidth of summing one
float32 buffer.

    python scripts/bench_matmul.py [--target default] [--update BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench import report  # noqa: E402
from services.common.loading import load_model  # noqa: E402
from services.common.quant import ROUTE_ENV  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 16, 32)
NATIVE = ("block native", "int4 native")


def timed(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--update", type=Path, help="rewrite the bench_matmul section of this Markdown file")
    args = ap.parse_args()
    model = load_model(args.target, weight_format="float32").model
    native = {NATIVE[0]: load_model(args.target).model.linear_weights()}
    os.environ[ROUTE_ENV] = "int4"
    native[NATIVE[1]] = load_model(args.target).model.linear_weights()
    del os.environ[ROUTE_ENV]
    if any(w.native is None for ws in native.values() for w in ws):
        sys.exit("the native route is off for this model (not a GGUF of Q4_0/Q4_1/Q8_0 blocks)")
    if any(w.native.rounds_activations for w in native[NATIVE[0]]):
        sys.exit("the CPU kernels did not build here: the served route is the int4 one")
    native_bytes = sum(w.nbytes() for w in native[NATIVE[0]])
    weights = model.linear_weights()
    if any(w.packed is None for w in weights):
        sys.exit("the blocked route is off for this model (not CPU float32, or no oneDNN)")
    nbytes = sum(w.dense.numel() * w.dense.element_size() for w in weights)

    routes = {
        "F.linear": lambda x, w: F.linear(x, w.dense),
        "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w.dense, None, "none", [], ""),
        "oneDNN blocked": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w.packed, None, "none", [], ""),
    }
    buffer = torch.ones(nbytes // 4)
    floor_s = statistics.median(timed(buffer.sum, 1) for _ in range(args.repeats))
    rows_ms = {}
    for rows in ROWS:
        xs = {w.dense.shape[1]: torch.randn(rows, w.dense.shape[1]) for w in weights}
        samples = {name: [] for name in [*routes, *NATIVE]}
        for _ in range(args.repeats):
            for name, route in routes.items():
                samples[name].append(timed(lambda: [route(xs[w.dense.shape[1]], w) for w in weights], 1))
            for name, ws in native.items():
                samples[name].append(timed(lambda: [w.native.linear(xs[w.native.shape[1]]) for w in ws], 1))
        rows_ms[rows] = {name: 1000 * statistics.median(v) for name, v in samples.items()}

    m = report.meta(sys.argv)
    small = model.matmul.small_rows
    route = f"F.linear up to {small} rows, oneDNN blocked above" if small else "oneDNN blocked at every row count"
    lines = [f"One step's matmuls over every weight of {args.target} ({nbytes / 1e6:.0f} MB fp32), ms, "
             f"median of {args.repeats} interleaved repeats; at load the engine tuned itself to take {route}. Memory floor: {1000 * floor_s:.1f} ms "
             f"(summing one {nbytes / 1e6:.0f} MB buffer, {nbytes / floor_s / 1e9:.1f} GB/s); native weights "
             f"hold {native_bytes / 1e6:.0f} MB, floor {1000 * floor_s * native_bytes / nbytes:.1f} ms. {report.stamp(m)}.",
             "", "| rows | " + " | ".join(routes) + " | float32 engine | " + " | ".join(NATIVE) + " |",
             "| --- |" + " --- |" * (len(routes) + 1 + len(NATIVE))]
    for rows, ms in rows_ms.items():
        engine = ms["F.linear"] if rows <= small else ms["oneDNN blocked"]
        lines.append(f"| {rows} | " + " | ".join(f"{ms[n]:.1f}" for n in routes) + f" | {engine:.1f} | "
                     + " | ".join(f"{ms[n]:.1f}" for n in NATIVE) + " |")
    body = "\n".join(lines)
    print(body)
    if args.update:
        report.update_section(args.update, "bench_matmul", body)


if __name__ == "__main__":
    main()
