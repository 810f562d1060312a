"""Warm-up: measure what a step costs before serving, to seed the controller's latency model.

Synthetic requests (fixed token ids) go through the real path: one request per tree size n is
prefilled (not measured), then every size is verified with an n-node chain in rounds, one size
after another within a round, so that a machine whose speed drifts shifts every size alike
instead of tilting the fitted cost per node; a few sizes also after a long prompt, so the fit
tells what a row costs per token it attends to (latency.py's context terms); then each short
request is drafted to each depth k. Each shape is one observation, the least of its runs after
the first (noise only adds: another process's work on the same cores, a wait behind another
scheduler's step). It runs through the step's own workers
(services/scheduler/workers.py), so the scheduler service (over gRPC) and the in-process engine
measure alike, when they start; the result is cached (calibration_cache.py).

Replicas may be shared: several schedulers warming up at once through one verifier queue behind
each other's steps. So the warm-up's request ids are this process's own, and each run is timed by
the worker's own compute time plus the least round-trip overhead of all the runs: a wait behind
another scheduler's step is not a function of our shape, and would tilt the row curve.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from services.common.sampling import SamplingParams
from services.common.tree import DraftTree
from services.scheduler import calibration_cache
from services.scheduler.latency import LatencyModel, RowCurve, StepShape, row_context
from services.scheduler.workers import Reply, Work, Workers

log = logging.getLogger(__name__)

PROMPT_LEN = 16
# The long prompt of the sizes measured twice (LONG_SIZES, capped by the largest tree): long
# enough that attention's share of a row shows above the timing noise.
LONG_PROMPT_LEN = 512
LONG_SIZES = (0, 4, 16)
# Timed rounds over the sizes. The first is dropped (a new row count can build kernels on first
# use, e.g. oneDNN's for the blocked weights); the least of the rest is what the fit sees.
REPEATS = 6
# Every tree size up to this many nodes is measured, whatever the largest tree (the verify cost
# is not linear in rows: latency.RowCurve; a batch's forward has more rows than one tree); above
# it a spread of sizes up to the largest tree.
EVERY_SIZE_UP_TO = 16


def synthetic_prompt(vocab_size: int, salt: int = 0, length: int = PROMPT_LEN) -> list[int]:
    """A pattern said twice, so that an n-gram proposer finds continuations to propose too."""
    half = [(7 + 31 * i + 101 * salt) % max(2, vocab_size - 2) + 1 for i in range(length // 2)]
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


def fit_verify(latency: LatencyModel, cost: dict[tuple[int, int], float]) -> None:
    """The row curve from the warm-up's verify ms per (tree size, tokens held) after the short
    prompt (batch 1: rows = nodes + 1), then every cost as one of the fit's first observations."""
    short = min(t for _, t in cost)
    base = cost[(0, short)]
    latency.set_curve(RowCurve({n + 1: ms - base for (n, t), ms in cost.items() if t == short}))
    for (n, t), ms in cost.items():
        latency.observe_verify(StepShape(1, 0, n, 0, context=row_context(1, t), node_context=row_context(n, t)),
                               ms)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class RunTimes:
    """Each run's own ms (the worker's compute time, when it reported one, else the round trip)
    and the rest of its round trip; `settled` adds the least rest to every shape alike."""

    def __init__(self):
        self.own: dict = {}  # shape -> its runs' own ms
        self.rest: list[float] = []

    def add(self, shape, t0: float, reply: Reply) -> None:
        wall = _ms(t0)
        own = reply.compute_ms if 0.0 < reply.compute_ms <= wall else wall
        self.own.setdefault(shape, []).append(own)
        self.rest.append(wall - own)

    def settled(self) -> dict:
        rest = min(self.rest, default=0.0)
        return {n: settled(ts) + rest for n, ts in self.own.items()}


def calibration_id(run: str, n: int) -> str:
    """A warm-up request's id: `run` is this warm-up's own (replicas may serve other schedulers)."""
    return f"__calibration_{run}_{n}__"


def settled(times: list[float]) -> float:
    """One shape's cost: the least of its timed runs after the first."""
    return min(times[1:] or times)


def _log_fit(latency: LatencyModel) -> None:
    step = f"rows > {latency.route_rows}" if latency.route_rows else "no route step"
    curve = latency.curve
    shape = ", ".join(f"{r}: +{curve(r):.1f}" for r in (2, 5, 9, 17)) if curve is not None else "none"
    log.info("warm-up: verify ms = %s . [1, batch, nodes, %s, row curve (ms over 1 row at rows %s), "
             "tokens held / 1000, nodes x tokens held / 1000]; "
             "draft ms = %s . [1, drafting, nodes, depth]", [round(w, 2) for w in latency.verify.weights], step,
             shape, [round(w, 2) for w in latency.draft.weights])


