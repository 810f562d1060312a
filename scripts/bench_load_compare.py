"""Benchmark: plain decoding, static draft lengths and the adaptive controller under load, interleaved.

One whole stack per setting (`scripts/run_stack.py` with SPECSERVE_DRAFT_LENGTH = the setting, its
own ports and its own Redis, so no stack's telemetry feeds another's priors), all started before
the first measurement and idle while another is measured. Then rounds: in each round every
concurrency level runs once against every stack, the stacks in an order that rotates from round to
round, so a drift of the machine's speed hits every setting alike. Per setting and level: output
tokens/s (median over rounds), and against plain decoding (setting 0) the median of the per-round
ratios (each measured minutes apart at most).

    python scripts/bench_load_compare.py --settings 0,2,4,adaptive --concurrency 8,16 \
        --requests 32 --repeats 3 --out bench-out/load-compare --update BENCHMARKS.md
    python scripts/bench_load_compare.py --out DIR --no-run  # tabulate DIR/compare.json again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench.load import (LoadSettings, RequestResult, parse_concurrency, run_level,  # noqa: E402
                                 served_model, stream_one, summarize_level, wait_healthy)
from services.bench.questions import load_questions  # noqa: E402
from services.bench.report import meta, stamp, update_section, write_json  # noqa: E402
from services.bench.stats import median  # noqa: E402

PORTS_PER_STACK = 10  # gateway gRPC, scheduler, draft, verifier, HTTP, Redis at base + 0..5


WHOLE = "/whole"  # a setting's suffix: prompts join whole (SPECSERVE_TARGET_ITL_MS=0, no chunked prefill)
DRAFT_SEP = "@"  # a setting's draft, before its length: models/head@adaptive (else SPECSERVE_DRAFT's)


def stack_env(setting: str, base: int, run_dir: Path, step_log: bool = False) -> dict[str, str]:
    draft, _, length = setting.removesuffix(WHOLE).rpartition(DRAFT_SEP)
    env = dict(os.environ, SPECSERVE_DRAFT_LENGTH=length, SPECSERVE_RUN_DIR=str(run_dir), SPECSERVE_METRICS_PORT="0")
    if step_log:  # each stack its own: one file per setting
        env["SPECSERVE_STEP_LOG"] = str(run_dir / "steps.jsonl")
    if draft:
        env["SPECSERVE_DRAFT"] = draft
    if setting.endswith(WHOLE):
        env["SPECSERVE_TARGET_ITL_MS"] = "0"
    for i, role in enumerate(("GATEWAY", "SCHEDULER", "DRAFT", "VERIFIER", "HTTP", "REDIS")):
        env[f"SPECSERVE_{role}_PORT"] = str(base + i)
    env.pop("REDIS_URL", None)  # each stack starts its own
    return env


def start_stacks(settings: list[str], out: Path, port_base: int, timeout_s: float,
                 procs: list[subprocess.Popen], step_log: bool = False) -> list[str]:
    """One stack per setting, each up before the next starts (a scheduler's warm-up times the
    verifier: it must not share the cores with another stack's start). Appends to `procs`."""
    urls = []
    for i, setting in enumerate(settings):
        base = port_base + PORTS_PER_STACK * i
        run_dir = (out / f"stack-{setting.replace('/', '-').replace(DRAFT_SEP, '-')}").resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "launcher.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run_stack.py")], cwd=ROOT,
                                          env=stack_env(setting, base, run_dir, step_log), stdout=f,
                                          stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{base + 4}")
        proc = procs[-1]
        try:
            asyncio.run(wait_healthy(urls[-1], timeout_s, alive=lambda: proc.poll() is None))
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log {log} ends:\n" + "\n".join(log.read_text().splitlines()[-5:])) from None
        print(f"stack {setting} up at {urls[-1]}", flush=True)
    return urls


def stop_stacks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)
        if p.poll() is None:
            p.kill()


async def measure(settings: list[str], urls: list[str], load: LoadSettings, prompts: list[str]) -> dict:
    """Every round: each level once per stack, stacks in a rotating order. Returns the model and
    per round its runs (setting, concurrency, wall seconds, request results)."""
    rounds: list[list[dict]] = []
    limits = httpx.Limits(max_connections=max(load.concurrency) + 4, max_keepalive_connections=max(load.concurrency) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(load.timeout_s)) as client:
        model = load.model or await served_model(client, urls[0])
        for url in urls:  # each stack's first request (warm-up, not counted)
            await stream_one(client, dataclasses.replace(load, url=url), model, prompts[0], 8)
        for rep in range(load.repeats):
            runs = []
            for j, level in enumerate(load.concurrency):
                shift = (rep + j) % len(settings)
                for i in list(range(len(settings)))[shift:] + list(range(shift)):
                    wall, results = await run_level(client, dataclasses.replace(load, url=urls[i]), model,
                                                    prompts, level)
                    runs.append({"setting": settings[i], "concurrency": level, "wall_s": wall,
                                 "requests": [dataclasses.asdict(r) for r in results]})
                    tps = _tokens_per_s(wall, results)
                    print(f"round {rep + 1} concurrency {level} setting {settings[i]}: {tps:.1f} tok/s", flush=True)
            rounds.append(runs)
    return {"model": model, "rounds": rounds}


def _tokens_per_s(wall_s: float, results: list[RequestResult]) -> float:
    return sum(r.tokens for r in results if r.ok) / wall_s


