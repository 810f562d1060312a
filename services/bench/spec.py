"""The speculative-decoding benchmark: every decoder on every question, interleaved.

For each repeat and question the decoders run back to back in one process, in an order that
rotates with the question and the repeat, so machine drift cancels in the ratios. Per category
(and over all questions) each decoder gets: tokens/s, speedup over its own engine's plain decoder
(plain time per token / its time per token, per repeat, then the median), MAL and acceptance rate.
At temperature 0 every decoder must produce the reference decoder's tokens: any difference is
reported with the question, the decoder and the first differing position.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from services.bench.decoders import HF_PLAIN, LLAMACPP_PLAIN, OURS, PLAIN, Decoded, Decoder, PeerError
from services.bench.questions import Question, categories_in_order
from services.bench.stats import median, ratio
from services.common.grammar import Grammar
from services.common.sampling import SamplingParams

ALL = "all"
WARMUP_TOKENS = 16


@dataclass
class SpecSettings:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # question i samples with seed + i at temperature > 0, the same in every repeat
    repeats: int = 3
    warmup: bool = True
    grammar: Grammar | None = None  # structured output: every decoder answers inside it

    def validate(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        self.params(0).validate()

    def params(self, index: int, max_tokens: int | None = None) -> SamplingParams:
        greedy = self.temperature == 0
        return SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=None if greedy else self.seed + index,
                              grammar=self.grammar)


def rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


def run_spec(questions: list[Question], prompts: list[list[int]], decoders: list[Decoder],
             settings: SpecSettings, not_applicable: dict[str, str] | None = None,
             progress: bool = True) -> dict:
    """Run every decoder on every prompt `settings.repeats` times; the result as a JSON-ready dict."""
    settings.validate()
    if len(questions) != len(prompts) or not questions:
        raise ValueError("run_spec needs one prompt per question, and at least one question")
    names = [d.name for d in decoders]
    if len(set(names)) != len(names):
        raise ValueError(f"decoder names must be unique, got {names}")
    if settings.warmup:  # first calls pay for allocations and lazy initialisation: not measured
        for d in (d for d in decoders if d.warms_up):
            d.decode(prompts[0], settings.params(0, min(WARMUP_TOKENS, settings.max_tokens)))
    runs, outputs, mismatches, length_diffs, errors = [], {}, [], [], []
    reference = PLAIN if PLAIN in names else names[0]
    refs = {d.name: d.reference if d.reference in names else reference for d in decoders}
    bar = _progress(len(questions) * len(decoders) * settings.repeats, progress)
    try:
        for rep in range(settings.repeats):
            for qi, (q, ids) in enumerate(zip(questions, prompts)):
                params = settings.params(qi)
                results: dict[str, Decoded] = {}
                for slot, d in enumerate(rotated(decoders, qi + rep)):
                    bar.set_postfix_str(f"repeat {rep + 1} q{q.question_id} {d.name}", refresh=False)
                    bar.update(1)
                    try:
                        res = d.decode(ids, params)
                    except PeerError as e:  # a peer's crash on one prompt is a row, not the end
                        errors.append({"question_id": q.question_id, "config": d.name, "repeat": rep,
                                       "error": str(e)})
                        continue
                    results[d.name] = res
                    runs.append({"question_id": q.question_id, "category": q.category, "config": d.name,
                                 "repeat": rep, "slot": slot, "prompt_tokens": len(ids),
                                 "tokens": len(res.token_ids), "elapsed_s": res.elapsed_s, "steps": res.steps,
                                 "drafted": res.drafted, "accepted": res.accepted})
                if rep == 0:
                    outputs[str(q.question_id)] = {n: r.token_ids for n, r in results.items()}
                if settings.temperature == 0:
                    seen = outputs[str(q.question_id)]
                    for n in (n for n in names if n in results and refs[n] in seen):
                        diff = compare_tokens(seen[refs[n]], results[n].token_ids)
                        if diff is not None:
                            record = {"question_id": q.question_id, "category": q.category, "config": n,
                                      "reference": refs[n], "repeat": rep, **diff}
                            (length_diffs if diff["position"] is None else mismatches).append(record)
    finally:
        bar.close()
    configs = [d.describe() for d in decoders]
    engines = {d.name: d.engine for d in decoders}
    ours_differ = any(engines[m["config"]] == OURS for m in mismatches)
    return {
        "kind": "spec",
        "settings": asdict(settings),
        "configs": configs,
        "not_applicable": dict(not_applicable or {}),
        "questions": [{"question_id": q.question_id, "category": q.category, "prompt_tokens": len(p)}
                      for q, p in zip(questions, prompts)],
        "runs": runs,
        "errors": errors,
        "outputs": outputs,
        "summary": summarize(runs, configs, categories_in_order(questions), settings.repeats),
        "identity": {"checked": settings.temperature == 0, "reference": reference,
                     # ours must be lossless; a peer that is not (llama.cpp's lookup) is reported, not failed
                     "identical": settings.temperature == 0 and not ours_differ,
                     "mismatches": mismatches, "length_differences": length_diffs,
                     "plain_vs_hf": plain_vs(outputs, HF_PLAIN) if settings.temperature == 0 else None,
                     "plain_vs_llamacpp": plain_vs(outputs, LLAMACPP_PLAIN) if settings.temperature == 0 else None},
    }


def plain_vs(outputs: dict[str, dict[str, list[int]]], peer: str) -> dict | None:
    """How often this engine's plain decoding departs from a peer's (`HF_PLAIN`: other weights when
    ours are native GGUF blocks; `LLAMACPP_PLAIN`: other kernels): questions that differ and where."""
    pairs = [(o[PLAIN], o[peer]) for o in outputs.values() if PLAIN in o and peer in o]
    if not pairs:
        return None
    diffs = [compare_tokens(theirs, ours) for ours, theirs in pairs]
    positions = [d["position"] for d in diffs if d is not None and d["position"] is not None]
    return {"questions": len(pairs), "identical": sum(d is None for d in diffs), "first_difference_at": positions}


def compare_tokens(reference: list[int], tokens: list[int]) -> dict | None:
    """None when equal; else the first differing position within the common length (with both
    tokens), or position None when one is a strict prefix of the other (lengths differ)."""
    if tokens == reference:
        return None
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return {"position": i, "expected": a, "got": b,
                    "reference_length": len(reference), "length": len(tokens)}
    return {"position": None, "expected": None, "got": None,
            "reference_length": len(reference), "length": len(tokens)}


def summarize(runs: list[dict], configs: list[dict], categories: list[str], repeats: int) -> dict:
    """{group: {config: numbers}} for every category and ALL: per-repeat sums, then medians."""
    out = {}
    for group in [*categories, ALL]:
        mine = [r for r in runs if group == ALL or r["category"] == group]
        sums = {c["name"]: [_sums([r for r in mine if r["config"] == c["name"] and r["repeat"] == rep])
                            for rep in range(repeats)] for c in configs}
        out[group] = {}
        for c in configs:
            per_rep = sums[c["name"]]
            base = sums.get(c["baseline"])
            hf, llamacpp = sums.get(HF_PLAIN), sums.get(LLAMACPP_PLAIN)
            out[group][c["name"]] = {
                "questions": len({r["question_id"] for r in mine if r["config"] == c["name"]}),
                "tokens": [s["tokens"] for s in per_rep],
                "time_s": [s["time_s"] for s in per_rep],
                "steps": [s["steps"] for s in per_rep],
                "drafted": [s["drafted"] for s in per_rep],
                "accepted": [s["accepted"] for s in per_rep],
                "tokens_per_s": median([x for s in per_rep if (x := ratio(s["tokens"], s["time_s"])) is not None]),
                "speedup_per_repeat": _speedups(base, per_rep),
                "speedup": median(_speedups(base, per_rep)),
                "x_hf_generate": median(_speedups(hf, per_rep)),
                "x_llamacpp": median(_speedups(llamacpp, per_rep)),
                "mal": median([x for s in per_rep if (x := ratio(s["tokens"], s["steps"])) is not None]),
                "acceptance_rate": median([x for s in per_rep if s["drafted"] is not None
                                           and (x := ratio(s["accepted"], s["drafted"])) is not None]),
            }
    return out


def _sums(rows: list[dict]) -> dict:
    drafted = None if any(r["drafted"] is None for r in rows) else sum(r["drafted"] for r in rows)
    accepted = None if any(r["accepted"] is None for r in rows) else sum(r["accepted"] for r in rows)
    return {"tokens": sum(r["tokens"] for r in rows), "time_s": sum(r["elapsed_s"] for r in rows),
            "steps": sum(r["steps"] for r in rows), "drafted": drafted, "accepted": accepted}


def _speedups(base: list[dict] | None, mine: list[dict]) -> list[float]:
    """Per repeat: the baseline's time per token / this decoder's time per token."""
    if base is None:
        return []
    out = []
    for b, m in zip(base, mine):
        if b["tokens"] and m["tokens"] and m["time_s"] > 0:
            out.append((b["time_s"] / b["tokens"]) / (m["time_s"] / m["tokens"]))
    return out


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="bench spec", unit="run", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)
