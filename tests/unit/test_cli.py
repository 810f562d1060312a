"""`specserve generate` as a user runs it: a real process, real checkpoint directories."""

import json
import os
import subprocess
import sys

import pytest

FIELDS = {"text", "token_ids", "steps", "mean_accepted_length", "acceptance_rate", "tokens_per_s", "elapsed_s"}


def run_cli(*args, home, **env):
    env = {**os.environ, "SPECSERVE_HOME": str(home), **env}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("draft,extra", [("none", []), ("ngram", ["--tree-size", "6"]), ("self", []),
                                         ("DRAFT", ["--draft-length", "3", "--tree-size", "5"])])
def test_generate_json_greedy_is_the_same_for_every_draft(tmp_path, home, tiny_target, tiny_draft, draft, extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6 w7 w5 w6"}) + "\n" + json.dumps({"prompt": "w9 w10"}) + "\n")
    draft = str(tiny_draft) if draft == "DRAFT" else draft
    res = run_cli("generate", "--target", str(tiny_target), "--draft", draft, "--prompts", str(prompts),
                  "--max-tokens", "12", "--json", *extra, home=home)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(lines) == 2 and all(FIELDS <= set(obj) for obj in lines)
    baseline = run_cli("generate", "--target", str(tiny_target), "--draft", "none", "--prompts", str(prompts),
                       "--max-tokens", "12", "--json", home=home)
    base = [json.loads(line) for line in baseline.stdout.splitlines()]
    assert [o["token_ids"] for o in lines] == [o["token_ids"] for o in base]
    assert all(o["mean_accepted_length"] >= 1.0 for o in lines)


def test_the_latency_warm_up_runs_at_load_and_is_cached_for_the_next_start(tmp_path, tiny_target):
    """Adaptive (the default) calibrates when the engine loads, never inside a request: load_s
    is reported apart from elapsed_s, and the next start reuses the cached calibration."""
    home = tmp_path / "home"
    # The matmul route step, timed at load, is part of the cache's key: on a busy machine two
    # starts can time it differently (a new key, measured again), so this test fixes it.
    runs = [run_cli("generate", "--target", str(tiny_target), "--prompt", "w5 w6 w7 w5 w6", "--max-tokens", "8",
                    "--json", home=home, SPECSERVE_MATMUL_SMALL_ROWS="2") for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert first["load_s"] > 0 and second["load_s"] > 0 and "elapsed_s" in first
    assert "latency warm-up" in runs[0].stderr and "(cached)" not in runs[0].stderr
    assert "(cached)" in runs[1].stderr
    assert list((home / "calibration").glob("*.json"))


def test_sampling_with_seed_is_reproducible(home, tiny_target, tiny_draft):
    # A fixed draft length: with adaptive, k follows measured latency, and which exact sample a
    # seed gives depends on k (the distribution does not).
    args = ["generate", "--target", str(tiny_target), "--draft", str(tiny_draft), "--prompt", "w5 w6",
            "--max-tokens", "10", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20",
            "--seed", "42", "--draft-length", "3", "--json"]
    a, b = run_cli(*args, home=home), run_cli(*args, home=home)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "1000"], "exceeds the context of 256 tokens"),
    (["--temperature", "-1"], "temperature must be"),
    (["--draft", "/no/such/draft"], "expected 'default'"),
])
def test_bad_requests_fail_with_a_clear_message(home, tiny_target, args, message):
    res = run_cli("generate", "--target", str(tiny_target), "--prompt", "w5 w6", *args, home=home)
    assert res.returncode == 2
    assert message in res.stderr


def test_threads_default_to_one_for_every_role_but_the_verifier():
    from services.cli import build_parser
    from services.serve import is_local, local_verifier, torch_threads

    draft = build_parser().parse_args(["serve", "draft", "--draft", "models/head"])
    assert draft.threads == "auto" and torch_threads("draft", draft.threads) == 1
    assert torch_threads("verifier", "auto") is None  # torch's default: one per core
    assert torch_threads("scheduler", None) == 1 and torch_threads("gateway", None) == 1
    own = build_parser().parse_args(["serve", "scheduler", "--verifier-addrs", "local"])  # the target in it
    assert local_verifier(own) and torch_threads("scheduler", own.threads, local_verifier(own)) is None
    assert not local_verifier(build_parser().parse_args(["serve", "scheduler"]))
    with pytest.raises(ValueError, match="--verifier-addrs local .* takes no other replica"):
        local_verifier(build_parser().parse_args(["serve", "scheduler", "--verifier-addrs", "local,127.0.0.1:1"]))
    with pytest.raises(ValueError, match="--draft-addrs local .* takes no other replica"):
        is_local("127.0.0.1:1,local", "--draft-addrs")
    assert torch_threads("draft", build_parser().parse_args(["serve", "draft", "--threads", "2"]).threads) == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit, match="--threads"):
            torch_threads("verifier", bad)
