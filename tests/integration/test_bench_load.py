"""`specserve bench load` against the real stack (Redis, verifier, draft, scheduler and gateway
processes on a tiny model): every request streams, every number of the report comes from the raw
requests in the same JSON, and failed requests are counted as errors."""

from __future__ import annotations

import json

import pytest

from services.bench.stats import percentile
from services.cli import main

MAX_TOKENS, REQUESTS = 6, 3


def test_bench_load_against_the_stack(stack, tmp_path):
    out, benchmarks = tmp_path / "out", tmp_path / "BENCHMARKS.md"
    rc = main(["bench", "load", "--url", stack.http_url, "--api-key", stack.api_key, "--concurrency", "1,2",
               "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
               "--prompt", "w5 w6 w7 w5 w6", "--prompt", "w8 w9 w10", "--out", str(out), "--update", str(benchmarks),
               "--wait", "30", "--no-progress"])
    assert rc == 0
    raw = (out / "load.json").read_text()
    assert stack.api_key not in raw  # the key is redacted from the recorded command line
    result = json.loads(raw)
    assert (out / "load.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (out / "load.md").read_text()
    assert markdown.strip() in benchmarks.read_text() and "<!-- bench_load:begin -->" in benchmarks.read_text()
    for key in ("date", "commit", "machine", "argv"):
        assert key in result["meta"]
    assert result["settings"]["model"] == stack.target.name  # from GET /v1/models
    assert result["warmup"]["ok"]
    assert [lvl["concurrency"] for lvl in result["levels"]] == [1, 2]
    for lvl in result["levels"]:
        (rep,) = lvl["repeats"]
        reqs = rep["requests"]
        assert len(reqs) == REQUESTS
        for r in reqs:
            assert r["ok"] and r["error"] is None
            assert r["tokens"] == MAX_TOKENS  # ignore_eos: exactly max_tokens, counted from usage
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            # the first chunk carries >= 1 token; the others are timed in chunk_gaps_s
            assert len(r["chunk_gaps_s"]) == len(r["chunk_tokens"]) and sum(r["chunk_tokens"]) <= MAX_TOKENS - 1
            assert sum(r["chunk_gaps_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-6
        s = lvl["summary"]
        assert (s["requests"], s["completed"], s["errors"]) == (REQUESTS, REQUESTS, 0)
        assert s["output_tokens"] == REQUESTS * MAX_TOKENS
        assert s["requests_per_s"] == pytest.approx(REQUESTS / rep["wall_s"])
        assert s["output_tokens_per_s"] == pytest.approx(REQUESTS * MAX_TOKENS / rep["wall_s"])
        assert s["ttft_p50_s"] == pytest.approx(percentile([r["ttft_s"] for r in reqs], 50))
        assert s["e2e_p99_s"] == pytest.approx(percentile([r["e2e_s"] for r in reqs], 99))
        assert s["ttft_p50_s"] <= s["ttft_p99_s"] and s["e2e_p50_s"] <= s["e2e_p99_s"]
        itl = [g / n for r in reqs for g, n in zip(r["chunk_gaps_s"], r["chunk_tokens"]) for _ in range(n)]
        assert s["itl_p50_s"] == pytest.approx(percentile(itl, 50))
        assert f"| {lvl['concurrency']} | {REQUESTS} | 0 |" in markdown


def test_bench_load_counts_failed_requests_as_errors(stack, tmp_path):
    rc = main(["bench", "load", "--url", stack.http_url, "--api-key", "sk-wrong", "--model", "m",
               "--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--endpoint", "completions",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 1  # no request succeeded: the files are written, the exit status says so
    result = json.loads((tmp_path / "load.json").read_text())
    (lvl,) = result["levels"]
    s = lvl["summary"]
    assert (s["requests"], s["completed"], s["errors"]) == (4, 0, 4)
    assert s["error_examples"] and s["error_examples"][0].startswith("HTTP 401")
    assert s["requests_per_s"] == 0 and s["ttft_p50_s"] is None
    assert "HTTP 401" in (tmp_path / "load.md").read_text()
