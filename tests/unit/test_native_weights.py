"""Native GGUF weights in whole models: the default target's blocks read as stored, the accuracy
each matmul route costs, memory, and lossless speculation on them (greedy identity against plain
decoding on the same weights, and the sampling distribution). The kernels op by op:
test_quantized_kernels.py.

Bounds on the default target's logits (absolute; they reach about 30-40) against the float32
dequantized model's, for 1 to 64 rows of one forward: the float block kernel (float32
activations; every weight's with SPECSERVE_NATIVE_MATMUL=float) stays within BLOCK_KERNEL_BOUND,
only the order of its sums differing; the routes that round activations stay within
ROUNDED_BOUND: the served one for the 4-bit layers and the Q8_0 LM head (int8 activations per
block of 32, integer dot products) and torch's int4 route (bfloat16 activations, scales and
products; the fallback).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.gguf_blocks import read_blocks
from services.common.llama import Chunk
from services.common.loading import default_gguf_path, load_model, load_weights
from services.common.prompt import encode_prompt
from services.common import quant
from services.common.sampling import SamplingParams
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.unit import test_distribution as dist

ROUNDED_BOUND = 1.5
BLOCK_KERNEL_BOUND = 1e-3


def test_the_default_models_blocks_are_its_dequantized_weights(default_native):
    """Every quantized weight of the shipped GGUF, read as stored (q/k rows back in Hugging Face
    order), decodes bitwise to the float32 checkpoint transformers dequantized from it."""
    blocks, other = read_blocks(default_gguf_path(), default_native.config)
    assert other == {} and len(blocks) == 30 * 7 + 1
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"}
    dense = load_weights(default_native.path)
    for name, block in blocks.items():
        assert torch.equal(block.dequantize(), dense[name]), name


@pytest.mark.parametrize("route, rows", [("served", r) for r in (1, 2, 5, 16, 64)] + [("float", 1), ("float", 64)])
def test_native_logits_stay_within_the_bound_of_float32(request, default_model, route, rows):
    native = request.getfixturevalue("default_native" if route == "served" else "default_native_float")
    text = "Speculative decoding verifies a whole draft of tokens in one forward pass of the target model. " * 8
    ids = native.tokenizer(text)["input_ids"][:16 + rows]
    out = []
    for lm in (native.model, default_model.model):
        cache = lm.new_cache(128)
        lm.forward([Chunk(cache, ids[:16], list(range(-1, 15)), 16)])  # a cached prefix
        out.append(lm.forward([Chunk(cache, ids[16:], list(range(-1, rows - 1)), 0)])[0])
    assert out[0].shape == (rows, 49152)
    rounds = any(w.native.rounds_activations for w in native.model.linear_weights())
    assert rounds == (route == "served")
    assert float((out[0] - out[1]).abs().max()) < (ROUNDED_BOUND if rounds else BLOCK_KERNEL_BOUND)


def _prefixed(model, ids, chunk_tokens, parents, states=()):
    """Logits (and states) of one chunk after the cached 16-token prefix of ids."""
    cache = model.new_cache(64)
    model.forward([Chunk(cache, ids[:16], list(range(-1, 15)), 16)])
    logits, st = model.forward_states([Chunk(cache, chunk_tokens, parents, 0)], states)
    return logits[0], (st[0] if states else None), cache


def test_the_native_stack_in_one_call_gives_the_op_by_op_forwards_bits(default_native):
    """layers.cpp runs the decoder stack of a native model in one call; the Python loop over the
    same kernels (a model the stack does not take: biases, q/k norms) must give the same bits:
    the KV, logits and states."""
    model = default_native.model
    assert model.stack is not None  # the served default target takes the one-call path
    ids = default_native.tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    tree = (ids[16:21], [-1, 0, 0, 1, 2])
    fused = _prefixed(model, ids, *tree, states=(2, 15, 27))
    stack, model.stack = model.stack, None
    try:
        ops = _prefixed(model, ids, *tree, states=(2, 15, 27))
    finally:
        model.stack = stack
    assert torch.equal(fused[0], ops[0]) and torch.equal(fused[1], ops[1])
    assert torch.equal(fused[2].k[:, :, :21], ops[2].k[:, :, :21])


def test_a_tree_node_gets_plain_decodings_logits_bitwise(default_native):
    """Node 3 of the tree [-1, 0, 0, 1, 2] lies on the path 0, 1, 3: its logits are the ones plain
    decoding of those tokens computes at the same position, to the bit (matmul, attention and
    the small ops are all row-independent on native weights)."""
    model = default_native.model
    ids = default_native.tokenizer("Once upon a time, in a small village by the sea, " * 3)["input_ids"]
    tree_tokens = ids[16:21]
    tree_logits, _, _ = _prefixed(model, ids, tree_tokens, [-1, 0, 0, 1, 2])
    _, _, cache = _prefixed(model, ids, tree_tokens[:1], [-1])
    for node in (1, 3):  # one decode step each, along the path
        plain = model.forward([Chunk(cache, [tree_tokens[node]], [-1], 0)])[0]
        assert torch.equal(plain[0], tree_logits[node]), node


def test_a_prompt_gets_the_same_bits_whole_in_chunks_or_after_a_shared_prefix(default_native):
    """Chunked prefill and a prefix copied from another request's cache (Sequence.share_prefix)
    must leave a prompt's keys, values and next-token logits as whole prefill makes them; else
    greedy output depends on what else the batch held (torch's attention kernel, blocked by the
    chunk's shape, gave a prompt other bits each way)."""
    model = default_native.model
    ids = default_native.tokenizer("A river runs through the old town, past the mill and the church. " * 4)["input_ids"][:60]

    def prefill(cache, sizes):
        logits = None
        for n in sizes:
            at = cache.length
            ends = at + n == len(ids)
            logits = model.forward([Chunk(cache, ids[at : at + n], list(range(-1, n - 1)), n - 1 if ends else n)])[0]
        return cache, logits

    whole, expected = prefill(model.new_cache(64), [60])
    donor, _ = prefill(model.new_cache(64), [40])  # another request holding the first 40 tokens
    for cache, logits in (prefill(model.new_cache(64), [7, 25, 28]), prefill(donor.fork(40, 64), [20])):
        assert torch.equal(logits, expected)
        assert torch.equal(cache.k[:, :, :60], whole.k[:, :, :60]) and torch.equal(cache.v[:, :, :60], whole.v[:, :, :60])


def test_native_weights_hold_a_tenth_of_float32(default_native, default_model):
    assert default_native.model.weight_bytes() < 140e6  # Q4_1 layers, a Q8_0 embedding/head: 96-132 MB
    assert default_model.model.weight_bytes() > 500e6  # float32 (and where used, its blocked copy)
    assert default_native.model.embed is None and default_native.model.lm_head.dense is None


RESIDENT_SCRIPT = """
import os, sys
from services.common.loading import load_model

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

load_model("default", weights=False)  # the runtime: torch, transformers, the tokenizer
before = rss()
model = load_model("default")
print(rss() - before, model.model.weight_bytes())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from Linux's /proc")
def test_the_native_default_target_adds_at_most_250_mb_of_resident_memory():
    """The issue's bound on the verifier's memory, less the Python runtime every role has: what
    loading the model leaves resident (its weights plus what loading did not give back)."""
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_HOME"}  # the cache `make setup` prepared
    out = subprocess.run([sys.executable, "-c", RESIDENT_SCRIPT], capture_output=True, text=True, check=True,
                         env=env, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    added, weights = int(out[-2]), int(out[-1])
    assert weights < 150e6 and added <= 250e6, f"{added / 1e6:.0f} MB resident for {weights / 1e6:.0f} MB of weights"


def test_a_bad_weight_format_is_refused(home):
    with pytest.raises(ValueError, match="weights must be one of native, float32"):
        load_model("default", weight_format="int3")


@pytest.fixture(scope="module")
def default_int4(home):
    """The default model on torch's int4 route (the fallback), from the prepared cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ROUTE_ENV, "int4")
        mp.delenv("SPECSERVE_HOME")
        loaded = load_model("default")
    assert loaded.model.lm_head.native.rounds_activations
    return loaded


@pytest.mark.parametrize("route,k,tree_size", [("default_native", 4, None), ("default_native", 3, 6),
                                               ("default_int4", 3, 6)])
def test_greedy_speculation_on_native_weights_equals_plain(request, route, k, tree_size):
    default_native = request.getfixturevalue(route)
    tok = default_native.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("List the days of the week: Monday, Tuesday,",
                                             "def fib(n):\n    if n < 2:\n        return n\n    return")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(default_native, None, StepConfig(draft_length=0, max_batch=2)).generate(prompts, params)
    spec = Engine(default_native, NgramProposer(), StepConfig(draft_length=k, tree_size=tree_size, max_batch=2))
    out = spec.generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    assert sum(r.stats.accepted for r in out) > 0  # speculation did accept tokens


def test_chunked_prefill_on_native_weights_gives_plain_decodings_tokens(default_native):
    """Chat prompts joining two batch slots over several steps (16-row chunks) while the other
    decodes, n-gram k = 4: the tokens of plain decoding with every prompt prefilled whole (while
    a prompt's rows took torch's attention kernel, 2 of these 5 answers differed)."""
    texts = ["Write a short poem about the sea and the wind.", "Explain why the sky is blue in two sentences.",
             "List three uses of a paperclip.", "What is the capital of France? Answer with one sentence.",
             "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs into the "
             "forest and finds a river."]
    prompts = [encode_prompt(default_native.tokenizer, t, chat=True) for t in texts]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    whole = Engine(default_native, None, StepConfig(draft_length=0, max_batch=1, max_step_tokens=0, target_itl_ms=0),
                   warm_up=False).generate(prompts, params)
    chunked = Engine(default_native, NgramProposer(), StepConfig(draft_length=4, max_batch=2, max_step_tokens=16),
                     warm_up=False).generate(prompts, params)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]


