"""The `specserve` command line: `generate` runs the engine in-process; `prepare` readies a model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from services.bench.command import add_bench_parser, cmd_bench
from services.common.settings import ROLES, WEIGHT_FORMATS, add_role_options
from services.draft.factory import DRAFT_CHOICES
from services.scheduler.policy import DEFAULT_MAX_DRAFT_LENGTH


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPECSERVE_{name}", default)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=_env("TARGET", "default"),
                   help="target model: 'default' (SmolLM2-135M-Instruct), a .gguf file or a "
                        "checkpoint directory [SPECSERVE_TARGET, default: default]")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), choices=["cpu", "cuda", "auto"],
                   help="[SPECSERVE_DEVICE, default: cpu]")
    p.add_argument("--dtype", default=_env("DTYPE", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto = float32 on cpu, bfloat16 on cuda "
                        "[SPECSERVE_DTYPE, default: auto]")
    p.add_argument("--weights", default=_env("WEIGHTS", "native"), choices=list(WEIGHT_FORMATS),
                   help="native: a GGUF model's Q4_0/Q4_1/Q8_0 weights run as stored (int4 matmul, "
                        "CPU); float32: dequantized at load [SPECSERVE_WEIGHTS, default: native]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process (draft and verifier embedded)")
    _add_model_args(g)
    g.add_argument("--draft", default=_env("DRAFT", "ngram"),
                   help=f"{DRAFT_CHOICES} [SPECSERVE_DRAFT, default: ngram]")
    g.add_argument("--compression-ratio", type=float, default=float(_env("COMPRESSION_RATIO", "0.2")),
                   help="SlimSpec: fraction of the vocabulary a model draft's LM head keeps, 0.1 to 0.5 "
                        "(1.0 = full head) [SPECSERVE_COMPRESSION_RATIO, default: 0.2]")
    g.add_argument("--slim-guard-points", type=float, default=float(_env("SLIM_GUARD_POINTS", "5")),
                   help="SlimSpec guard: fall back to the full head when acceptance drops more than this "
                        "many points below it [SPECSERVE_SLIM_GUARD_POINTS, default: 5]")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help='a JSONL file with lines {"prompt": "..."}')
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--draft-length", type=draft_length_arg, default=_env("DRAFT_LENGTH", "adaptive"),
                   help="k, the draft depth per step, or adaptive: chosen per request and step from "
                        "measured acceptance and latency [SPECSERVE_DRAFT_LENGTH, default: adaptive]")
    g.add_argument("--min-draft-length", type=int, default=int(_env("MIN_DRAFT_LENGTH", "0")),
                   help="smallest k adaptive may choose (0 = may not draft) [SPECSERVE_MIN_DRAFT_LENGTH, default: 0]")
    g.add_argument("--max-draft-length", type=int,
                   default=int(_env("MAX_DRAFT_LENGTH", str(DEFAULT_MAX_DRAFT_LENGTH))),
                   help=f"largest k adaptive may choose [SPECSERVE_MAX_DRAFT_LENGTH, default: {DEFAULT_MAX_DRAFT_LENGTH}]")
    g.add_argument("--adjust-interval-ms", type=float, default=float(_env("ADJUST_INTERVAL_MS", "0")),
                   help="adaptive re-plans at most this often (0 = every step) "
                        "[SPECSERVE_ADJUST_INTERVAL_MS, default: 0]")
    g.add_argument("--tree-size", type=int, default=None,
                   help="draft nodes per step; equal to --draft-length = a chain "
                        "[SPECSERVE_TREE_SIZE, default: the draft length]")
    g.add_argument("--max-batch", type=int, default=16, help="requests per step")
    g.add_argument("--max-step-tokens", type=int, default=int(_env("MAX_STEP_TOKENS", "0")),
                   help="rows one verify forward may take, decode rows first, then prompt chunks (0 = no limit) "
                        "[SPECSERVE_MAX_STEP_TOKENS, default: 0]")
    g.add_argument("--target-itl-ms", type=float, default=float(_env("TARGET_ITL_MS", "200")),
                   help="while requests decode, prompts join in chunks that fit this step time (0 = whole) "
                        "[SPECSERVE_TARGET_ITL_MS, default: 200]")
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    p = sub.add_parser("prepare", help="dequantize and cache a model, write its manifest")
    _add_model_args(p)

    s = sub.add_parser("serve", help="run one service: draft, verifier, scheduler or gateway")
    roles = s.add_subparsers(dest="role", required=True)
    for role in ROLES:
        add_role_options(roles.add_parser(role, help=f"the {role} service"), role)

    add_bench_parser(sub, _add_model_args)
    return parser


def draft_length_arg(value: str) -> int | str:
    """--draft-length: a non-negative integer or 'adaptive'."""
    if value == "adaptive":
        return value
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'adaptive', got {value!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {k}")
    return k


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    with open(args.prompts, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                obj = json.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{args.prompts}:{n}: expected {{\"prompt\": \"...\"}}")
                prompts.append(obj["prompt"])
    return prompts


def cmd_generate(args) -> int:
    from services.common.loading import load_model
    from services.common.prompt import encode_prompt
    from services.common.sampling import SamplingParams
    from services.draft.factory import build_proposer
    from services.scheduler.core import StepConfig
    from services.scheduler.engine import Engine

    tree_size = args.tree_size
    if tree_size is None and os.environ.get("SPECSERVE_TREE_SIZE"):
        tree_size = int(os.environ["SPECSERVE_TREE_SIZE"])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    params.validate()
    config = StepConfig(draft_length=args.draft_length, tree_size=tree_size, max_batch=args.max_batch,
                          min_draft_length=args.min_draft_length, max_draft_length=args.max_draft_length,
                          adjust_interval_ms=args.adjust_interval_ms, max_step_tokens=args.max_step_tokens,
                          target_itl_ms=args.target_itl_ms)
    config.validate()
    prompts = _read_prompts(args)
    t0 = time.perf_counter()
    target = load_model(args.target, device=args.device, dtype=args.dtype, weight_format=args.weights)
    proposer = build_proposer(args.draft, target, device=args.device, dtype=args.dtype, weight_format=args.weights,
                              compression_ratio=args.compression_ratio, guard_points=args.slim_guard_points)
    engine = Engine(target, proposer, config, draft_name=args.draft)  # the latency warm-up runs here
    load_s = time.perf_counter() - t0
    warm = engine.warmed
    print(f"[loaded in {load_s:.1f} s" + (f", latency warm-up {warm.seconds:.1f} s"
                                          f"{' (cached)' if warm.cached else ''}" if warm else "") + "]",
          file=sys.stderr)
    encoded = [encode_prompt(target.tokenizer, p, args.chat) for p in prompts]
    for req in engine.generate(encoded, params):
        s = req.summary()
        if args.json:
            print(json.dumps({**s, "load_s": load_s}), flush=True)
        else:
            print(s["text"], flush=True)
            print(f"[{s['completion_tokens']} tokens, {s['steps']} steps, MAL "
                  f"{s['mean_accepted_length']:.2f}, acceptance {s['acceptance_rate']:.2f}, "
                  f"{s['tokens_per_s']:.1f} tokens/s, finish {s['finish_reason']}]", file=sys.stderr)
    return 0


def cmd_prepare(args) -> int:
    from services.common.loading import load_model

    m = load_model(args.target, device=args.device, dtype=args.dtype, weight_format=args.weights)
    print(f"{args.target}: {m.path} ({m.config.model_type}, {m.config.num_layers} layers, "
          f"vocab {m.config.vocab_size}, context {m.config.max_positions})")
    return 0


def cmd_serve(args) -> int:
    from services.common.logs import setup_logging
    from services.serve import serve

    setup_logging(args.role, args.log_level, args.log_format)
    serve(args.role, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "WARNING"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            return cmd_bench(args, argv)
        return {"generate": cmd_generate, "prepare": cmd_prepare, "serve": cmd_serve}[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
