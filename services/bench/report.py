"""Benchmark reports: run metadata (machine, commit, date), the JSON file, Markdown tables, and
rewriting a marked section of BENCHMARKS.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

from services.bench.decoders import HF_PLAIN, LLAMACPP, LLAMACPP_PLAIN, PLAIN
from services.bench.spec import ALL
from services.common.machine import cpu_model

REPO = Path(__file__).resolve().parents[2]


def machine() -> dict:
    """What ran the benchmark: CPU, cores, torch threads, accelerator, library versions."""
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        pass
    return info


def machine_line(m: dict) -> str:
    parts = [m.get("gpu") or m["cpu"], f"{m['cores']} cores"]
    if "torch" in m:
        parts += [f"{m['torch_threads']} torch threads", f"torch {m['torch']}"]
    return ", ".join(parts) + f", Python {m['python']}"


def commit() -> dict:
    """The repository's HEAD (short hash) and whether the working tree had changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return {"commit": head, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def meta(argv: list[str] | None = None) -> dict:
    c = commit()
    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **c,
            "machine": machine(), "argv": redact(list(argv or []))}


def redact(argv: list[str]) -> list[str]:
    """The command line with secrets (the value of --api-key) replaced by ***."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def stamp(m: dict) -> str:
    dirty = " (with uncommitted changes)" if m.get("dirty") else ""
    return f"{m['date'][:10]}, commit {m['commit']}{dirty}, {machine_line(m['machine'])}"


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def update_section(path: Path, name: str, body: str) -> None:
    """Replace the text between `<!-- name:begin -->` and `<!-- name:end -->` (append the markers
    and the body at the end when they are missing)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)


def _f(x: float | None, fmt: str = "{:.2f}", na: str = "n/a") -> str:
    return na if x is None else fmt.format(x)


def _grammar(settings: dict) -> str:
    g = settings.get("grammar")
    return f", answers constrained to the {g['kind']} `{g['source']}`" if g else ""


def spec_markdown(result: dict) -> str:
    s, m = result["settings"], result["meta"]
    cats = [g for g in result["summary"] if g != ALL]
    n = len(result["questions"])
    llamacpp = any(c["engine"] == LLAMACPP for c in result["configs"])
    lines = [f"Spec-Bench: {n} questions ({', '.join(cats)}; first turn, chat template), target "
             f"{result['target']}, draft {result['draft']}, temperature {s['temperature']:g}, max "
             f"{s['max_tokens']} tokens{_grammar(s)}, median of {s['repeats']} interleaved repeats. {stamp(m)}.", "",
             "| configuration | engine | tokens/s | speedup | x HF generate |" + (" x llama.cpp |" if llamacpp else "")
             + " MAL | acceptance |",
             "| --- | --- | --- | --- | --- |" + (" --- |" if llamacpp else "") + " --- | --- |"]
    overall = result["summary"][ALL]
    for c in result["configs"]:
        o = overall[c["name"]]
        x_llamacpp = f" {_f(o.get('x_llamacpp'))} |" if llamacpp else ""
        lines.append(f"| {c['name']} | {c['engine']} | {_f(o['tokens_per_s'], '{:.1f}')} | {_f(o['speedup'])} | "
                     f"{_f(o['x_hf_generate'])} |{x_llamacpp} {_f(o['mal'])} | {_f(o['acceptance_rate'])} |")
    for name, why in result["not_applicable"].items():
        lines.append(f"| {name} | {LLAMACPP if name.startswith('llamacpp') else 'hf'} | n/a | n/a | n/a |"
                     + (" n/a |" if llamacpp else "") + f" n/a | n/a ({why}) |")
    notes = [f"{c['name']} {c['note']}" for c in result["configs"] if c.get("note")]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    spec = [c["name"] for c in result["configs"] if c["name"] not in (PLAIN, HF_PLAIN, LLAMACPP_PLAIN)]
    if spec:
        lines += ["", "Speedup over the same engine's plain decoding (MAL), per category:", "",
                  "| category | questions | " + " | ".join(spec) + " |",
                  "| --- | --- |" + " --- |" * len(spec)]
        for g in [*cats, ALL]:
            row = result["summary"][g]
            cells = [f"{_f(row[n_]['speedup'])}x ({_f(row[n_]['mal'])})" if row[n_]["speedup"] is not None
                     else "n/a" for n_ in spec]
            label = f"**{g}**" if g == ALL else g
            lines.append(f"| {label} | {row[spec[0]]['questions']} | " + " | ".join(cells) + " |")
    lines += ["", identity_line(result)]
    if result.get("errors"):
        lines += ["", f"Errors ({len(result['errors'])} runs, left out of the numbers): " + "; ".join(
            f"question {e['question_id']} {e['config']}: {e['error']}" for e in result["errors"][:3])]
    return "\n".join(lines) + "\n"