async def calibrate(latency: LatencyModel, verifiers: Workers, drafts: Workers | None, vocab_size: int,
                    max_k: int, width: int, max_positions: int | None = None) -> None:
    """Measure through the step's own workers (in-process or remote alike) and fit `latency`
    (`max_positions`: the target's context, which the long prompt and its rounds must fit)."""
    params = SamplingParams(max_tokens=PROMPT_LEN * 4)
    sizes = tree_sizes(max_k, width, latency.route_rows)
    room = (max_positions or LONG_PROMPT_LEN * 2) - params.max_tokens - sizes[-1]
    long_len = min(LONG_PROMPT_LEN, room // 2 * 2)
    # (tree size, prompt length) of each synthetic request
    shapes = [(n, PROMPT_LEN) for n in sizes]
    if long_len > 2 * PROMPT_LEN:
        shapes += [(n, long_len) for n in LONG_SIZES if n <= sizes[-1]]
    run = secrets.token_hex(4)
    # the request each shape runs in: its own, but one for all the long sizes (one long prefill)
    owner = {shape: shape if shape[1] == PROMPT_LEN else shapes[len(sizes)] for shape in shapes}
    tokens = {shape: synthetic_prompt(vocab_size, salt, shape[1]) for salt, shape in enumerate(shapes)
              if owner[shape] == shape}
    ids = {shape: calibration_id(run, i) for i, shape in enumerate(tokens)}
    times = RunTimes()
    layers = drafts.feature_layers if drafts is not None else ()
    states: dict[tuple[int, int], list] = {shape: [] for shape in tokens}  # what a feature-level draft is sent
    for rnd in range(REPEATS + 1):  # round 0 is the prefill
        for shape in shapes:
            key, n = owner[shape], shape[0]
            rid = ids[key]
            t0 = time.perf_counter()
            reply = await verifiers.step(rnd, [Work(rid, tokens[key], params, state_layers=layers,
                                                    tree=synthetic_chain(n if rnd else 0, vocab_size))])
            if rid not in reply.results:
                raise RuntimeError(f"the verifier did not answer the warm-up's {n}-node step")
            if rnd:
                times.add(shape, t0, reply)
            tokens[key] = tokens[key] + list(reply.results[rid].tokens)
            if reply.results[rid].states is not None:
                states[key].append(reply.results[rid].states)
    fit_verify(latency, times.settled())
    for rid in ids.values():
        verifiers.release(rid)
    if drafts is not None:
        short = [(n, PROMPT_LEN) for n in sizes]
        await _calibrate_draft(latency, drafts, {ids[sh]: (sh[0], tokens[sh], states[sh]) for sh in short},
                               params, max_k, width)
    await verifiers.flush()
    _log_fit(latency)


async def _calibrate_draft(latency: LatencyModel, drafts: Workers, requests: dict[str, tuple[int, list[int], list]],
                           params: SamplingParams, max_k: int, width: int) -> None:
    """Draft each request's (id: tree size n, tokens, target states) tokens to depth min(max_k,
    n) in n nodes; later rounds propose again from the same tokens (only the first sends them,
    and the target's states), so each round drafts the same tree."""
    times, depths = RunTimes(), {}
    for rid, (n, toks, states) in requests.items():
        if n == 0 or n > max_k * width:
            continue
        k, tree = min(max_k, n), None
        for rnd in range(REPEATS + 1):
            t0 = time.perf_counter()
            reply = await drafts.step(rnd, [Work(rid, toks, params, draft_length=k, tree_size=n,
                                                 states=states if rnd == 0 else [])])
            if rnd:  # the first run also takes the prompt
                times.add(n, t0, reply)
            tree = reply.results.get(rid)
        if tree is not None and len(tree):
            depths[n] = (len(tree), k)
        drafts.release(rid)
    for n, ms in times.settled().items():
        if n in depths:
            latency.draft.observe(StepShape(1, 1, depths[n][0], depths[n][1]).draft_features(), ms)
    await drafts.flush()


@dataclass
class WarmUp:
    seconds: float
    cached: bool  # reused a cached calibration instead of measuring


async def warm_up(latency: LatencyModel, verifiers: Workers, drafts: Workers | None, vocab_size: int,
                  pair: str, max_k: int, width: int, max_positions: int | None = None) -> WarmUp:
    """Seed `latency` before serving: from the cache when this machine and code measured this
    model pair before, else by measuring (then cached)."""
    t0 = time.perf_counter()
    key = calibration_cache.cache_key(pair, latency.route_rows, max_k, width)
    state = calibration_cache.load(key)
    if state is not None:
        latency.load_state(state)
        log.info("warm-up: reusing the cached calibration of %s", pair)
        _log_fit(latency)
        return WarmUp(time.perf_counter() - t0, cached=True)
    await calibrate(latency, verifiers, drafts, vocab_size, max_k, width, max_positions)
    calibration_cache.save(key, latency.state())
    return WarmUp(time.perf_counter() - t0, cached=False)
