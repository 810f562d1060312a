"""llama.cpp as a `bench spec` peer: its log read back into tokens, time and drafts; a crash on a
prompt is an error row, not the end of the benchmark; a missing build names `make peers`. The
run against the real llama-lookup needs `make peers` (about 13 minutes on 2 cores: not in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.decoders import LLAMACPP, LLAMACPP_PLAIN, PLAIN, EngineDecoder, PeerError, build_decoders
from services.bench.llamacpp import LlamaCppDecoder, lookup_binary, parse_lookup_log, peer_dir
from services.bench.questions import Question
from services.bench.report import spec_markdown
from services.bench.spec import ALL, SpecSettings, run_spec
from services.common.loading import default_gguf_path, load_model
from services.common.prompt import encode_prompt
from services.common.sampling import SamplingParams

BINARY = peer_dir() / "bin" / "llama-lookup"  # the user's SPECSERVE_HOME, read before the tests' own
BUILT = BINARY.is_file()


def lookup_log(accepted: list[tuple[int, str]], sampled: list[tuple[int, str]], drafted: int) -> str:
    """A log in llama-lookup's format (`-lv 5`, timestamped): a debug line per output token, then
    its summary."""
    lines = ["D drafted [ 'a':64 ]"]
    lines += [f"D the sampled target token matches the 0th drafted token ({t}, '{s}') - accepted" for t, s in accepted]
    lines += [f"D the sampled target token ({t}, '{s}') did not match, or we ran out of drafted tokens"
              for t, s in sampled]
    n = len(accepted) + len(sampled)
    lines += ["I encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s",
              f"I decoded {n:4d} tokens in    0.500 seconds, speed:   10.000 t/s", "I ",
              "I n_draft      = 4", f"I n_predict    = {n}", f"I n_drafted    = {drafted}",
              f"I n_accept     = {len(accepted)}", "I accept       = 50.000%"]
    return "\n".join(f"0.00.{600 + i:03d}.000 {line}" for i, line in enumerate(lines)) + "\n"


def test_the_log_gives_tokens_in_order_time_forwards_and_drafts():
    log = lookup_log(accepted=[(7, "it's"), (9, "\n")], sampled=[(11, "x"), (13, "'y')")], drafted=4)
    out = parse_lookup_log(log, max_tokens=10, draft_length=4)
    assert out.token_ids == [7, 9, 11, 13]
    assert out.elapsed_s == pytest.approx(0.75)  # prompt and decoding, as ours counts them
    assert out.steps == 2  # 4 tokens, 2 of them accepted drafts: 2 forwards
    assert (out.drafted, out.accepted) == (4, 2)
    cut = parse_lookup_log(log, max_tokens=3, draft_length=4)
    assert cut.token_ids == [7, 9, 11]  # the last forward's surplus is cut, as this engine cuts its own
    plain = parse_lookup_log(lookup_log([], [(5, "a"), (6, "b")], 0), max_tokens=8, draft_length=0)
    assert plain.steps == 2 and plain.drafted is None and plain.accepted is None
    # its lookup loop accepts drafts past an end token: they are not output
    past_end = parse_lookup_log(lookup_log([(5, "a"), (2, "<end>"), (198, "\n")], [(2, "<end>")], 4), 8, 4, (2,))
    assert past_end.token_ids == [5, 2] and past_end.steps == 1
    with pytest.raises(PeerError, match="no timings or tokens"):
        parse_lookup_log("llama-lookup: error: something else\n", max_tokens=8, draft_length=0)


def test_a_missing_build_names_make_peers(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make peers"):
        lookup_binary()


def test_a_peer_that_crashes_is_an_error_row_and_the_benchmark_goes_on(tiny_target, tmp_path):
    target = load_model(str(tiny_target))
    plain = EngineDecoder(PLAIN, target, None, "none", 0)
    crash = LlamaCppDecoder(LLAMACPP_PLAIN, tmp_path / "model.gguf", target.tokenizer, target.eos_token_ids, 0,
                            binary=Path("/bin/false"))
    questions = [Question(1, "writing", "w5 w6 w7 w8"), Question(2, "math", "w20 w21 w20")]
    prompts = [encode_prompt(target.tokenizer, q.text, chat=True) for q in questions]
    result = run_spec(questions, prompts, [plain, crash], SpecSettings(max_tokens=4, repeats=2), progress=False)
    assert len(result["errors"]) == 4  # every prompt, every repeat
    assert {e["config"] for e in result["errors"]} == {LLAMACPP_PLAIN}
    assert all("exited with 1" in e["error"] for e in result["errors"])
    assert {r["config"] for r in result["runs"]} == {PLAIN}  # the crashes are not timed as runs
    assert result["summary"][ALL][PLAIN]["tokens_per_s"] > 0
    assert result["identity"]["identical"]
    result.update(meta={"date": "2026-01-01T00:00:00Z", "commit": "abc", "dirty": False,
                        "machine": {"cpu": "x", "cores": 1, "python": "3"}}, target="tiny", draft="none")
    markdown = spec_markdown(result)
    assert "Errors (4 runs, left out of the numbers)" in markdown and "| x llama.cpp |" in markdown


def test_a_peer_whose_repacked_weights_crash_runs_again_without_them(tiny_target, tmp_path):
    """As llama.cpp's AMX matmul does on one Xeon here: killed by a signal unless --no-repack."""
    target = load_model(str(tiny_target))
    (tmp_path / "ok.log").write_text(lookup_log([], [(5, "a"), (6, "b")], 0))
    fake = tmp_path / "llama-lookup"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\ncase " $* " in *" --no-repack "*) '
                    f'cat {tmp_path}/ok.log ;; *) kill -SEGV $$ ;; esac\n')
    fake.chmod(0o755)
    peer = LlamaCppDecoder(LLAMACPP_PLAIN, tmp_path / "model.gguf", target.tokenizer, target.eos_token_ids, 0,
                           binary=fake)
    assert "note" not in peer.describe()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    assert peer.decode([1, 2, 3], params).token_ids == [5, 6]
    assert peer.decode([1, 2, 3], params).token_ids == [5, 6]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert ["--no-repack" in c for c in calls] == [False, True, True]  # one crash, then without repacking
    assert "--no-repack" in peer.describe()["note"]
    result = run_spec([Question(1, "writing", "w5 w6")], [encode_prompt(target.tokenizer, "w5 w6", chat=True)],
                      [EngineDecoder(PLAIN, target, None, "none", 0), peer], SpecSettings(max_tokens=2, repeats=1),
                      progress=False)
    result.update(meta={"date": "2026-01-01T00:00:00Z", "commit": "abc", "dirty": False,
                        "machine": {"cpu": "x", "cores": 1, "python": "3"}}, target="tiny", draft="none")
    assert "Notes: llamacpp_plain ran with --no-repack" in spec_markdown(result)
    crash = LlamaCppDecoder(LLAMACPP_PLAIN, tmp_path / "model.gguf", target.tokenizer, target.eos_token_ids, 0,
                            binary=Path("/bin/false"))
    with pytest.raises(PeerError, match="exited with 1"):  # an exit code is an error, not a retry
        crash.decode([1, 2, 3], params)
    assert crash.repack


