"""The step's latency model: draft and verify milliseconds as functions of the step's shape
(plain Python, no torch).

`LatencyModel` predicts one step's draft and verify latency as linear functions of the step's
shape (batch size, tree nodes, draft depth, whether the verify forward has more than the
verifier's `route_rows` rows, the measured `RowCurve`, and the tokens the rows attend to),
fitted by exponentially weighted least squares (`LinearFit`) that starts from warm-up
measurements (calibration.py) and follows the telemetry of every step. The planner (policy.py)
and the trim (trim.py) price drafts with it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


# The verifier's CPU float32 matmul may change route past a row count (services/common/matmul.py:
# small_rows, measured at load and reported in the verifier's Info as route_rows): on a 2-core
# Xeon F.linear streams the weights at memory speed up to 3 rows, then a slower route starts
# (~26 -> ~38 ms for the default model). The latency model charges that step as a term of its
# own; route_rows = 0 means one route at every row count (no step).
#
# Within a route the cost is not linear in rows either: on a 2-core AMD EPYC oneDNN's blocked
# matmul costs about the same from 2 to 6 rows and steps up near 7, 13 and 17 (default model,
# verify ms 17.1 at 1 row, ~18.6 at 2-6, ~21-23 at 7-12, ~25 at 13-17, 2026-12-01). The warm-up
# measures that shape (`RowCurve`, batch 1, every tree size up to calibration.EVERY_SIZE_UP_TO) and the fit
# weighs it as one more feature, so trimming sees which nodes are nearly free.
#
# Each row also attends to every token its request holds, and a request's first row pays most of
# that (it brings the keys and values in; the rows of its tree share those reads): on the CPU
# kernels one row costs 1.8 ms more after 1000 cached tokens than after 50, a 5-row tree 2.6 ms
# more (BENCHMARKS.md). So two features: the tokens the batch's requests hold, and the verified
# nodes x the tokens their request holds (both in thousands), so a long request's nodes are priced
# dearer than a short one's, at what a node adds.
CONTEXT_UNIT = 1000.0

# A step observed to take more than this many times its prediction counts as this many times it
# (LinearFit's clip): a head's draft that once took 150 ms where it takes 2 (a cold call) priced
# every later draft at 4 ms, and the planner stopped drafting, so nothing corrected it.
OUTLIER_CLIP = 3.0
CLIP_FLOOR_MS = 0.5  # a prediction near 0 (a fit still at zero weights) clips at OUTLIER_CLIP x this


class RowCurve:
    """Extra verify ms of a forward with r rows over one with 1, measured at warm-up: linear
    between the measured row counts, non-decreasing, and beyond the last one the average slope of
    the whole curve. Timing noise only adds (another process on the cores, a wait in a queue), so
    a point dearer than one measured at more rows is noise and is lowered to it: an overestimate
    would never be corrected online (the nodes it prices out are never verified), an underestimate
    is, by the steps that verify them."""

    def __init__(self, points: dict[int, float]):
        rows = sorted(r for r in points if r >= 1)
        if not rows or rows[0] != 1:
            rows = [1] + rows
        self.rows = rows
        self.ms = [max(0.0, points.get(r, 0.0)) if r > 1 else 0.0 for r in rows]
        for i in range(len(rows) - 2, 0, -1):
            self.ms[i] = min(self.ms[i], self.ms[i + 1])
        span = rows[-1] - 1
        self.slope = self.ms[-1] / span if span else 0.0

    def __call__(self, rows: float) -> float:
        if rows <= 1:
            return 0.0
        if rows >= self.rows[-1]:
            return self.ms[-1] + (rows - self.rows[-1]) * self.slope
        hi = bisect.bisect_left(self.rows, rows)  # rows[hi - 1] < rows <= rows[hi]
        r0, r1, m0, m1 = self.rows[hi - 1], self.rows[hi], self.ms[hi - 1], self.ms[hi]
        return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)


@dataclass(frozen=True)
class StepShape:
    """What a step costs is a function of: requests verified, requests drafting, draft nodes in
    all trees, the deepest tree (a draft model runs one forward per level), and the tokens the
    verified rows attend to."""

    batch: int
    drafting: int
    nodes: int  # proposed
    depth: int
    verified: float | None = None  # nodes verified, when trimming kept fewer (planned: expected)

    # True: charge the route step whatever the rows (the planner's Dinkelbach search, see plan)
    large: bool = False
    context: float = 0.0  # sum over requests of the tokens each holds before the step, / CONTEXT_UNIT
    node_context: float = 0.0  # sum over requests of verified nodes x tokens held, / CONTEXT_UNIT
    # Planned: the verified nodes that count toward the route step (None: all). Those of trees
    # still to be trimmed do not: the trim sees the step and crosses it only where that pays.
    routed: float | None = None

    @property
    def verified_nodes(self) -> float:
        return self.nodes if self.verified is None else self.verified

    def verify_features(self, route_rows: int, curve: RowCurve | None = None) -> tuple[float, ...]:
        return verify_features(self.batch, self.verified_nodes, route_rows, curve, self.large, self.context,
                               self.node_context, self.routed)

    def draft_features(self) -> tuple[float, ...]:
        return draft_features(self.drafting, self.nodes, self.depth)


def verify_features(batch: int, verified: float, route_rows: int, curve: RowCurve | None = None,
                    large: bool = False, context: float = 0.0, node_context: float = 0.0,
                    routed: float | None = None) -> tuple[float, ...]:
    """[1, batch, verified nodes, past the route step?, the row curve at batch + nodes, context,
    node context] for a verifier whose matmul changes route past `route_rows` rows (0: never;
    `large`: charge the step whatever the rows; `routed`: the nodes that count toward it, if not
    all); the curve's term is 0 without a measured curve; the context terms are StepShape's."""
    rows = batch + verified
    past = route_rows > 0 and (large or batch + (verified if routed is None else routed) > route_rows)
    return (1.0, float(batch), float(verified), 1.0 if past else 0.0, curve(rows) if curve is not None else 0.0,
            float(context), float(node_context))


def row_context(rows: float, tokens: int) -> float:
    """`rows` rows of a request holding `tokens` tokens, in the context terms' unit."""
    return rows * tokens / CONTEXT_UNIT


