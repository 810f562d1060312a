"""llguidance against xgrammar on the default target's tokenizer: the tokenizer's one-time setup,
compiling a JSON schema, and the mask of every position of a 34-token answer (medians of 5).

xgrammar is not a dependency (it pulls triton); to compare, install it beside the venv:
    .venv/bin/pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg .venv/bin/python scripts/bench_grammar_engines.py
Without it, only llguidance is measured. Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

from services.common.grammar import JSON_LAYOUT
from services.common.loading import load_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
ANSWER = json.dumps({"name": "Ada Lovelace, mathematician", "age": 36, "tags": ["math", "engines", "poetry"]})


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def llguidance_row(tok, vocab: int, ids: list[int]) -> tuple:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    setup = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab), repeats=1)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_LAYOUT)
    compile_ms = timed(lambda: llguidance.LLMatcher(lltok, grammar, log_level=0))
    matcher, mask = llguidance.LLMatcher(lltok, grammar, log_level=0), lt.allocate_token_bitmask(1, vocab)

    def masks():
        matcher.reset()
        for t in ids:
            lt.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(t), matcher.get_error()
    return "llguidance", setup, compile_ms, timed(masks) / len(ids) * 1e3


def xgrammar_row(tok, vocab: int, ids: list[int]) -> tuple | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), repeats=1)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), cache_enabled=False)
    text = json.dumps(SCHEMA)
    compile_ms = timed(lambda: compiler.compile_json_schema(text, any_whitespace=False))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(text, any_whitespace=False))
    mask = xgr.allocate_token_bitmask(1, vocab)

    def masks():
        matcher.reset()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t)
    return "xgrammar", setup, compile_ms, timed(masks) / len(ids) * 1e3


def main() -> None:
    target = load_model("default", weights=False)
    tok, vocab = target.tokenizer, target.config.vocab_size
    ids = tok.encode(ANSWER, add_special_tokens=False)
    rows = [r for r in (llguidance_row(tok, vocab, ids), xgrammar_row(tok, vocab, ids)) if r is not None]
    print(f"{len(ids)}-token answer, vocabulary {vocab}; {platform.processor() or platform.machine()}")
    print("| engine | tokenizer setup (ms, once) | compile the schema (ms) | mask per token (us) |")
    print("| --- | --- | --- | --- |")
    for name, setup, compile_ms, per_token in rows:
        print(f"| {name} | {setup:.0f} | {compile_ms:.1f} | {per_token:.1f} |")


if __name__ == "__main__":
    main()
