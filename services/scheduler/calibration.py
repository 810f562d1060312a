"""Warm-up: measure what a step costs before serving, to seed the controller's latency model.

Synthetic requests (fixed token ids) go through the real path: for each tree size n a fresh
request is prefilled (not measured), then verified a few times with an n-node chain, and drafted
to each depth k; each shape is one observation, the median of its runs after the first. The
same plan runs over gRPC (the scheduler at start) and in-process (the engine).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Awaitable, Callable

from services.common import codec
from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.scheduler.policy import LatencyModel, StepShape
from specserve.v1 import draft_pb2, verifier_pb2

log = logging.getLogger(__name__)

PROMPT_LEN = 16
# Timed runs per shape. The first is dropped (a new row count can build kernels on first use, e.g.
# oneDNN's for the blocked weights); the median of the rest is what the fit sees.
REPEATS = 4


def synthetic_prompt(vocab_size: int, salt: int = 0) -> list[int]:
    """A pattern said twice, so that an n-gram proposer finds continuations to propose too."""
    half = [(7 + 31 * i + 101 * salt) % max(2, vocab_size - 2) + 1 for i in range(PROMPT_LEN // 2)]
    return half + half


def synthetic_chain(n: int, vocab_size: int) -> DraftTree:
    """n nodes in a chain, each a point mass (verification cost does not depend on the tokens)."""
    tree = DraftTree()
    for i in range(n):
        tok = (13 + 17 * i) % max(2, vocab_size - 2) + 1
        tree.add(tok, i - 1, [tok], [1.0])
    return tree


def tree_sizes(max_k: int, width: int, route_rows: int) -> list[int]:
    top = max_k * width
    # route_rows nodes + the pending token: the first forward past the route step (if any)
    sizes = {0, 1, 2, top // 2, top} | ({route_rows} if route_rows else set())
    return sorted(n for n in sizes if n <= top)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def settled(times: list[float]) -> float:
    """One shape's cost: the median of its timed runs after the first."""
    return statistics.median(times[1:] or times)


async def calibrate_remote(latency: LatencyModel, verify: Callable[[object], Awaitable[object]],
                           propose: Callable[[object], Awaitable[object]] | None, vocab_size: int,
                           max_k: int, width: int) -> None:
    """Over gRPC: `verify` / `propose` send one VerifyStep / ProposeStep to a replica and return
    its result (the step streams of one verifier and one draft replica)."""
    params = codec.params_to_pb(SamplingParams(max_tokens=PROMPT_LEN * 4))
    for salt, n in enumerate(tree_sizes(max_k, width, latency.route_rows)):
        rid = f"__calibration_{n}__"
        tokens = synthetic_prompt(vocab_size, salt)
        sent, times = 0, []
        for rep in range(REPEATS + 1):  # the first round is the prefill
            tree = synthetic_chain(n if rep else 0, vocab_size)
            item = verifier_pb2.VerifyItem(request_id=rid, offset=sent, tokens=tokens[sent:],
                                           tree=codec.tree_to_pb(tree), params=params)
            t0 = time.perf_counter()
            res = await verify(verifier_pb2.VerifyStep(items=[item]))
            times.append(_ms(t0))
            sent = len(tokens)
            tokens = tokens + list(res.verdicts[0].tokens)
        latency.observe_verify(StepShape(1, 0, n, 0), settled(times[1:]))
        await verify(verifier_pb2.VerifyStep(release=[rid]))
        if propose is None or n == 0:
            continue
        k, times = min(max_k, n), []
        for rep in range(REPEATS + 1):
            first = rep == 0  # sends the tokens; later rounds propose again from the same ones
            item = draft_pb2.ProposeItem(request_id=rid, offset=0 if first else len(tokens),
                                         tokens=tokens if first else [], draft_length=k, tree_size=n, params=params)
            t0 = time.perf_counter()
            res = await propose(draft_pb2.ProposeStep(items=[item]))
            times.append(_ms(t0))
            nodes = len(res.proposals[0].tree.tokens)
        if nodes:  # the same tokens each round: the same tree
            latency.draft.observe(StepShape(1, 1, nodes, k).draft_features(), settled(times[1:]))
        await propose(draft_pb2.ProposeStep(release=[rid]))
    step = f"rows > {latency.route_rows}" if latency.route_rows else "no route step"
    log.info("warm-up: verify ms = %s . [1, batch, nodes, %s]; draft ms = %s . [1, drafting, nodes, depth]",
             [round(w, 2) for w in latency.verify.weights], step, [round(w, 2) for w in latency.draft.weights])


def calibrate_local(latency: LatencyModel, verifier, proposer, vocab_size: int, max_k: int, width: int) -> None:
    """In-process: the engine's Verifier and Proposer."""
    from services.draft.proposer import ProposeItem
    from services.verifier.verifier import VerifyItem

    params = SamplingParams(max_tokens=PROMPT_LEN * 4)
    for salt, n in enumerate(tree_sizes(max_k, width, latency.route_rows)):
        rid = f"__calibration_{n}__"
        tokens = synthetic_prompt(vocab_size, salt)
        times = []
        for rep in range(REPEATS + 1):  # the first round is the prefill
            t0 = time.perf_counter()
            verdict = verifier.verify([VerifyItem(rid, tokens, synthetic_chain(n if rep else 0, vocab_size),
                                                  params, None)])[0]
            times.append(_ms(t0))
            tokens = tokens + list(verdict.tokens)
        latency.observe_verify(StepShape(1, 0, n, 0), settled(times[1:]))
        verifier.release(rid)
        if proposer is None or n == 0:
            continue
        k, times = min(max_k, n), []
        for rep in range(REPEATS + 1):
            t0 = time.perf_counter()
            tree = proposer.propose([ProposeItem(rid, tokens, k, n, params, None)])[0]
            times.append(_ms(t0))
        if len(tree):  # the same tokens each round: the same tree
            latency.draft.observe(StepShape(1, 1, len(tree), k).draft_features(), settled(times[1:]))
        proposer.release(rid)
