"""Warm-up: measure what a step costs before serving, to seed the controller's latency model.

Synthetic requests (fixed token ids) go through the real path: one request per tree size n is
prefilled (not measured), then every size is verified with an n-node chain in rounds, one size
after another within a round, so that a machine whose speed drifts shifts every size alike
instead of tilting the fitted cost per node; then each is drafted to each depth k. Each shape is
one observation, the median of its runs after the first. The same plan runs over gRPC (the
scheduler at start) and in-process (the engine).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Awaitable, Callable

from services.common import codec
from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.scheduler.latency import LatencyModel, RowCurve, StepShape
from specserve.v1 import draft_pb2, verifier_pb2

log = logging.getLogger(__name__)

PROMPT_LEN = 16
# Timed rounds over the sizes. The first is dropped (a new row count can build kernels on first
# use, e.g. oneDNN's for the blocked weights); the median of the rest is what the fit sees.
REPEATS = 6
# Every tree size up to this many nodes is measured, whatever the largest tree (the verify cost
# is not linear in rows: latency.RowCurve; a batch's forward has more rows than one tree); above
# it a spread of sizes up to the largest tree.
EVERY_SIZE_UP_TO = 16


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
    """Tree sizes the warm-up verifies (the draft is timed at those up to the largest tree)."""
    top = max_k * width
    # route_rows nodes + the pending token: the first forward past the route step (if any)
    spread = {top // 4, top // 2, 3 * top // 4, top} | ({route_rows} if route_rows else set())
    return sorted(set(range(EVERY_SIZE_UP_TO + 1)) | {n for n in spread if n <= top})


def fit_verify(latency: LatencyModel, times: dict[int, list[float]]) -> None:
    """The row curve from the warm-up's verify times per tree size (batch 1: rows = nodes + 1),
    then those times as the fit's first observations."""
    cost = {n: settled(ts) for n, ts in times.items()}
    latency.set_curve(RowCurve({n + 1: ms - cost[0] for n, ms in cost.items()}))
    for n, ms in cost.items():
        latency.observe_verify(StepShape(1, 0, n, 0), ms)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def settled(times: list[float]) -> float:
    """One shape's cost: the median of its timed runs after the first."""
    return statistics.median(times[1:] or times)


def _log_fit(latency: LatencyModel) -> None:
    step = f"rows > {latency.route_rows}" if latency.route_rows else "no route step"
    curve = latency.curve
    shape = ", ".join(f"{r}: +{curve(r):.1f}" for r in (2, 5, 9, 17)) if curve is not None else "none"
    log.info("warm-up: verify ms = %s . [1, batch, nodes, %s, row curve (ms over 1 row at rows %s)]; "
             "draft ms = %s . [1, drafting, nodes, depth]", [round(w, 2) for w in latency.verify.weights], step,
             shape, [round(w, 2) for w in latency.draft.weights])


async def calibrate_remote(latency: LatencyModel, verify: Callable[[object], Awaitable[object]],
                           propose: Callable[[object], Awaitable[object]] | None, vocab_size: int,
                           max_k: int, width: int) -> None:
    """Over gRPC: `verify` / `propose` send one VerifyStep / ProposeStep to a replica and return
    its result (the step streams of one verifier and one draft replica)."""
    params = codec.params_to_pb(SamplingParams(max_tokens=PROMPT_LEN * 4))
    sizes = tree_sizes(max_k, width, latency.route_rows)
    tokens = {n: synthetic_prompt(vocab_size, salt) for salt, n in enumerate(sizes)}
    sent = dict.fromkeys(sizes, 0)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(REPEATS + 1):  # round 0 is the prefill
        for n in sizes:
            item = verifier_pb2.VerifyItem(request_id=f"__calibration_{n}__", offset=sent[n],
                                           tokens=tokens[n][sent[n]:],
                                           tree=codec.tree_to_pb(synthetic_chain(n if rnd else 0, vocab_size)),
                                           params=params)
            t0 = time.perf_counter()
            res = await verify(verifier_pb2.VerifyStep(items=[item]))
            if rnd:
                times[n].append(_ms(t0))
            sent[n] = len(tokens[n])
            tokens[n] = tokens[n] + list(res.verdicts[0].tokens)
    fit_verify(latency, times)
    await verify(verifier_pb2.VerifyStep(release=[f"__calibration_{n}__" for n in sizes]))
    for n in sizes if propose is not None else []:
        if n == 0 or n > max_k * width:
            continue
        rid, k, runs = f"__calibration_{n}__", min(max_k, n), []
        for rep in range(REPEATS + 1):
            first = rep == 0  # sends the tokens; later rounds propose again from the same ones
            item = draft_pb2.ProposeItem(request_id=rid, offset=0 if first else len(tokens[n]),
                                         tokens=tokens[n] if first else [], draft_length=k, tree_size=n,
                                         params=params)
            t0 = time.perf_counter()
            res = await propose(draft_pb2.ProposeStep(items=[item]))
            runs.append(_ms(t0))
            nodes = len(res.proposals[0].tree.tokens)
        if nodes:  # the same tokens each round: the same tree
            latency.draft.observe(StepShape(1, 1, nodes, k).draft_features(), settled(runs[1:]))
        await propose(draft_pb2.ProposeStep(release=[rid]))
    _log_fit(latency)


def calibrate_local(latency: LatencyModel, verifier, proposer, vocab_size: int, max_k: int, width: int) -> None:
    """In-process: the engine's Verifier and Proposer."""
    from services.draft.proposer import ProposeItem
    from services.verifier.verifier import VerifyItem

    params = SamplingParams(max_tokens=PROMPT_LEN * 4)
    sizes = tree_sizes(max_k, width, latency.route_rows)
    tokens = {n: synthetic_prompt(vocab_size, salt) for salt, n in enumerate(sizes)}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(REPEATS + 1):  # round 0 is the prefill
        for n in sizes:
            t0 = time.perf_counter()
            verdict = verifier.verify([VerifyItem(f"__calibration_{n}__", tokens[n],
                                                  synthetic_chain(n if rnd else 0, vocab_size), params, None)])[0]
            if rnd:
                times[n].append(_ms(t0))
            tokens[n] = tokens[n] + list(verdict.tokens)
    fit_verify(latency, times)
    for n in sizes:
        verifier.release(f"__calibration_{n}__")
    for n in sizes if proposer is not None else []:
        if n == 0 or n > max_k * width:
            continue
        rid, k, runs = f"__calibration_{n}__", min(max_k, n), []
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            tree = proposer.propose([ProposeItem(rid, tokens[n], k, n, params, None)])[0]
            runs.append(_ms(t0))
        if len(tree):  # the same tokens each round: the same tree
            latency.draft.observe(StepShape(1, 1, len(tree), k).draft_features(), settled(runs[1:]))
        proposer.release(rid)
    _log_fit(latency)