def test_unknown_peers_and_non_gguf_targets_are_refused(tiny_target):
    target = load_model(str(tiny_target))
    with pytest.raises(ValueError, match="--peers: 'vllm'"):
        build_decoders(target, "ngram", [2], peers=("vllm",))
    with pytest.raises(ValueError, match="not a GGUF file"):
        build_decoders(target, "ngram", [2], peers=("llamacpp",))


@pytest.mark.skipif(not BUILT, reason="llama.cpp is not built here: `make peers` builds it (about 13 minutes "
                                       "on 2 cores, so not in CI)")
def test_llamacpp_lookup_gives_its_plain_tokens_on_the_default_gguf(default_native):
    target = default_native
    gguf = default_gguf_path()
    eos = target.eos_token_ids
    plain = LlamaCppDecoder(LLAMACPP_PLAIN, gguf, target.tokenizer, eos, 0, BINARY)
    lookup = LlamaCppDecoder("llamacpp_lookup_k4", gguf, target.tokenizer, eos, 4, BINARY)
    ids = encode_prompt(target.tokenizer, "Repeat after me: one two three, one two three, one two three.", chat=True)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    a, b = plain.decode(ids, params), lookup.decode(ids, params)
    assert len(a.token_ids) == 24 or a.token_ids[-1] in target.eos_token_ids
    assert b.token_ids == a.token_ids  # greedy: llama.cpp's lookup is lossless too
    assert a.steps == len(a.token_ids) and b.steps < len(b.token_ids)
    assert b.accepted > 0 and a.elapsed_s > 0
    text = target.tokenizer.decode(a.token_ids)
    assert "one two three" in text  # the same prompt reached it: the answer repeats it


def test_a_peer_that_departs_from_its_own_plain_tokens_is_reported_not_failed(tiny_target):
    """llama.cpp's lookup is not bitwise its plain decoding (batched rows round differently): the
    benchmark lists it, but only this engine's configurations decide `identical`."""
    from tests.unit.test_bench_spec import WrongDecoder

    target = load_model(str(tiny_target))
    plain = EngineDecoder(PLAIN, target, None, "none", 0)
    peer = WrongDecoder(EngineDecoder("peer_plain", target, None, "none", 0), position=1)
    peer.engine = LLAMACPP
    questions = [Question(1, "writing", "w5 w6 w7 w8")]
    prompts = [encode_prompt(target.tokenizer, q.text, chat=True) for q in questions]
    result = run_spec(questions, prompts, [plain, peer], SpecSettings(max_tokens=4, repeats=1), progress=False)
    assert result["identity"]["identical"] and len(result["identity"]["mismatches"]) == 1
    result.update(meta={"date": "2026-01-01T00:00:00Z", "commit": "abc", "dirty": False,
                        "machine": {"cpu": "x", "cores": 1, "python": "3"}}, target="tiny", draft="none")
    assert "1 differences (peers only" in spec_markdown(result)
