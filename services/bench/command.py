"""The `specserve bench` command line: `bench spec` (Spec-Bench speedups side by side with the
Hugging Face peers) and `bench load` (a load test of a running gateway). Each writes
OUT/<name>.json (every raw number, machine, commit, date), OUT/<name>.md and OUT/<name>.png."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from services.common.settings import WEIGHT_FORMATS
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH

SPEC_SECTION, LOAD_SECTION = "bench_spec", "bench_load"


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"SPECSERVE_{name}", default)


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_bench_parser(sub, add_model_args) -> None:
    b = sub.add_parser("bench", help="benchmarks: Spec-Bench speedups (spec) and gateway load tests (load)")
    kinds = b.add_subparsers(dest="bench", required=True)

    s = kinds.add_parser("spec", help="speedup, MAL and acceptance per Spec-Bench category, with peers")
    add_model_args(s)
    s.add_argument("--questions", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    s.add_argument("--categories", type=_csv, default=None, help="comma-separated categories (default: all)")
    s.add_argument("--limit", type=int, default=None, help="at most N questions per category (default: all)")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, with the token identity check")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=0, help="question i samples with seed + i (temperature > 0)")
    s.add_argument("--draft", default=_env("DRAFT", "ngram"),
                   help="none | ngram | self | default (the committed draft of the default target) | PATH "
                        "(a draft checkpoint or a feature head), or several comma-separated, run side by side "
                        "[SPECSERVE_DRAFT, default: ngram]")
    s.add_argument("--draft-length", default="4",
                   help="k per step, adaptive, or a comma-separated list run side by side, e.g. 0,2,4,adaptive "
                        "(default: 4)")
    s.add_argument("--tree-size", type=int, default=None, help="draft nodes per step (default: k, a chain)")
    s.add_argument("--max-draft-length", type=int,
                   default=int(_env("MAX_DRAFT_LENGTH", str(DEFAULT_MAX_DRAFT_LENGTH))),
                   help=f"largest k adaptive may choose [SPECSERVE_MAX_DRAFT_LENGTH, default: {DEFAULT_MAX_DRAFT_LENGTH}]")
    s.add_argument("--plain-weights", type=_csv, default=[],
                   help="also plain decoding on these weight formats of the target, side by side (e.g. float32 "
                        "beside native)")
    s.add_argument("--json-schema", default=None,
                   help="structured output: answers follow this JSON Schema (a file, inline JSON, or 'object' "
                        "for any JSON object); the peers, which take no grammar, are left out")
    s.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    s.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up run of each decoder")
    s.add_argument("--peers", type=_csv, default=["hf"],
                   help="peers run side by side with this engine, comma-separated: hf (transformers on the same "
                        "weights), llamacpp (llama.cpp on the same GGUF file; build it once with `make peers`) "
                        "(default: hf)")
    s.add_argument("--no-peers", action="store_true", help="no peers (the same as --peers '')")
    s.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for spec.{json,md,png}")
    s.add_argument("--update", type=Path, default=None,
                   help=f"also rewrite the {SPEC_SECTION} section of this Markdown file (BENCHMARKS.md)")
    s.add_argument("--no-progress", action="store_true")

    ld = kinds.add_parser("load", help="requests/s, tokens/s, TTFT, ITL, latency per concurrency level")
    ld.add_argument("--url", default=_env("BENCH_URL", "http://127.0.0.1:8000"),
                    help="the gateway's HTTP URL [SPECSERVE_BENCH_URL, default: http://127.0.0.1:8000]")
    ld.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels (default: 1,2,4,8,16)")
    ld.add_argument("--requests", type=int, default=32, help="requests per level and repeat (default: 32)")
    ld.add_argument("--max-tokens", type=int, default=128)
    ld.add_argument("--temperature", type=float, default=0.0)
    ld.add_argument("--ignore-eos", action="store_true", help="generate exactly max tokens per request")
    ld.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ld.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    ld.add_argument("--api-key", default=_env("API_KEY", None),
                    help="bearer key for the gateway [SPECSERVE_API_KEY, default: none]")
    src = ld.add_mutually_exclusive_group()
    src.add_argument("--questions", default=None, help="Spec-Bench JSONL: first turns as prompts")
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    ld.add_argument("--limit", type=int, default=None, help="with --questions: at most N per category")
    ld.add_argument("--repeats", type=int, default=1, help="repeats per level; rates are medians")
    ld.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    ld.add_argument("--wait", type=float, default=0.0,
                    help="first wait up to this many seconds for GET /health (default: 0, no wait)")
    ld.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for load.{json,md,png}")
    ld.add_argument("--update", type=Path, default=None,
                    help=f"also rewrite the {LOAD_SECTION} section of this Markdown file (BENCHMARKS.md)")
    ld.add_argument("--no-progress", action="store_true")


def cmd_bench(args, argv: list[str] | None = None) -> int:
    return {"spec": cmd_spec, "load": cmd_load}[args.bench](args, argv or sys.argv[1:])


def _write(out: Path, name: str, result: dict, markdown: str, chart, update: Path | None, section: str) -> None:
    from services.bench.report import update_section, write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", result)
    (out / f"{name}.md").write_text(markdown)
    chart(result, out / f"{name}.png")
    if update is not None:
        update_section(update, section, markdown)
    print(markdown)
    print(f"wrote {out / name}.json, .md, .png" + (f"; updated {update}" if update else ""), file=sys.stderr)


def cmd_spec(args, argv: list[str]) -> int:
    from services.bench.chart import spec_chart
    from services.bench.decoders import build_decoders, parse_draft_lengths
    from services.bench.questions import load_questions
    from services.bench.report import meta, spec_markdown
    from services.bench.spec import SpecSettings, run_spec
    from services.common.loading import load_model
    from services.common.prompt import encode_prompt

    settings = SpecSettings(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, repeats=args.repeats, warmup=not args.no_warmup,
                            grammar=_json_schema(args.json_schema))
    settings.validate()
    lengths = parse_draft_lengths(args.draft_length)
    if args.tree_size is not None and args.tree_size < 0:
        raise ValueError(f"--tree-size must be >= 0, got {args.tree_size}")
    if args.max_draft_length < 1:
        raise ValueError(f"--max-draft-length must be >= 1, got {args.max_draft_length}")
    questions = load_questions(args.questions, args.categories, args.limit)
    bad = [f for f in args.plain_weights if f not in WEIGHT_FORMATS or f == args.weights]
    if bad:
        raise ValueError(f"--plain-weights: {bad[0]!r} is not another of {', '.join(WEIGHT_FORMATS)}")
    peers = () if args.no_peers else tuple(args.peers)
    target = load_model(args.target, device=args.device, dtype=args.dtype, weight_format=args.weights)
    kept, prompts, skipped = [], [], []
    for q in questions:
        ids = encode_prompt(target.tokenizer, q.text, chat=True)
        if len(ids) + settings.max_tokens > target.config.max_positions:
            skipped.append({"question_id": q.question_id, "category": q.category, "prompt_tokens": len(ids)})
            continue
        kept.append(q)
        prompts.append(ids)
    if skipped:
        print(f"skipping {len(skipped)} questions whose prompt + max tokens exceed the context of "
              f"{target.config.max_positions}", file=sys.stderr)
    if not kept:
        raise ValueError("no question fits the target's context with --max-tokens")
    ds = build_decoders(target, args.draft, lengths, args.tree_size, device=args.device, dtype=args.dtype,
                        peers=peers if settings.grammar is None else (), max_draft_length=args.max_draft_length,
                        weight_format=args.weights, plain_formats=tuple(args.plain_weights))
    if settings.grammar is not None and peers:
        ds.not_applicable["peers"] = "the peers take no grammar (--json-schema)"
    result = {"meta": meta(["specserve", *argv]), "target": args.target, "draft": args.draft,
              "questions_file": str(args.questions), "skipped": skipped}
    result.update(run_spec(kept, prompts, ds.decoders, settings, ds.not_applicable, progress=not args.no_progress))
    _write(args.out, "spec", result, spec_markdown(result), spec_chart, args.update, SPEC_SECTION)
    return 0 if result["identity"]["identical"] or not result["identity"]["checked"] else 1


def _json_schema(value: str | None):
    """--json-schema: None, 'object', inline JSON or a file's text, as a grammar (checked later)."""
    from services.common.grammar import JSON_OBJECT, Grammar

    if value is None:
        return None
    if value == "object":
        return Grammar("json_schema", JSON_OBJECT)
    if value.lstrip().startswith("{"):
        return Grammar("json_schema", value)
    try:
        return Grammar("json_schema", Path(value).read_text())
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {value}: {e.strerror or e}") from None


