"""One-call GPU check of the tree-attention kernel (`make gpu-check` on a CUDA machine).

    python -m services.kernels.gpu_check --out DIR [--quick] [--iters 30] [--budget-s 240]
    python -m services.kernels.gpu_check --out DIR --dry-run  # the script itself: CPU, tiny shapes

1. compiles the CuPy module; records registers, local memory (spills) and shared memory;
2. correctness: variants simple and mma x fp16/bf16, fresh random inputs per case over ragged
   shapes (prefix 0 and 1, chains, binary trees, random forests, stars, T up to 256, head_dim 64
   and 128, GQA ratios 1/3/4/8, both cache layouts) vs the reference in float64. Outputs are
   poisoned with NaN before each run and cache rows past L+T hold NaN. error = max|out - ref| /
   max|ref| (bf16 < 1e-2, fp16 < 2e-3); NaN fails; a second run must match bit for bit;
3. timing (CUDA events, median after warm-up): the mma kernel vs one padded SDPA call with a
   boolean tree mask vs a per-request SDPA loop, prefix 2048..8192 x tree 16..128 x batch 1..32;
4. the ceiling: a device-to-device copy, counted as bytes read + written (and bytes copied once);
5. writes DIR/gpu_check.md and DIR/gpu_check.json; exits 1 when any correctness check fails.
--dry-run runs every step on the CPU with the torch reference standing in for the kernel (and
host timers), so the plumbing is tested without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
GOAL_SHAPE = (4096, 64, 16)  # prefix, tree, batch: >= 2x padded SDPA, >= 60% of copy bandwidth


@dataclass(frozen=True)
class Shape:
    name: str
    prefix_lens: tuple[int, ...]
    tree_sizes: tuple[int, ...]
    kind: str  # chain | binary | random | star | mixed (cycles through the others)
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    q_gain: float = 1.0  # > 1 sharpens the softmax (exercises the online rescaling)


CHECK_SHAPES = [
    Shape("decode", (0, 1, 2047, 4096), (1, 1, 1, 1), "chain"),
    Shape("chain_prefill", (2048, 0), (64, 256), "chain"),
    Shape("mixed_ragged", (0, 1, 517, 3000, 64, 129), (256, 37, 128, 64, 1, 200), "mixed"),
    Shape("binary_d64_mha", (5, 1000, 1), (127, 255, 16), "binary", 16, 16, 64),
    Shape("random_d64_gqa8", (0, 333, 2048), (256, 96, 31), "random", 32, 4, 64),
    Shape("star_d64_gqa3", (70, 1), (40, 129), "star", 12, 4, 64),
    Shape("peaky_scores", (1500, 64), (100, 33), "random", q_gain=4.0),
    Shape("goal_shape", (4096,) * 16, (64,) * 16, "random"),
]
QUICK_CHECKS = ("decode", "mixed_ragged", "random_d64_gqa8", "goal_shape")
DRY_SHAPES = [Shape("dry_mixed", (0, 1, 9), (5, 1, 12), "mixed", 4, 2, 64),
              Shape("dry_chain", (3,), (8,), "chain", 2, 2, 128)]
TIME_SHAPES = [GOAL_SHAPE, (2048, 16, 1), (2048, 64, 16), (2048, 128, 32), (4096, 16, 16),
               (4096, 64, 1), (4096, 64, 32), (4096, 128, 16), (8192, 16, 32), (8192, 64, 16),
               (8192, 128, 32)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.kernels.gpu_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.md/.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    parser.add_argument("--iters", type=int, default=30, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="skip the remaining timing shapes after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU only: the reference stands in for the kernel (tests the script)")
    return parser.parse_args(argv)


def make_parents(kind: str, size: int, gen: torch.Generator) -> list[int]:
    if kind == "chain":
        return [j - 1 for j in range(size)]
    if kind == "binary":
        return [(j - 1) // 2 if j else -1 for j in range(size)]
    if kind == "star":
        return [-1] * size
    # random forest: each node hangs under an earlier node, or under the prefix
    return [int(torch.randint(-1, j, (1,), generator=gen)) if j else -1 for j in range(size)]


def make_inputs(shape: Shape, dtype: torch.dtype, seed: int, *, heads_outer: bool = True,
                poison_garbage: bool = True, device: str = "cuda"):
    """Fresh random inputs. Caches are views of one [B, KVH, C, D] store (heads_outer) or of a
    [B, C, KVH, D] store (strided heads); rows past L+T hold NaN."""
    device = torch.device(device)
    gen_cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(shape.tree_sizes)
    capacity = max(p + t for p, t in zip(shape.prefix_lens, shape.tree_sizes)) + 17
    kvh, dim = shape.num_kv_heads, shape.head_dim
    store_shape = (batch, kvh, capacity, dim) if heads_outer else (batch, capacity, kvh, dim)
    k_store = torch.randn(store_shape, generator=gen, device=device, dtype=dtype)
    v_store = torch.randn(store_shape, generator=gen, device=device, dtype=dtype)
    k_caches, v_caches = [], []
    for i, (p, t) in enumerate(zip(shape.prefix_lens, shape.tree_sizes)):
        k_view, v_view = (k_store[i], v_store[i]) if heads_outer else (
            k_store[i].transpose(0, 1), v_store[i].transpose(0, 1))  # [KVH, C, D]
        if poison_garbage:
            k_view[:, p + t:] = float("nan")
            v_view[:, p + t:] = float("nan")
        k_caches.append(k_view)
        v_caches.append(v_view)
    kinds = ("chain", "binary", "random", "star")
    parents = [par for i, t in enumerate(shape.tree_sizes) for par in make_parents(
        kinds[i % 4] if shape.kind == "mixed" else shape.kind, t, gen_cpu)]
    parents = torch.tensor(parents, dtype=torch.int32, device=device)
    q = torch.randn(sum(shape.tree_sizes), shape.num_heads, dim, generator=gen, device=device,
                    dtype=dtype) * shape.q_gain
    return q, k_caches, v_caches, list(shape.prefix_lens), list(shape.tree_sizes), parents


def time_ms(fn, iters: int, warmup: int, device: str = "cuda") -> float:
    """Median milliseconds of fn() over `iters` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    if device == "cpu":  # --dry-run
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