def draft_features(drafting: int, nodes: int, depth: int) -> tuple[float, ...]:
    """[1, requests drafting, draft nodes, deepest tree]."""
    return (1.0, float(drafting), float(nodes), float(depth))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b for a small symmetric positive definite a: Gaussian elimination, which needs
    no pivoting for such a matrix (every pivot is positive), then back substitution."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        top = m[col]
        for r in range(col + 1, n):
            f = m[r][col] / top[col]
            if f != 0.0:
                m[r] = [x - f * y for x, y in zip(m[r], top)]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        row = m[i]
        x[i] = (row[n] - sum(row[j] * x[j] for j in range(i + 1, n))) / row[i]
    return x


class LinearFit:
    """y ~ w . x by exponentially weighted least squares with a ridge pull toward prior weights.

    Each observation's weight decays by `decay` per later observation, so the fit follows a
    machine whose speed drifts. Weights are kept non-negative (no latency falls with size).
    With `clip`, an observation is first cut to `clip` times the fit's prediction, once the fit
    has twice as many observations as weights: a least-squares fit follows a single far outlier
    (a cold first call, a page fault, the collector) for hundreds of observations, while a real
    change of speed still moves the prediction by up to that factor per observation.
    """

    def __init__(self, prior: tuple[float, ...], ridge: float = 1e-3, decay: float = 0.995,
                 clip: float | None = None):
        self.prior = list(prior)
        self.ridge, self.decay, self.clip = ridge, decay, clip
        n = len(prior)
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.samples = 0
        self._w: list[float] | None = list(prior)

    def observe(self, x: tuple[float, ...], y: float) -> None:
        n = len(self.prior)
        if self.clip is not None and self.samples >= 2 * n:
            y = min(y, self.clip * max(self.predict(x), CLIP_FLOOR_MS))
        for i in range(n):
            self.xty[i] = self.xty[i] * self.decay + x[i] * y
            row = self.xtx[i]
            for j in range(n):
                row[j] = row[j] * self.decay + x[i] * x[j]
        self.samples += 1
        self._w = None

    @property
    def weights(self) -> list[float]:
        if self._w is None:
            n = len(self.prior)
            a = [[self.xtx[i][j] + (self.ridge if i == j else 0.0) for j in range(n)] for i in range(n)]
            b = [self.xty[i] + self.ridge * self.prior[i] for i in range(n)]
            w = _solve(a, b)
            if any(v < 0 for v in w):  # refit with the negative terms pinned at zero
                keep = [i for i, v in enumerate(w) if v > 0]
                sub = _solve([[a[i][j] for j in keep] for i in keep], [b[i] for i in keep]) if keep else []
                w = [0.0] * n
                for i, v in zip(keep, sub):
                    w[i] = max(0.0, v)
            self._w = w
        return self._w

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(w * v for w, v in zip(self.weights, x))

    def state(self) -> dict:
        return {"prior": self.prior, "xtx": self.xtx, "xty": self.xty, "samples": self.samples}

    def load_state(self, state: dict) -> None:
        if len(state["prior"]) != len(self.prior):
            raise ValueError(f"a fit of {len(state['prior'])} features cannot load into one of {len(self.prior)}")
        self.prior = [float(v) for v in state["prior"]]
        self.xtx = [[float(v) for v in row] for row in state["xtx"]]
        self.xty = [float(v) for v in state["xty"]]
        self.samples = int(state["samples"])
        self._w = None


