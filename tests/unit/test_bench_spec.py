"""`specserve bench spec` on a tiny model: the JSON, Markdown and PNG it writes, every number in
the summary recomputed from the raw runs of the same JSON, and the token identity check."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from services.bench.decoders import Decoded, Decoder, EngineDecoder, build_decoders
from services.bench.questions import load_questions
from services.bench.report import spec_markdown
from services.bench.spec import ALL, SpecSettings, run_spec
from services.cli import main
from services.common.prompt import encode_prompt
from services.common.loading import load_model

QUESTIONS = [
    {"question_id": 10, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7 w8 w5", "w9"]},
    {"question_id": 12, "category": "writing", "turns": ["w11 w12 w13 w14 w15"]},
    {"question_id": 14, "category": "math", "turns": ["w20 w21 w20 w21 w20 w21"]},
]
MAX_TOKENS, REPEATS = 10, 2


@pytest.fixture
def questions_file(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def check_summary(result: dict) -> None:
    """Every summary number, recomputed from result['runs']."""
    runs = result["runs"]
    names = [c["name"] for c in result["configs"]]
    baseline = {c["name"]: c["baseline"] for c in result["configs"]}
    for group, row in result["summary"].items():
        assert set(row) == set(names)
        mine = [r for r in runs if group == ALL or r["category"] == group]
        for name, s in row.items():
            per_rep = []
            for rep in range(REPEATS):
                rr = [r for r in mine if r["config"] == name and r["repeat"] == rep]
                per_rep.append((sum(r["tokens"] for r in rr), sum(r["elapsed_s"] for r in rr),
                                sum(r["steps"] for r in rr)))
            assert s["tokens"] == [t for t, _, _ in per_rep]
            assert s["time_s"] == pytest.approx([e for _, e, _ in per_rep])
            assert s["steps"] == [st for _, _, st in per_rep]
            assert s["tokens_per_s"] == pytest.approx(statistics.median(t / e for t, e, _ in per_rep))
            assert s["mal"] == pytest.approx(statistics.median(t / st for t, _, st in per_rep))
            base = row[baseline[name]]
            # At temperature 0 every decoder emits the same tokens, so speedup = plain time / its time.
            assert s["tokens"] == base["tokens"]
            expected = [b / m for b, m in zip(base["time_s"], s["time_s"])]
            assert s["speedup_per_repeat"] == pytest.approx(expected)
            assert s["speedup"] == pytest.approx(statistics.median(expected))
            if s["drafted"][0] is not None and all(s["drafted"]):
                assert s["acceptance_rate"] == pytest.approx(
                    statistics.median(a / d for a, d in zip(s["accepted"], s["drafted"])))


def test_spec_bench_writes_consistent_json_markdown_and_png(tmp_path, questions_file, tiny_target, tiny_draft):
    out = tmp_path / "out"
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\n<!-- bench_spec:begin -->\nold\n<!-- bench_spec:end -->\n\ntail\n")
    rc = main(["bench", "spec", "--target", str(tiny_target), "--questions", str(questions_file),
               "--max-tokens", str(MAX_TOKENS), "--draft", str(tiny_draft), "--draft-length", "0,2,3",
               "--repeats", str(REPEATS), "--out", str(out), "--update", str(benchmarks), "--no-progress"])
    assert rc == 0
    result = json.loads((out / "spec.json").read_text())
    assert (out / "spec.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "spec.md").read_text()

    for key in ("date", "commit", "dirty", "machine", "argv"):
        assert key in result["meta"]
    assert {"cpu", "cores", "python", "torch"} <= set(result["meta"]["machine"])
    names = [c["name"] for c in result["configs"]]
    assert names == ["plain", "draft_k2", "draft_k3", "hf_generate", "hf_assisted_k3"]  # k=0 is plain
    assert set(result["not_applicable"]) == {"hf_prompt_lookup"}
    assert [q["question_id"] for q in result["questions"]] == [10, 12, 14]
    assert len(result["runs"]) == len(names) * len(QUESTIONS) * REPEATS
    for r in result["runs"]:
        for key in ("question_id", "category", "config", "repeat", "slot", "prompt_tokens", "tokens",
                    "elapsed_s", "steps", "drafted", "accepted"):
            assert key in r
        assert 1 <= r["tokens"] <= MAX_TOKENS and r["elapsed_s"] > 0
    # interleaved: the decoders' order rotates with the question and the repeat
    first = {(r["question_id"], r["repeat"]): r["config"] for r in result["runs"] if r["slot"] == 0}
    assert len(set(first.values())) > 1
    assert list(result["summary"]) == ["writing", "math", ALL]
    check_summary(result)
    overall = result["summary"][ALL]
    assert overall["plain"]["mal"] == 1.0 and overall["hf_generate"]["mal"] == 1.0  # one token per forward
    assert overall["draft_k3"]["acceptance_rate"] is not None
    assert overall["hf_assisted_k3"]["acceptance_rate"] is None  # HF does not report it
    assert result["identity"] == {"checked": True, "reference": "plain", "identical": True, "mismatches": [],
                                  "length_differences": [],  # float32 weights: plain is HF generate
                                  "plain_vs_hf": {"questions": 3, "identical": 3, "first_difference_at": []},
                                  "plain_vs_llamacpp": None}  # not asked for
    for q in QUESTIONS:
        outs = result["outputs"][str(q["question_id"])]
        assert len({tuple(v) for v in outs.values()}) == 1

    for name in names:
        assert f"| {name} |" in markdown
    assert "| hf_prompt_lookup | hf | n/a" in markdown
    assert "| writing | 2 |" in markdown and "| math | 1 |" in markdown
    assert "the tokens of their reference on all 3 prompts" in markdown
    assert markdown == spec_markdown(result)
    text = benchmarks.read_text()
    assert "old" not in text and text.endswith("\n\ntail\n") and markdown.strip() in text


class WrongDecoder(Decoder):
    """Plain decoding that changes one token: what the identity check must catch."""

    def __init__(self, inner: Decoder, position: int):
        self.inner, self.position = inner, position
        self.name, self.engine, self.baseline = "wrong", inner.engine, inner.name
        self.draft, self.draft_length = "none", 0

    def decode(self, prompt_ids, params) -> Decoded:
        res = self.inner.decode(prompt_ids, params)
        i = min(self.position, len(res.token_ids) - 1)
        res.token_ids[i] = (res.token_ids[i] + 1) % 50 + 3
        return res


def test_identity_check_flags_a_decoder_whose_tokens_differ(tmp_path, questions_file, tiny_target):
    target = load_model(str(tiny_target))
    decoders = build_decoders(target, "ngram", [3], peers=()).decoders
    wrong = WrongDecoder(EngineDecoder("plain_again", target, None, "none", 0), position=3)
    questions = load_questions(questions_file)
    prompts = [encode_prompt(target.tokenizer, q.text, chat=True) for q in questions]
    result = run_spec(questions, prompts, [*decoders, wrong], SpecSettings(max_tokens=MAX_TOKENS, repeats=1),
                      progress=False)
    ident = result["identity"]
    assert ident["checked"] and not ident["identical"]
    assert {m["config"] for m in ident["mismatches"]} == {"wrong"}
    assert sorted(m["question_id"] for m in ident["mismatches"]) == [10, 12, 14]
    for m in ident["mismatches"]:
        ref = result["outputs"][str(m["question_id"])]["plain"]
        assert m["position"] == min(3, len(ref) - 1)
        assert m["expected"] == ref[m["position"]] and m["got"] != m["expected"]
    result.update(meta={"date": "2026-01-01T00:00:00Z", "commit": "abc", "dirty": False,
                        "machine": {"cpu": "x", "cores": 1, "python": "3"}}, target="tiny", draft="ngram")
    line = spec_markdown(result).strip().splitlines()[-1]
    assert "3 differences" in line and "wrong at token" in line


def test_no_identity_check_above_temperature_zero(questions_file, tiny_target):
    target = load_model(str(tiny_target))
    decoders = build_decoders(target, "ngram", [2], peers=()).decoders
    questions = load_questions(questions_file, limit=1)
    prompts = [encode_prompt(target.tokenizer, q.text, chat=True) for q in questions]
    result = run_spec(questions, prompts, decoders,
                      SpecSettings(max_tokens=6, temperature=0.8, seed=5, repeats=2, warmup=False), progress=False)
    assert not result["identity"]["checked"] and not result["identity"]["identical"]
    # the same seed per question in every repeat: each decoder repeats its own sample
    for name in ("plain", "ngram_k2"):
        assert result["outputs"]["10"][name]
    by = {}
    for r in result["runs"]:
        by.setdefault((r["question_id"], r["config"]), set()).add(r["tokens"])
    assert all(len(v) == 1 for v in by.values())


def test_adaptive_draft_length_reaches_the_engine(tiny_target):
    target = load_model(str(tiny_target))
    decoders = build_decoders(target, "ngram", [2, "adaptive"], peers=()).decoders
    assert [d.name for d in decoders] == ["plain", "ngram_k2", "ngram_adaptive"]
    assert decoders[2]._engine.config.draft_length == "adaptive"


def test_two_heads_side_by_side_get_their_folders_in_their_names(tmp_path, tiny_target):
    """Configuration names: a checkpoint's kind, plus its folder where that is not the kind's name."""
    from services.bench.decoders import _draft_label
    from services.common.loading import load_model
    from tests import tiny

    for folder in ("head", "head2"):
        tiny.make_head(load_model(str(tiny_target))).save(tmp_path / folder)
    assert _draft_label(str(tmp_path / "head")) == "head"
    assert _draft_label(str(tmp_path / "head2")) == "head_head2"
    assert _draft_label(str(tmp_path / "head") + "+ngram") == "head_ngram"
    assert _draft_label(str(tmp_path / "head2") + "+ngram") == "head_head2_ngram"  # beside head_ngram
    assert [_draft_label(d) for d in ("ngram", "none", "default")] == ["ngram", "none", "draft"]