def identity_line(result: dict) -> str:
    ident = result["identity"]
    if not ident["checked"]:
        return "Token identity: not checked (temperature > 0: outputs are samples)."
    n, k = len(result["questions"]), len(result["configs"])
    text = f"Token identity at temperature 0 (reference: {ident['reference']}, or the plain decoder on the same weights): "
    seen = {}
    for mm in ident["mismatches"]:
        seen.setdefault((mm["question_id"], mm["config"]), mm)
    if not seen:
        text += f"all {k} configurations produced the tokens of their reference on all {n} prompts"
    else:
        count = (f"{len(seen)} differences (peers only: this engine's configurations all matched)"
                 if ident["identical"] else f"**{len(seen)} differences**")
        text += count + ": " + "; ".join(
            f"question {q} {c} at token {mm['position']} ({mm['got']} instead of {mm['expected']})"
            for (q, c), mm in seen.items())
    if ident["length_differences"]:
        text += f"; {len(ident['length_differences'])} runs equal over the common length but of another length"
    for key, peer in (("plain_vs_hf", "HF generate's"), ("plain_vs_llamacpp", "llama.cpp's plain")):
        cross = ident.get(key)
        if cross and cross["identical"] < cross["questions"]:
            at = ", ".join(str(p) for p in sorted(cross["first_difference_at"]))
            text += (f". This engine's plain decoding (its weights as loaded) gave {peer} tokens on "
                     f"{cross['identical']} of {cross['questions']} prompts (first differences at tokens {at or '-'})")
    return text + "."


def load_markdown(result: dict) -> str:
    s, m = result["settings"], result["meta"]
    lines = [f"`specserve bench load` against {s['url']} ({s['endpoint']}, model {s['model']}): {s['requests']} "
             f"requests per level, max {s['max_tokens']} tokens, temperature {s['temperature']:g}, prompts "
             f"from {s['prompts']}; median of {s['repeats']} repeats for rates, percentiles over every "
             f"request. {stamp(m)}.", "",
             "| concurrency | requests | errors | requests/s | output tokens/s | TTFT P50 / P99 ms | "
             "ITL P50 / P99 ms | E2E P50 / P99 ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ms = "{:.0f}"
    for lvl in result["levels"]:
        x = lvl["summary"]
        lines.append(
            f"| {lvl['concurrency']} | {x['requests']} | {x['errors']} | {_f(x['requests_per_s'])} | "
            f"{_f(x['output_tokens_per_s'], '{:.1f}')} | {_f(_ms(x['ttft_p50_s']), ms)} / {_f(_ms(x['ttft_p99_s']), ms)} | "
            f"{_f(_ms(x['itl_p50_s']), '{:.1f}')} / {_f(_ms(x['itl_p99_s']), '{:.1f}')} | "
            f"{_f(_ms(x['e2e_p50_s']), ms)} / {_f(_ms(x['e2e_p99_s']), ms)} |")
    errors = [e for lvl in result["levels"] for e in lvl["summary"]["error_examples"]]
    if errors:
        lines += ["", "Errors (first of each level): " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000