@dataclass
class Backend:
    """Where the script runs: the CUDA kernel, or (--dry-run) the CPU with the reference."""

    device: str
    dry_run: bool

    def prepare(self, *inputs, variant: str = "mma", out=None, check_parents: bool = True):
        """A launch object with run() -> out ([N, H, D])."""
        if not self.dry_run:
            from services.kernels.tree_attention import prepare_tree_attention

            return prepare_tree_attention(*inputs, variant=variant, out=out,
                                          check_parents=check_parents)
        from services.kernels.reference import tree_attention_reference

        class ReferenceLaunch:
            def run(self_inner):
                result = tree_attention_reference(*inputs, check_parents=check_parents)
                return result if out is None else out.copy_(result)

        return ReferenceLaunch()

    def sync(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize()

    def time_ms(self, fn, iters: int, warmup: int) -> float:
        return time_ms(fn, iters, warmup, self.device)


def copy_bandwidth(backend: Backend, iters: int, warmup: int) -> dict:
    nbytes = (1 << 20) if backend.dry_run else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=backend.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = backend.time_ms(lambda: dst.copy_(src), iters, warmup)
    return {"bytes": nbytes, "ms": ms, "read_plus_write_gb_s": 2 * nbytes / ms / 1e6,
            "copied_once_gb_s": nbytes / ms / 1e6}


def kernel_resources() -> list[dict]:
    from services.kernels import tree_attention as ta

    device_index = torch.cuda.current_device()
    rows = []
    for variant in ta.VARIANTS:
        for dtype in (torch.float16, torch.bfloat16):
            for dim in (64, 128):
                smem = ta.mma_smem_bytes(dim) if variant == "mma" else 0
                name = ta.kernel_name(variant, dtype, dim)
                fn = ta._load_kernel(device_index, name, smem)
                rows.append({"kernel": name, "registers": fn.num_regs,
                             "local_bytes": fn.local_size_bytes,
                             "static_smem": fn.shared_size_bytes, "dynamic_smem": smem})
    return rows


def check_case(backend: Backend, shape: Shape, dtype: torch.dtype, variant: str, seed: int,
               heads_outer: bool) -> dict:
    from services.kernels.reference import tree_attention_reference

    inputs = make_inputs(shape, dtype, seed, heads_outer=heads_outer, device=backend.device)
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = inputs
    ref = tree_attention_reference(q.double(), [k.double() for k in k_caches],
                                   [v.double() for v in v_caches], prefix_lens, tree_sizes, parents)
    out = torch.full_like(q, float("nan"))
    launch = backend.prepare(*inputs, variant=variant, out=out)
    launch.run()
    backend.sync()
    first = out.clone()
    out.fill_(float("nan"))
    launch.run()
    backend.sync()
    nan_count = int(torch.isnan(first).sum())
    err = float((first.double() - ref).abs().max() / ref.abs().max())
    rel_fro = float(torch.linalg.vector_norm(first.double() - ref) / torch.linalg.vector_norm(ref))
    repeatable = bool(torch.equal(first, out))
    passed = nan_count == 0 and err < TOLERANCE[dtype] and repeatable
    return {"shape": shape.name, "variant": variant, "dtype": DTYPE_NAMES[dtype],
            "heads_outer": heads_outer, "max_err_rel": err, "fro_err_rel": rel_fro,
            "nan": nan_count, "repeatable": repeatable, "passed": passed}


def time_case(backend: Backend, prefix: int, tree: int, batch: int, dtype: torch.dtype, args,
              copy_bw: dict) -> dict:
    from services.kernels.baselines import (build_loop_inputs, build_padded_inputs, run_loop,
                                            run_padded)

    shape = Shape(f"L{prefix}_T{tree}_B{batch}", (prefix,) * batch, (tree,) * batch, "random")
    inputs = make_inputs(shape, dtype, args.seed + prefix + tree + batch, poison_garbage=False,
                         device=backend.device)
    kernel_ms = backend.time_ms(backend.prepare(*inputs, check_parents=False).run, args.iters,
                                args.warmup)
    e2e_ms = backend.time_ms(lambda: backend.prepare(*inputs, check_parents=False).run(),
                             args.iters, args.warmup)  # validation + metadata upload + launch
    padded = build_padded_inputs(*inputs)
    padded_ms = backend.time_ms(lambda: run_padded(padded), args.iters, args.warmup)
    del padded
    loop = build_loop_inputs(*inputs)
    loop_ms = backend.time_ms(lambda: run_loop(loop), max(5, args.iters // 3), 2)
    del loop, inputs
    if not backend.dry_run:
        torch.cuda.empty_cache()
    heads, kv_heads, dim, elem = shape.num_heads, shape.num_kv_heads, shape.head_dim, 2
    kv_bytes = batch * (prefix + tree) * kv_heads * dim * elem * 2  # K and V, each byte once
    flops = 4 * batch * tree * heads * (prefix + tree) * dim  # QK^T and PV, dense-equivalent
    kv_gb_s = kv_bytes / kernel_ms / 1e6
    l2_bytes = 0 if backend.dry_run else torch.cuda.get_device_properties(0).L2_cache_size
    return {"prefix": prefix, "tree": tree, "batch": batch, "dtype": DTYPE_NAMES[dtype],
            "kernel_us": kernel_ms * 1e3, "wrapper_us": e2e_ms * 1e3,
            "sdpa_padded_us": padded_ms * 1e3, "sdpa_loop_us": loop_ms * 1e3,
            "speedup_vs_padded": padded_ms / kernel_ms, "speedup_vs_loop": loop_ms / kernel_ms,
            "kv_mb": kv_bytes / 1e6, "kv_gb_s": kv_gb_s,
            "frac_copy_rw": kv_gb_s / copy_bw["read_plus_write_gb_s"],
            "frac_copy_once": kv_gb_s / copy_bw["copied_once_gb_s"],
            "tflops": flops / kernel_ms / 1e9, "kv_fits_l2": kv_bytes < l2_bytes}


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# Tree-attention GPU check, {report['date']}", "",
             f"device: {report.get('device')}; torch {report.get('torch')}; cupy "
             f"{report.get('cupy')}", ""]
    if report.get("error"):
        lines += [f"ERROR: {report['error']}", ""]
    bw = report.get("copy_bandwidth")
    if bw:
        lines += [f"device-to-device copy: {bw['read_plus_write_gb_s']:.0f} GB/s counting bytes "
                  f"read + written ({bw['copied_once_gb_s']:.0f} GB/s counting each byte once)", ""]
    if report.get("resources"):
        lines += ["| kernel | registers | local bytes | static smem | dynamic smem |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['kernel']} | {r['registers']} | {r['local_bytes']} | {r['static_smem']} "
                  f"| {r['dynamic_smem']} |" for r in report["resources"]]
        lines.append("")
    lines += ["| shape | variant | dtype | heads outer | max err / max ref | fro rel err | NaN "
              "| repeatable | pass |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in report.get("correctness", []):
        if "error" in c:
            lines.append(f"| {c['shape']} | {c['variant']} | {c['dtype']} | | ERROR: "
                         f"{c['error'][:80]} | | | | no |")
            continue
        lines.append(f"| {c['shape']} | {c['variant']} | {c['dtype']} | {c['heads_outer']} | "
                     f"{c['max_err_rel']:.2e} | {c['fro_err_rel']:.2e} | {c['nan']} | "
                     f"{c['repeatable']} | {'yes' if c['passed'] else 'NO'} |")
    lines += ["", "| L | T | B | dtype | kernel us | wrapper us | SDPA padded us | SDPA loop us "
              "| x padded | x loop | KV GB/s | of copy (r+w) | of copy (once) | TFLOP/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in report.get("timing", []):
        if "error" in t or "skipped" in t:
            lines.append(f"| {t['prefix']} | {t['tree']} | {t['batch']} | {t['dtype']} | "
                         f"{t.get('error', 'skipped')[:80]} |")
            continue
        cached = " (fits L2)" if t["kv_fits_l2"] else ""
        lines.append(
            f"| {t['prefix']} | {t['tree']} | {t['batch']} | {t['dtype']} | {t['kernel_us']:.1f} | "
            f"{t['wrapper_us']:.1f} | {t['sdpa_padded_us']:.1f} | {t['sdpa_loop_us']:.1f} | "
            f"{t['speedup_vs_padded']:.2f} | {t['speedup_vs_loop']:.2f} | "
            f"{t['kv_gb_s']:.0f}{cached} | {t['frac_copy_rw']:.0%} | {t['frac_copy_once']:.0%} | "
            f"{t['tflops']:.0f} |")
    if report.get("goal"):
        lines += ["", "goal shape " + json.dumps(report["goal"])]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    report: dict = {"date": datetime.date.today().isoformat(), "argv": list(argv or sys.argv[1:]),
                    "dry_run": args.dry_run}
    backend = Backend("cpu" if args.dry_run else "cuda", args.dry_run)
    if args.dry_run:
        report.update(device="cpu (dry run: the reference stands in for the kernel)",
                      torch=torch.__version__, cupy=None)
        shapes, variants = DRY_SHAPES, ("reference",)
        cases = [((64, 8, 2), torch.bfloat16), ((32, 4, 1), torch.float16)]
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible to torch", file=sys.stderr)
            report["error"] = "no CUDA device visible to torch"
            write_report(args.out, report)
            return 2
        import cupy

        report.update(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                      cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())
        compile_start = time.monotonic()
        report["resources"] = kernel_resources()
        report["compile_s"] = time.monotonic() - compile_start
        shapes = [s for s in CHECK_SHAPES if not args.quick or s.name in QUICK_CHECKS]
        variants = ("simple", "mma")  # the plain kernel first: its results survive an mma crash
        cases = [(s, torch.bfloat16) for s in TIME_SHAPES] + [(GOAL_SHAPE, torch.float16)]
        if args.quick:
            cases = [(GOAL_SHAPE, torch.bfloat16), (GOAL_SHAPE, torch.float16),
                     ((8192, 128, 32), torch.bfloat16)]
    write_report(args.out, report)

    report["correctness"] = []
    for variant in variants:
        for idx, shape in enumerate(shapes):
            for dtype in (torch.bfloat16, torch.float16):
                seed = args.seed + 1000 * idx + (dtype == torch.float16)
                try:
                    result = check_case(backend, shape, dtype, variant, seed,
                                        heads_outer=idx % 2 == 0)
                except Exception as exc:  # a launch error poisons the context: record, go on
                    result = {"shape": shape.name, "variant": variant,
                              "dtype": DTYPE_NAMES[dtype], "passed": False,
                              "error": f"{type(exc).__name__}: {exc}",
                              "trace": traceback.format_exc()}
                report["correctness"].append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "trace"}), flush=True)
        write_report(args.out, report)
    all_passed = all(c["passed"] for c in report["correctness"])

    report["copy_bandwidth"] = copy_bandwidth(backend, args.iters, args.warmup)
    report["timing"] = []
    for (prefix, tree, batch), dtype in cases:
        row = {"prefix": prefix, "tree": tree, "batch": batch, "dtype": DTYPE_NAMES[dtype]}
        if time.monotonic() - started > args.budget_s:
            row["skipped"] = "time budget"
        else:
            try:
                row = time_case(backend, prefix, tree, batch, dtype, args,
                                report["copy_bandwidth"])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
        report["timing"].append(row)
        print(json.dumps(row), flush=True)
        write_report(args.out, report)
    goal = next((t for t in report["timing"] if (t["prefix"], t["tree"], t["batch"]) == GOAL_SHAPE
                 and t["dtype"] == "bf16" and "kernel_us" in t), None)
    if goal:
        report["goal"] = {"speedup_vs_padded": round(goal["speedup_vs_padded"], 2),
                          "frac_copy_rw": round(goal["frac_copy_rw"], 3),
                          "frac_copy_once": round(goal["frac_copy_once"], 3),
                          "met_2x": goal["speedup_vs_padded"] >= 2.0,
                          "met_60pct_rw": goal["frac_copy_rw"] >= 0.6}
    report["all_correct"] = all_passed
    report["elapsed_s"] = time.monotonic() - started
    write_report(args.out, report)
    print((args.out / "gpu_check.md").read_text())
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
