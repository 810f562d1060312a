"""The pieces of `specserve bench` that need no model: questions, draft-length lists, token
comparison, statistics, SSE chunk parsing, load summaries, reports and charts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import numpy as np
import pytest

from services.bench.chart import load_chart
from services.bench.decoders import parse_draft_lengths, stop_at_eos
from services.bench.load import RequestResult, chunk_tokens, parse_concurrency, summarize_level, wait_healthy
from services.bench.questions import load_questions
from services.bench.report import load_markdown, redact, update_section
from services.bench.spec import compare_tokens
from services.bench.stats import percentile
from services.cli import main


def write_questions(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_questions_limit_per_category_and_categories(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "second"]}
            for i, c in enumerate(["a", "a", "a", "b", "b", "c"])]
    path = write_questions(tmp_path / "q.jsonl", rows)
    assert [q.question_id for q in load_questions(path)] == [0, 1, 2, 3, 4, 5]
    assert [q.question_id for q in load_questions(path, limit=2)] == [0, 1, 3, 4, 5]
    qs = load_questions(path, categories=["c", "b"], limit=1)
    assert [(q.question_id, q.category, q.text) for q in qs] == [(3, "b", "q3"), (5, "c", "q5")]
    with pytest.raises(ValueError, match="no question of category zzz"):
        load_questions(path, categories=["zzz"])
    with pytest.raises(ValueError, match="--limit"):
        load_questions(path, limit=0)


def test_questions_bad_line_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: expected"):
        load_questions(path)
    with pytest.raises(FileNotFoundError):
        load_questions(tmp_path / "missing.jsonl")


def test_draft_length_lists():
    assert parse_draft_lengths("4") == [4]
    assert parse_draft_lengths("0, 2,4,adaptive,4") == [0, 2, 4, "adaptive"]
    for bad in ("-1", "two", "4,,x"):
        with pytest.raises(ValueError, match="--draft-length"):
            parse_draft_lengths(bad)
    assert parse_concurrency("1,2,16") == [1, 2, 16]
    with pytest.raises(ValueError, match="--concurrency"):
        parse_concurrency("1,0")


def test_compare_tokens_and_eos():
    assert compare_tokens([1, 2, 3], [1, 2, 3]) is None
    assert compare_tokens([1, 2, 3], [1, 5, 3]) == {"position": 1, "expected": 2, "got": 5,
                                                    "reference_length": 3, "length": 3}
    assert compare_tokens([1, 2, 3], [1, 2])["position"] is None  # equal over the common length
    assert stop_at_eos([4, 5, 2, 6], (2,)) == [4, 5, 2]
    assert stop_at_eos([4, 5], (2,)) == [4, 5]


def test_percentile_matches_numpy():
    xs = [0.3, 1.0, 0.1, 7.0, 2.5, 2.5, 9.0]
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) is None


def test_chunk_tokens():
    assert chunk_tokens({"choices": [{"delta": {"content": "ab"}, "token_ids": [5, 6, 7]}]}) == 3
    assert chunk_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]}) == 0
    assert chunk_tokens({"choices": [{"text": "x"}]}) == 1
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 4}}) == 0


def synthetic_level():
    ok1 = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.5, tokens=5, chunk_gaps_s=[0.2, 0.2], chunk_tokens=[1, 3])
    ok2 = RequestResult(ok=True, ttft_s=0.3, e2e_s=0.6, tokens=3, chunk_gaps_s=[0.3], chunk_tokens=[2])
    bad = RequestResult(ok=False, error="HTTP 429: slow down", e2e_s=0.01)
    return [(2.0, [ok1, ok2, bad])]


def test_load_level_summary():
    s = summarize_level(synthetic_level())
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["error_examples"] == ["HTTP 429: slow down"]
    assert s["requests_per_s"] == pytest.approx(1.0) and s["output_tokens_per_s"] == pytest.approx(4.0)
    # per-token ITL: 0.2 (1 token), 0.2/3 (3 tokens), 0.3/2 (2 tokens)
    itl = [0.2, 0.2 / 3, 0.2 / 3, 0.2 / 3, 0.15, 0.15]
    assert s["itl_p50_s"] == pytest.approx(float(np.percentile(itl, 50)))
    assert s["itl_p99_s"] == pytest.approx(float(np.percentile(itl, 99)))
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["e2e_p99_s"] == pytest.approx(float(np.percentile([0.5, 0.6], 99)))


def test_load_report_and_chart(tmp_path):
    result = {"meta": {"date": "2026-01-01T00:00:00Z", "commit": "abc1234", "dirty": False,
                       "machine": {"cpu": "cpu", "cores": 2, "python": "3.11"}},
              "settings": {"url": "http://127.0.0.1:1", "endpoint": "chat", "model": "m", "requests": 3,
                           "max_tokens": 8, "temperature": 0.0, "prompts": "built-in prompts", "repeats": 1},
              "levels": [{"concurrency": c, "summary": summarize_level(synthetic_level())} for c in (1, 4)]}
    md = load_markdown(result)
    assert "| 1 | 3 | 1 | 1.00 | 4.0 | 200 / " in md and "| 4 | 3 | 1 |" in md
    assert "HTTP 429: slow down" in md and "commit abc1234" in md
    load_chart(result, tmp_path / "load.png")
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"


def test_update_section(tmp_path):
    path = tmp_path / "B.md"
    update_section(path, "s", "one")
    update_section(path, "s", "two")
    update_section(path, "t", "three")
    assert path.read_text() == "<!-- s:begin -->\ntwo\n<!-- s:end -->\n\n<!-- t:begin -->\nthree\n<!-- t:end -->\n"


def test_redact_api_key():
    assert redact(["bench", "load", "--api-key", "sk-1", "--api-key=sk-2"]) == \
        ["bench", "load", "--api-key", "***", "--api-key=***"]


def test_load_without_a_gateway_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["bench", "load", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1", "--requests", "1",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert f"cannot connect to the gateway at http://127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "load.json").exists()


def test_load_compare_ratios_are_medians_of_paired_rounds():
    """scripts/bench_load_compare.py: against plain decoding, each round's ratio is taken first
    (both measured minutes apart), then the median; a machine that ran twice as fast in one
    round must not move it."""
    from scripts.bench_load_compare import summarize, table

    def run(setting, tokens, wall):
        req = dataclasses.asdict(RequestResult(ok=True, tokens=tokens, e2e_s=wall))
        return {"setting": setting, "concurrency": 8, "wall_s": wall, "requests": [req]}

    # plain 100, 200 (a fast round), 100 tok/s; adaptive 110, 220, 105: ratios 1.10, 1.10, 1.05
    rounds = [[run("0", 100, 1.0), run("adaptive", 110, 1.0)],
              [run("adaptive", 220, 1.0), run("0", 200, 1.0)],
              [run("0", 100, 1.0), run("adaptive", 105, 1.0)]]
    result = {"rounds": rounds, "settings_list": ["0", "adaptive"],
              "meta": {"date": "2026-12-01T00:00:00Z", "commit": "abc1234", "dirty": False,
                       "machine": {"cpu": "test cpu", "cores": 2, "python": "3.11"}},
              "load": {"concurrency": [8], "repeats": 3, "requests": 1, "max_tokens": 64, "temperature": 0.0}}
    got = summarize(result)
    assert got["0"][8]["tokens_per_s"] == pytest.approx(100.0)
    assert got["adaptive"][8]["tokens_per_s"] == pytest.approx(110.0)
    assert got["adaptive"][8]["ratio"] == pytest.approx(1.10)
    assert got["0"][8]["ratio"] is None
    assert "| 8 | 100.0 | 110.0 (1.10x) |" in table(result)


def test_load_compare_settings_name_a_draft_and_whole_prompts(tmp_path, monkeypatch):
    from scripts.bench_load_compare import stack_env

    monkeypatch.setenv("SPECSERVE_DRAFT", "ngram")
    monkeypatch.delenv("SPECSERVE_TARGET_ITL_MS", raising=False)
    head = stack_env("models/head@adaptive/whole", 51000, tmp_path)
    assert (head["SPECSERVE_DRAFT"], head["SPECSERVE_DRAFT_LENGTH"], head["SPECSERVE_TARGET_ITL_MS"]) == \
        ("models/head", "adaptive", "0")
    assert head["SPECSERVE_DRAFT_PORT"] == "51002"
    plain = stack_env("4", 51000, tmp_path)  # no draft named: the environment's
    assert (plain["SPECSERVE_DRAFT"], plain["SPECSERVE_DRAFT_LENGTH"]) == ("ngram", "4")
    assert "SPECSERVE_TARGET_ITL_MS" not in plain


def _closed_port_url() -> str:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_wait_healthy_gives_up_when_the_serving_process_has_exited():
    url, calls = _closed_port_url(), []

    def alive() -> bool:
        calls.append(1)
        return len(calls) < 3  # the process "exits" at the third poll

    with pytest.raises(RuntimeError, match="exited before GET /health answered"):
        asyncio.run(wait_healthy(url, 60.0, alive=alive))  # well before the 60 s deadline
    assert len(calls) == 3
    with pytest.raises(RuntimeError, match="did not answer GET /health within"):
        asyncio.run(wait_healthy(url, 0.2))
