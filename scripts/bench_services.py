"""Benchmark: the price of the network hops, and batching across streams.

Starts the whole stack with `scripts/run_stack.py` (default model, the same draft configuration
as the in-process engine here), then, on Spec-Bench questions (first turn, chat template, greedy):

1. single stream: tokens/s through the gateway (HTTP streaming) against the in-process engine,
   run back to back per question in alternating order, median of the per-repeat ratios;
2. concurrency: aggregate output tokens/s of 8 (and 16) simultaneous streams against one stream.

    python scripts/bench_services.py --questions ../shared/bench/spec_bench_dev.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench import questions as _questions, report as _report  # noqa: E402
from services.bench.load import wait_healthy  # noqa: E402
from services.bench.report import update_section  # noqa: E402


def load_questions(path: Path, per_category: int) -> list[dict]:
    return [{"question_id": q.question_id, "category": q.category, "turns": [q.text]}
            for q in _questions.load_questions(path, limit=per_category)]


def commit() -> str:
    return _report.commit()["commit"]


def machine() -> str:
    return _report.machine_line(_report.machine())


from services.common.prompt import encode_prompt  # noqa: E402
from services.common.loading import load_model  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from services.draft.ngram import NgramProposer  # noqa: E402
from services.scheduler.core import StepConfig  # noqa: E402
from services.scheduler.engine import Engine  # noqa: E402

DRAFT_LENGTH = 4


async def stream_chat(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds) of one streamed chat completion."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - started


def start_stack(http_port: int, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    env.update(extra_env)
    env.update({"SPECSERVE_HTTP_PORT": str(http_port), "SPECSERVE_DRAFT": "ngram",
                "SPECSERVE_DRAFT_LENGTH": str(DRAFT_LENGTH), "SPECSERVE_MAX_BATCH": "16"})
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run_stack.py")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{http_port}", 300, alive=lambda: proc.poll() is None))
    except RuntimeError as e:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        raise RuntimeError(f"the stack failed to start ({e}): see .run/*.log") from None
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--http-port", type=int, default=8100)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--update", type=Path, default=None)
    ap.add_argument("--section", default="bench_services", help="the BENCHMARKS.md section --update rewrites")
    ap.add_argument("--concurrency", default="1,8,16", help="comma-separated stream counts; empty: single stream only")
    ap.add_argument("--stack-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of the services only (not of the in-process engine); repeatable")
    args = ap.parse_args()
    stack_env = dict(kv.split("=", 1) for kv in args.stack_env)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]

    questions = load_questions(args.questions, args.per_category)
    target = load_model("default")
    engine_cfg = StepConfig(draft_length=DRAFT_LENGTH)
    prompts = [encode_prompt(target.tokenizer, q["turns"][0], chat=True) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens)
    url = f"http://127.0.0.1:{args.http_port}"
    proc = start_stack(args.http_port, stack_env)
    try:
        async def run_all():
            async with httpx.AsyncClient() as client:
                await stream_chat(client, url, questions[0]["turns"][0], 8)  # warm-up
                single = {"engine": [], "gateway": []}  # per repeat: (tokens, seconds)
                for rep in range(args.repeats):
                    tot = {"engine": [0, 0.0], "gateway": [0, 0.0]}
                    for i, (q, ids) in enumerate(zip(questions, prompts)):
                        order = ["engine", "gateway"] if (i + rep) % 2 == 0 else ["gateway", "engine"]
                        for name in order:
                            if name == "engine":
                                t0 = time.perf_counter()
                                req = Engine(target, NgramProposer(), engine_cfg).generate([ids], params)[0]
                                n, s = len(req.output_ids), time.perf_counter() - t0
                            else:
                                n, s = await stream_chat(client, url, q["turns"][0], args.max_tokens)
                            tot[name][0] += n
                            tot[name][1] += s
                    for name in tot:
                        single[name].append(tot[name])
                    print(f"single-stream repeat {rep + 1}/{args.repeats} done", flush=True)
                conc = {}
                for c in levels:
                    rates = []
                    for rep in range(args.repeats):
                        contents = [questions[(rep + j) % len(questions)]["turns"][0] for j in range(c)]
                        t0 = time.perf_counter()
                        res = await asyncio.gather(*(stream_chat(client, url, m, args.max_tokens) for m in contents))
                        rates.append(sum(n for n, _ in res) / (time.perf_counter() - t0))
                    conc[c] = statistics.median(rates)
                    print(f"concurrency {c}: {conc[c]:.1f} tokens/s", flush=True)
                return single, conc

        single, conc = asyncio.run(run_all())
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)

    ratio = statistics.median(g[0] / g[1] / (e[0] / e[1]) for e, g in zip(single["engine"], single["gateway"]))
    tps = {k: statistics.median(n / s for n, s in v) for k, v in single.items()}
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
            "questions": len(questions), "max_tokens": args.max_tokens, "repeats": args.repeats,
            "stack_env": stack_env}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_services.json").write_text(json.dumps(
        {"meta": meta, "single": single, "single_ratio": ratio, "concurrency": conc}, indent=1))
    lines = [f"Default model, n-gram draft k={DRAFT_LENGTH}, {meta['questions']} Spec-Bench dev questions (chat, "
             f"greedy, max {meta['max_tokens']} tokens), median of {meta['repeats']} repeats. {meta['date']}, "
             f"commit {meta['commit']}, {meta['machine']}. The services share the machine's 2 cores"
             + (f"; services' environment {stack_env}" if stack_env else "") + ".", "",
             "| measure | value |", "| --- | --- |",
             f"| in-process engine, one stream | {tps['engine']:.1f} tokens/s |",
             f"| through the gateway (HTTP SSE), one stream | {tps['gateway']:.1f} tokens/s |",
             f"| gateway / in-process | {ratio:.2f} |"]
    for c, rate in conc.items():
        if c != 1 and 1 in conc:
            lines.append(f"| {c} concurrent streams, aggregate | {rate:.1f} tokens/s ({rate / conc[1]:.2f}x one stream) |")
        else:
            lines.append(f"| {c} concurrent streams, aggregate | {rate:.1f} tokens/s |")
    table = "\n".join(lines)
    print(table)
    if args.update:
        update_section(args.update, args.section, table)


if __name__ == "__main__":
    main()