class _NativeAsHF:
    """Full-sequence logits of a native model, in the shape test_distribution reads from HF."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids: torch.Tensor):
        seq = ids[0].tolist()
        logits = self.model.forward([Chunk(self.model.new_cache(len(seq)), seq, list(range(-1, len(seq) - 1)), 0)])[0]
        return type("Out", (), {"logits": logits[None]})


@pytest.fixture(scope="module")
def native_models(tmp_path_factory, home):
    root = tmp_path_factory.mktemp("native")
    target = tiny.make_checkpoint(root / "target", vocab_size=dist.V, hidden=64, seed=21, init_std=0.2)
    close = tiny.make_checkpoint(root / "close", vocab_size=dist.V, hidden=64, seed=22, noise_from=target,
                                 noise_std=0.1)
    return tiny.native(load_model(str(target))), load_model(str(close)).model


@pytest.mark.parametrize("k,tree_size", [(2, 4)])  # a tree; chains are trees too (one case: 20,000 samples)
def test_sampling_on_native_weights_matches_their_distribution(native_models, k, tree_size):
    target, close = native_models
    assert target.model.layers[0]["wqkv"].native is not None  # a native route, not dequantized
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True)
    engine = Engine(target, ModelProposer(close, dist.V), StepConfig(draft_length=k, tree_size=tree_size,
                                                                     max_batch=1000))
    counts, reqs = dist.sample_joint(engine, params)
    dist.assert_matches(counts, dist.exact_distribution(_NativeAsHF(target.model), params))
    assert 0 < sum(r.stats.accepted for r in reqs) < sum(r.stats.drafted for r in reqs)