def cmd_load(args, argv: list[str]) -> int:
    import asyncio

    from services.bench.chart import load_chart
    from services.bench.load import DEFAULT_PROMPTS, LoadSettings, parse_concurrency, run_load, wait_healthy
    from services.bench.questions import load_questions
    from services.bench.report import load_markdown, meta

    if args.questions:
        prompts = [q.text for q in load_questions(args.questions, None, args.limit)]
        source = f"{args.questions} (first turns)"
    elif args.prompt:
        prompts, source = list(args.prompt), "--prompt"
    else:
        prompts, source = list(DEFAULT_PROMPTS), "built-in prompts"
    settings = LoadSettings(url=args.url, concurrency=parse_concurrency(args.concurrency), requests=args.requests,
                            max_tokens=args.max_tokens, temperature=args.temperature, endpoint=args.endpoint,
                            model=args.model, api_key=args.api_key, repeats=args.repeats, timeout_s=args.timeout,
                            ignore_eos=args.ignore_eos, prompts=source)
    settings.validate()

    async def go() -> dict:
        if args.wait > 0:
            await wait_healthy(args.url, args.wait)
        return await run_load(settings, prompts, progress=not args.no_progress)

    result = {"meta": meta(["specserve", *argv])}
    result.update(asyncio.run(go()))
    _write(args.out, "load", result, load_markdown(result), load_chart, args.update, LOAD_SECTION)
    if not any(lvl["summary"]["completed"] for lvl in result["levels"]):
        print("specserve: error: no request succeeded (see the errors above)", file=sys.stderr)
        return 1
    return 0