class LatencyModel:
    """Predicted step latency in ms: verify(batch, nodes, route step, row curve, context, node
    context) + draft(drafting, nodes, depth). `verify_prior` may leave out the last weights (route
    step 0, row curve 1, contexts 0); `route_rows` is the verifier's (0: no route step);
    `set_curve` adds the measured row curve."""

    def __init__(self, verify_prior: tuple[float, ...] = (30.0, 2.0, 2.0, 0.0),
                 draft_prior: tuple[float, ...] = (2.0, 0.5, 0.5, 1.0), route_rows: int = 0):
        unset = (0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0)  # [1, batch, nodes, route step, row curve, contexts]
        self.verify = LinearFit(tuple(verify_prior) + unset[len(verify_prior):], clip=OUTLIER_CLIP)
        self.draft = LinearFit(draft_prior, clip=OUTLIER_CLIP)
        self.route_rows = route_rows
        self.curve: RowCurve | None = None

    def set_curve(self, curve: RowCurve) -> None:
        """Use a measured row curve from now on (before the warm-up's observations: they are
        fitted with it)."""
        self.curve = curve

    def state(self) -> dict:
        """Everything fitted so far, as plain JSON values (the warm-up's cache)."""
        curve = None if self.curve is None else [[r, ms] for r, ms in zip(self.curve.rows, self.curve.ms)]
        return {"verify": self.verify.state(), "draft": self.draft.state(), "curve": curve}

    def load_state(self, state: dict) -> None:
        self.verify.load_state(state["verify"])
        self.draft.load_state(state["draft"])
        self.curve = None if state["curve"] is None else RowCurve({int(r): float(ms) for r, ms in state["curve"]})

    def verify_ms(self, batch: int, nodes: int, context: float = 0.0, node_context: float = 0.0) -> float:
        return self.verify.predict(verify_features(batch, nodes, self.route_rows, self.curve, False, context,
                                                   node_context))

    def verify_ms_from(self, batch: int, nodes: int, count: int, context: float = 0.0,
                       node_context: float = 0.0) -> list[float]:
        """[verify_ms(batch, n, context, node_context) for n = nodes .. nodes + count - 1] without
        a StepShape each: the trim prices every prefix of a batch's nodes each step (adding each
        node's own context_ms)."""
        return [self.verify.predict(verify_features(batch, n, self.route_rows, self.curve, False, context,
                                                    node_context))
                for n in range(nodes, nodes + count)]

    def context_ms(self, tokens: int) -> float:
        """What a node of a request holding `tokens` tokens adds through the node context term."""
        return self.verify.weights[6] * row_context(1, tokens)

    def node_ms(self, tokens: int = 0) -> float:
        """Verify ms per node of a request holding `tokens` tokens, with the row curve taken at
        its average slope (the planner's linear view of it)."""
        w = self.verify.weights
        return w[2] + (w[4] * self.curve.slope if self.curve is not None else 0.0) + self.context_ms(tokens)

    def observe_verify(self, shape: StepShape, verify_ms: float) -> None:
        self.verify.observe(shape.verify_features(self.route_rows, self.curve), verify_ms)

    def observe(self, shape: StepShape, draft_ms: float, verify_ms: float) -> None:
        self.observe_verify(shape, verify_ms)
        if shape.drafting:
            self.draft.observe(shape.draft_features(), draft_ms)

    def step_ms(self, shape: StepShape) -> float:
        return self._ms(shape.verify_features(self.route_rows, self.curve),
                        shape.draft_features() if shape.drafting else None)

    def single_ms(self, max_k: int, width: int = 1, verified: list[float] | None = None,
                  tokens: int = 0) -> list[float]:
        """[step_ms of one request holding `tokens` tokens alone, drafting k deep, for k =
        0..max_k]: k * width nodes, of which verified[k] are verified once its tree is trimmed
        (default: all, untrimmed). The planner prices every k of a lone request each step, and a
        StepShape and feature tuples per k were most of its time: each shape's features are written
        out here instead, summed in predict's order (so bit for bit the same ms)."""
        v, d, curve, route = self.verify.weights, self.draft.weights, self.curve, self.route_rows
        base = v[0] * 1.0 + v[1] * 1.0
        ctx = v[5] * float(row_context(1, tokens))
        out = []
        for k in range(max_k + 1):
            n = verified[k] if verified is not None else k * width
            past = 1.0 if route > 0 and 1 + (n if verified is None else 0.0) > route else 0.0
            ms = (base + v[2] * float(n) + v[3] * past + v[4] * (curve(1 + n) if curve is not None else 0.0) + ctx
                  + v[6] * float(row_context(n, tokens)))
            if k:
                ms += d[0] * 1.0 + d[1] * 1.0 + d[2] * float(k * width) + d[3] * float(k)
            out.append(max(ms, 1e-3))
        return out

    def _ms(self, verify_x: tuple[float, ...], draft_x: tuple[float, ...] | None) -> float:
        ms = self.verify.predict(verify_x)
        if draft_x is not None:
            ms += self.draft.predict(draft_x)
        return max(ms, 1e-3)
