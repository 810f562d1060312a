"""Benchmark: plain decoding, static draft lengths and the adaptive controller under load.

One whole stack per setting (`make bench-load` with SPECSERVE_DRAFT_LENGTH = each setting; the
same closed-loop load for each), then one table: output tokens/s per concurrency level and
setting, and each against plain decoding (setting 0). The stacks run one after another on the
same machine, so unlike `specserve bench spec` the settings are not interleaved: read a few
percent as noise.

    python scripts/bench_load_compare.py --settings 0,2,4,adaptive --concurrency 8,16 \
        --requests 32 --repeats 2 --out bench-out/load-compare --update BENCHMARKS.md
    python scripts/bench_load_compare.py --settings 0,2,4,adaptive --out DIR --no-run  # tabulate DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench.report import stamp, update_section  # noqa: E402


def run_setting(setting: str, out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPECSERVE_DRAFT_LENGTH=setting)
    cmd = ["make", "-s", "bench-load", f"BENCH_OUT={out}", f"BENCH_CONCURRENCY={args.concurrency}",
           f"BENCH_REQUESTS={args.requests}", f"BENCH_LOAD_REPEATS={args.repeats}",
           f"BENCH_MAX_TOKENS={args.max_tokens}", f"BENCH_PORT_BASE={args.port_base}",
           f"BENCH_UPDATE={out / 'section.md'}"]
    with open(out / "make.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def table(results: dict[str, dict]) -> str:
    settings = list(results)
    first = results[settings[0]]
    s = first["settings"]
    levels = [lvl["concurrency"] for lvl in first["levels"]]
    rate = {k: {lvl["concurrency"]: lvl["summary"]["output_tokens_per_s"] for lvl in r["levels"]}
            for k, r in results.items()}
    errors = sum(lvl["summary"]["errors"] for r in results.values() for lvl in r["levels"])
    lines = [f"Output tokens/s through the gateway, one stack per draft length (SPECSERVE_DRAFT_LENGTH; 0 = plain "
             f"decoding), n-gram draft, {s['requests']} streamed chat requests per level, max {s['max_tokens']} "
             f"tokens, temperature {s['temperature']:g}, median of {s['repeats']} repeats; {errors} errors in all. "
             f"{stamp(first['meta'])}.", "",
             "| concurrency | " + " | ".join(f"k = {k}" if k != "adaptive" else k for k in settings) + " |",
             "| --- |" + " --- |" * len(settings)]
    for c in levels:
        plain = rate.get("0", {}).get(c)
        cells = []
        for k in settings:
            v = rate[k].get(c)
            ratio = f" ({v / plain:.2f}x)" if plain and v is not None and k != "0" else ""
            cells.append("n/a" if v is None else f"{v:.1f}{ratio}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="0,2,4,adaptive", help="comma-separated draft lengths (0 = plain)")
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port-base", type=int, default=51150)
    ap.add_argument("--out", type=Path, default=Path("bench-out/load-compare"))
    ap.add_argument("--no-run", action="store_true", help="only tabulate OUT/<setting>/load.json")
    ap.add_argument("--update", type=Path, help="rewrite the bench_load_compare section of this Markdown file")
    args = ap.parse_args()
    settings = [x.strip() for x in args.settings.split(",") if x.strip()]
    results = {}
    for setting in settings:
        out = (args.out / setting).resolve()
        if not args.no_run:
            run_setting(setting, out, args)
        results[setting] = json.loads((out / "load.json").read_text())
    body = table(results)
    print(body)
    if args.update:
        update_section(args.update, "bench_load_compare", body)


if __name__ == "__main__":
    main()
