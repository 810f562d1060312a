"""llama.cpp as a benchmark peer: its plain and prompt-lookup decoding on the same GGUF file.

`make peers` (scripts/build_llamacpp.py) builds llama.cpp's tools once under SPECSERVE_HOME. One
`llama-lookup` process per request, on the same prompt text, greedy, with the benchmark's thread
count: `--spec-draft-n-max 0` is its plain decoding, k > 0 its prompt lookup (an n-gram cache of
the prompt and the output, like ours). Time is what llama-lookup itself reports for the prompt
and the decoding (its model load is not counted, as ours is not); tokens are read from its
debug lines, one per output token, so tokens/s, MAL and the identity check use its own ids.

Its weights are repacked at load where the CPU has a faster layout (AMX tiles, interleaved
blocks). On a machine where that path crashes (its AMX matmul segfaults on prompts on one Xeon
here, llama.cpp issue 20824), a decoder retries without it and says so in its description.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import torch

from services.bench.decoders import LLAMACPP, LLAMACPP_PLAIN, Decoded, Decoder, PeerError, stop_at_eos
from services.common.loading import specserve_home
from services.common.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_VERSION = "0.3.36"  # llama-cpp-python's sdist, whose vendored llama.cpp `make peers` builds
TOOLS = ("llama-lookup", "llama-bench")

# llama-lookup's debug line for every output token: accepted from the draft, or sampled after it.
_TOKEN = re.compile(r"the sampled target token (?:matches the \d+th drafted token )?\((\d+), '")
_TIMES = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = re.compile(r"\b(n_drafted|n_accept)\s+=\s+(\d+)")


def peer_dir(version: str = DEFAULT_VERSION) -> Path:
    return specserve_home() / "peers" / f"llama.cpp-{version}"


def lookup_binary(version: str = DEFAULT_VERSION) -> Path:
    """The built llama-lookup; a clear error naming `make peers` when it is not built."""
    path = peer_dir(version) / "bin" / "llama-lookup"
    if not path.is_file():
        raise FileNotFoundError(f"llama.cpp is not built ({path} is missing): run `make peers` first")
    return path


class LlamaCppDecoder(Decoder):
    """llama.cpp's llama-lookup on `gguf`: plain decoding at draft_length 0, prompt lookup above."""

    engine = LLAMACPP
    baseline = LLAMACPP_PLAIN
    warms_up = False  # every request is a new process: a run here would warm nothing up

    def __init__(self, name: str, gguf: Path, tokenizer, eos_token_ids: tuple[int, ...], draft_length: int,
                 binary: Path | None = None, threads: int | None = None, context: int = 4096):
        self.name, self.draft_length, self.eos_token_ids = name, draft_length, eos_token_ids
        self.draft = "prompt_lookup" if draft_length else "none"
        self.gguf, self.tokenizer, self.context = gguf, tokenizer, context
        self.binary = binary or lookup_binary()
        self.threads = threads or torch.get_num_threads()
        self.repack = True  # False once the repacked weights crashed (see the module's docstring)

    def command(self, prompt_ids: list[int], params: SamplingParams) -> list[str]:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        # llama-lookup stops once it has more than -n tokens: one fewer asks for max_tokens (plus
        # the drafts its last forward accepted, which are cut, as this engine's are).
        cmd = [str(self.binary), "-m", str(self.gguf), "-p", text, "-n", str(max(params.max_tokens - 1, 1)),
               "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context),
               "--spec-draft-n-max", str(self.draft_length), "-lv", "5"] + ([] if self.repack else ["--no-repack"])
        if params.greedy:
            return cmd + ["--temp", "0"]
        return cmd + ["--temp", str(params.temperature), "--top-k", str(params.top_k), "--top-p", str(params.top_p),
                      "--min-p", "0", "--seed", str(params.seed or 0)]

    def decode(self, prompt_ids: list[int], params: SamplingParams) -> Decoded:
        proc = subprocess.run(self.command(prompt_ids, params), capture_output=True, text=True, errors="replace")
        if proc.returncode < 0 and self.repack:  # killed by a signal: try once more without repacking
            log.warning("%s: llama-lookup died of signal %d with repacked weights; running it with --no-repack",
                        self.name, -proc.returncode)
            self.repack = False
            proc = subprocess.run(self.command(prompt_ids, params), capture_output=True, text=True, errors="replace")
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            tail = " | ".join(out.strip().splitlines()[-3:])
            raise PeerError(f"llama-lookup exited with {proc.returncode}: {tail}")
        return parse_lookup_log(out, params.max_tokens, self.draft_length, self.eos_token_ids)

    def describe(self) -> dict:
        out = super().describe()
        if not self.repack:
            out["note"] = "ran with --no-repack: its repacked weights crashed on this machine"
        return out


def parse_lookup_log(log: str, max_tokens: int, draft_length: int, eos_token_ids: tuple[int, ...] = ()) -> Decoded:
    """Decoded from llama-lookup's log: its output ids (cut to max_tokens and after the first end
    token: its lookup loop goes on through drafts accepted after one), prompt + decoding seconds,
    target forwards, drafted and accepted counts."""
    ids = [int(m) for m in _TOKEN.findall(log)]
    times = {kind: (int(n), float(s)) for kind, n, s in _TIMES.findall(log)}
    counts = {k: int(v) for k, v in _COUNTS.findall(log)}
    if "encoded" not in times or "decoded" not in times or not ids:
        raise PeerError("llama-lookup printed no timings or tokens (an unexpected log format)")
    n_out = len(ids)
    accepted = counts.get("n_accept", 0)
    steps = n_out - accepted  # each forward yields one sampled token plus the drafts it accepted
    elapsed = times["encoded"][1] + times["decoded"][1]
    drafted = counts.get("n_drafted", 0) if draft_length else None
    return Decoded(stop_at_eos(ids[:max_tokens], eos_token_ids), elapsed, steps, drafted,
                   accepted if draft_length else None)
