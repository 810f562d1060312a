"""What a drafted token of the feature head costs, beside one step of the target.

    .venv/bin/python scripts/bench_head.py [--head models/head] [--context 300] [--k 4] [--repeats 30]

One request with `--context` committed tokens (the target's states fed once): each timed call
drafts a k-token chain from the same position (the head's tree is dropped between calls, as in
serving), so a call is k levels of the head: input, layer, LM head, top-k. Configurations: the
head's serving weights (SPECSERVE_HEAD_WEIGHTS: float, q8, q4) with its reduced vocabulary
(SlimSpec), and q4 with the target's whole vocabulary (a head of the same shapes with every id:
timing only). Beside them, the target's one-row decode step after the same context. Medians of
interleaved repeats; prints a markdown table with the CPU model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.hidden_states import HiddenStates  # noqa: E402
from services.common.llama import Chunk  # noqa: E402
from services.common.loading import load_model, load_weights  # noqa: E402
from services.common.machine import cpu_model  # noqa: E402
from services.common.quant import HEAD_WEIGHTS_ENV  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from services.common.sequence import Sequence  # noqa: E402
from services.draft.feature_head import FeatureHead, init_from_target  # noqa: E402
from services.draft.head_proposer import HeadProposer  # noqa: E402
from services.draft.proposer import ProposeItem  # noqa: E402


def full_vocabulary_head(head: FeatureHead, target) -> FeatureHead:
    """The same head with an LM head over every target id (the target's rows): timing only."""
    from dataclasses import replace

    full = FeatureHead(replace(head.config, draft_vocab=target.config.vocab_size))
    init_from_target(full, load_weights(target.path), target.config.num_layers, torch.arange(target.config.vocab_size))
    return full.eval()


def proposer(head_path: str, target, embed, weights: str, full: bool) -> HeadProposer:
    os.environ[HEAD_WEIGHTS_ENV] = weights
    head = FeatureHead.load(Path(head_path))
    # every call drafts all k levels: greedy drafting stops where a level's mass is low (this
    # random context's), which would time fewer levels than the table divides by
    return HeadProposer(full_vocabulary_head(head, target) if full else head, embed, target.config.vocab_size,
                        min_level_mass=0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="models/head")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    target = load_model("default")
    embed = load_weights(target.path)["model.embed_tokens.weight"]
    ids = torch.randint(100, 20000, (args.context + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    layers = tuple(FeatureHead.load(Path(args.head)).config.target_layers)
    cache = target.model.new_cache(len(ids) + 2)
    prompt = Chunk(cache, ids[:-1], list(range(-1, len(ids) - 2)), len(ids) - 2)
    _, states = target.model.forward_states([prompt], layers)

    def target_step() -> None:
        cache.length = len(ids) - 1
        target.model.forward([Chunk(cache, ids[-1:], [-1], 0)])

    configs = {f"{w}, reduced vocabulary": proposer(args.head, target, embed, w, False) for w in ("float", "q8", "q4")}
    configs["q4, whole vocabulary"] = proposer(args.head, target, embed, "q4", True)
    seqs = {}
    for name, prop in configs.items():
        seqs[name] = Sequence(name, SamplingParams(max_tokens=8), None, tokens=list(ids))
        prop.propose([ProposeItem(seqs[name], args.k, args.k, [HiddenStates(0, states[0].half())])])

    def draft(name: str) -> None:
        tree = configs[name].propose([ProposeItem(seqs[name], args.k, args.k, [])])[0]
        assert len(tree) == args.k, f"{name}: a chain of {len(tree)}, not {args.k}"

    times: dict[str, list[float]] = {name: [] for name in ["target"] + list(configs)}
    for _ in range(args.repeats + 2):  # interleaved; the first two untimed
        for name in times:
            t0 = time.perf_counter()
            target_step() if name == "target" else draft(name)
            times[name].append(time.perf_counter() - t0)
    step = 1e3 * statistics.median(times["target"][2:])
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; context {args.context}, chains of {args.k}, "
          f"median of {args.repeats}\n")
    print("| configuration | ms per drafted token | x one target step |\n| --- | --- | --- |")
    print(f"| target, one-row step | {step:.2f} | 1.00 |")
    for name in configs:
        ms = 1e3 * statistics.median(times[name][2:]) / args.k
        print(f"| head, {name} | {ms:.2f} | {ms / step:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