def summarize(result: dict) -> dict:
    """{setting: {level: {"tokens_per_s", "ratio" (median per-round ratio to setting 0), "errors",
    "rounds"}}}."""
    per: dict[str, dict[int, list]] = {}
    for runs in result["rounds"]:
        for run in runs:
            reqs = [RequestResult(**r) for r in run["requests"]]
            per.setdefault(run["setting"], {}).setdefault(run["concurrency"], []).append((run["wall_s"], reqs))
    out: dict[str, dict[int, dict]] = {}
    for setting, levels in per.items():
        for level, reps in levels.items():
            s = summarize_level(reps)
            tps = [_tokens_per_s(wall, rs) for wall, rs in reps]
            plain = [_tokens_per_s(wall, rs) for wall, rs in per.get("0", {}).get(level, [])]
            ratio = median([a / b for a, b in zip(tps, plain) if b]) if setting != "0" and plain else None
            out.setdefault(setting, {})[level] = {"tokens_per_s": s["output_tokens_per_s"], "ratio": ratio,
                                                  "errors": s["errors"], "rounds": [round(t, 1) for t in tps],
                                                  **{k: s[k] for k in LATENCIES}}
    return out


LATENCIES = ("requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def _label(setting: str) -> str:
    draft, _, k = setting.removesuffix(WHOLE).rpartition(DRAFT_SEP)
    return ((f"{draft} " if draft else "") + (f"k = {k}" if k != "adaptive" else k)
            + (", whole prompts" if setting.endswith(WHOLE) else ""))


def latency_table(result: dict) -> str:
    """Requests/s, TTFT and ITL percentiles per setting and level (over every request of every round)."""
    settings, s = result["settings_list"], result["load"]
    summary = summarize(result)
    lines = ["| concurrency | setting | requests/s | TTFT P50 / P99 ms | ITL P50 / P99 ms |",
             "| --- | --- | --- | --- | --- |"]
    for c in s["concurrency"]:
        for k in settings:
            v = summary.get(k, {}).get(c)
            if v is None:
                continue
            ms = {name: 1e3 * (v[name] or 0.0) for name in LATENCIES[1:]}
            lines.append(f"| {c} | {_label(k)} | {v['requests_per_s']:.2f} | {ms['ttft_p50_s']:.0f} / "
                         f"{ms['ttft_p99_s']:.0f} | {ms['itl_p50_s']:.1f} / {ms['itl_p99_s']:.1f} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    settings, s = result["settings_list"], result["load"]
    summary = summarize(result)
    errors = sum(v["errors"] for lv in summary.values() for v in lv.values())
    lines = [f"Output tokens/s through the gateway, one stack per setting (a draft length, SPECSERVE_DRAFT_LENGTH; "
             f"0 = plain decoding), all stacks up at once and measured in turn, {s['repeats']} rounds in rotating "
             f"order; the draft a setting names before {DRAFT_SEP}, else the n-gram, {s['requests']} streamed "
             f"chat requests per level and round, max {s['max_tokens']} "
             f"tokens, temperature {s['temperature']:g}; median over rounds, (x) the median of the per-round "
             f"ratios to plain decoding; {errors} errors in all. {stamp(result['meta'])}.", "",
             "| concurrency | " + " | ".join(_label(k) for k in settings) + " |",
             "| --- |" + " --- |" * len(settings)]
    for c in s["concurrency"]:
        cells = []
        for k in settings:
            v = summary.get(k, {}).get(c)
            ratio = f" ({v['ratio']:.2f}x)" if v and v["ratio"] is not None else ""
            cells.append("n/a" if v is None else f"{v['tokens_per_s']:.1f}{ratio}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + latency_table(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="0,2,4,adaptive",
                    help=f"comma-separated draft lengths (0 = plain), each may start with a draft and {DRAFT_SEP} "
                         f"(models/head{DRAFT_SEP}adaptive) and end in {WHOLE}: no chunked prefill")
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--questions", type=Path, default=ROOT.parent / "shared" / "bench" / "spec_bench_dev.jsonl",
                    help="Spec-Bench JSONL: one first turn per category as the prompts")
    ap.add_argument("--port-base", type=int, default=51150)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for each stack to come up")
    ap.add_argument("--out", type=Path, default=Path("bench-out/load-compare"))
    ap.add_argument("--no-run", action="store_true", help="only tabulate OUT/compare.json")
    ap.add_argument("--step-logs", action="store_true",
                    help="each scheduler logs its steps (--step-log) to OUT/stack-<setting>/steps.jsonl")
    ap.add_argument("--update", type=Path, help="rewrite the bench_load_compare section of this Markdown file")
    ap.add_argument("--section", default="bench_load_compare", help="the section --update rewrites")
    args = ap.parse_args()
    path = args.out / "compare.json"
    if args.no_run:
        result = json.loads(path.read_text())
    else:
        settings = [x.strip() for x in args.settings.split(",") if x.strip()]
        prompts = [q.text for q in load_questions(args.questions, None, 1)]
        load = LoadSettings(url="http://unused", concurrency=parse_concurrency(args.concurrency), requests=args.requests,
                            max_tokens=args.max_tokens, repeats=args.repeats, prompts=f"{args.questions} (first turns)")
        load.validate()
        result = {"meta": meta(sys.argv), "settings_list": settings,
                  "load": {k: v for k, v in dataclasses.asdict(load).items() if k != "url"}}
        procs: list[subprocess.Popen] = []
        try:
            urls = start_stacks(settings, args.out, args.port_base, args.startup_timeout, procs, args.step_logs)
            result.update(asyncio.run(measure(settings, urls, load, prompts)))
        finally:
            stop_stacks(procs)
        write_json(path, result)
    body = table(result)
    print(body)
    if args.update:
        update_section(args.update, args.section, body)


if __name__ == "__main__":
    main()
