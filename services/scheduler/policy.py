"""The draft-length policy: how many tokens each request drafts this step (plain Python, no torch).

Three parts, each fitted from what the scheduler measures:

- `LatencyModel`: one step's draft and verify latency as linear functions of the step's shape
  (batch size, tree nodes, draft depth, and whether the verify forward has more than the
  verifier's `route_rows` rows), fitted by exponentially weighted least squares that starts from warm-up
  measurements and follows the telemetry of every step.
- `Acceptance`: per-depth acceptance probabilities alpha_d = P(the depth-d draft token is
  accepted | the path reached depth d - 1) for one request, from its own decayed counts blended
  with a prior shared by every scheduler of the model pair and request class.
- `plan`: picks every request's draft length k to maximize the whole batch's expected output
  tokens per second,

      sum_i E_i(k_i) / T(k_1..k_n),   E(k) = 1 + sum_{d<=k} prod_{j<=d} alpha_j,

  where T is the predicted step latency. k = 0 (plain decoding) is always a candidate, so the
  policy speculates only where the prediction says it pays. The ratio is maximized exactly by
  Dinkelbach's method (for a fixed ratio lambda the problem separates by request) inside an
  enumeration of the step's deepest draft (the term that couples requests), with the route
  term charged; the few shapes small enough to skip it are enumerated on their own.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field


# The deepest draft adaptive may choose unless told (--max-draft-length): trimming cuts a weak match
# short, so a long verbatim one may be drafted deep.
DEFAULT_MAX_DRAFT_LENGTH = 16


# -- latency -----------------------------------------------------------------------------------
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


class RowCurve:
    """Extra verify ms of a forward with r rows over one with 1, measured at warm-up: linear
    between the measured row counts, non-decreasing (a noisy point never makes more rows look
    cheaper), and beyond the last one the average slope of the whole curve."""

    def __init__(self, points: dict[int, float]):
        rows = sorted(r for r in points if r >= 1)
        if not rows or rows[0] != 1:
            rows = [1] + rows
        self.rows, self.ms = rows, []
        top = 0.0
        for r in rows:
            top = max(top, points.get(r, 0.0) if r > 1 else 0.0)
            self.ms.append(top)
        span = rows[-1] - 1
        self.slope = self.ms[-1] / span if span else 0.0

    def __call__(self, rows: int) -> float:
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
    all trees, and the deepest tree (a draft model runs one forward per level)."""

    batch: int
    drafting: int
    nodes: int  # proposed
    depth: int
    verified: int | None = None  # nodes verified, when trimming kept fewer than were proposed

    # True: charge the route step whatever the rows (the planner's Dinkelbach search, see plan)
    large: bool = False

    @property
    def verified_nodes(self) -> int:
        return self.nodes if self.verified is None else self.verified

    def verify_features(self, route_rows: int, curve: RowCurve | None = None) -> tuple[float, ...]:
        """[1, batch, verified nodes, past the route step?, the row curve at batch + nodes] for a
        verifier whose matmul changes route past `route_rows` rows (0: never); the last is 0
        without a measured curve."""
        rows = self.batch + self.verified_nodes
        large = route_rows > 0 and (self.large or rows > route_rows)
        return (1.0, float(self.batch), float(self.verified_nodes), 1.0 if large else 0.0,
                curve(rows) if curve is not None else 0.0)

    def draft_features(self) -> tuple[float, ...]:
        return (1.0, float(self.drafting), float(self.nodes), float(self.depth))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b for a small symmetric positive definite a (Gaussian elimination, pivoting)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / p
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


class LinearFit:
    """y ~ w . x by exponentially weighted least squares with a ridge pull toward prior weights.

    Each observation's weight decays by `decay` per later observation, so the fit follows a
    machine whose speed drifts. Weights are kept non-negative (no latency falls with size).
    """

    def __init__(self, prior: tuple[float, ...], ridge: float = 1e-3, decay: float = 0.995):
        self.prior = list(prior)
        self.ridge, self.decay = ridge, decay
        n = len(prior)
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.samples = 0
        self._w: list[float] | None = list(prior)

    def observe(self, x: tuple[float, ...], y: float) -> None:
        n = len(self.prior)
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


class LatencyModel:
    """Predicted step latency in ms: verify(batch, nodes, route step, row curve) + draft(drafting,
    nodes, depth). `verify_prior` may leave out the last weights (route step 0, row curve 1);
    `route_rows` is the verifier's (0: no route step); `set_curve` adds the measured row curve."""

    def __init__(self, verify_prior: tuple[float, ...] = (30.0, 2.0, 2.0, 0.0),
                 draft_prior: tuple[float, ...] = (2.0, 0.5, 0.5, 1.0), route_rows: int = 0):
        unset = (0.0, 0.0, 0.0, 0.0, 1.0)  # weights of [1, batch, nodes, route step, row curve]
        self.verify = LinearFit(tuple(verify_prior) + unset[len(verify_prior):])
        self.draft = LinearFit(draft_prior)
        self.route_rows = route_rows
        self.curve: RowCurve | None = None

    def set_curve(self, curve: RowCurve) -> None:
        """Use a measured row curve from now on (before the warm-up's observations: they are
        fitted with it)."""
        self.curve = curve

    def verify_ms(self, batch: int, nodes: int) -> float:
        return self.verify.predict(StepShape(batch, 0, nodes, 0).verify_features(self.route_rows, self.curve))

    def node_ms(self) -> float:
        """Verify ms per node, with the row curve taken at its average slope (the planner's
        linear view of it)."""
        w = self.verify.weights
        return w[2] + (w[4] * self.curve.slope if self.curve is not None else 0.0)

    def observe_verify(self, shape: StepShape, verify_ms: float) -> None:
        self.verify.observe(shape.verify_features(self.route_rows, self.curve), verify_ms)

    def observe(self, shape: StepShape, draft_ms: float, verify_ms: float) -> None:
        self.observe_verify(shape, verify_ms)
        if shape.drafting:
            self.draft.observe(shape.draft_features(), draft_ms)

    def step_ms(self, shape: StepShape) -> float:
        ms = self.verify.predict(shape.verify_features(self.route_rows, self.curve))
        if shape.drafting:
            ms += self.draft.predict(shape.draft_features())
        return max(ms, 1e-3)


# -- acceptance --------------------------------------------------------------------------------
def depth_outcomes(depth: int, accepted: int) -> list[tuple[int, bool]]:
    """(depth d, accepted?) for every depth whose draft token the verifier judged: the path
    reached d - 1. A step drafting to `depth` with `accepted` tokens accepted."""
    return [(d, d <= accepted) for d in range(1, min(depth, accepted + 1) + 1)]


@dataclass
class Acceptance:
    """alpha_d for one request: its own counts (decayed each step) over a prior worth
    `prior_weight` observations per depth. A depth without a prior (None) takes the rate found
    one level up, so a request that was never drafted deep is judged by how it does shallow."""

    max_depth: int
    prior: list[float | None]  # alpha_1..alpha_max_depth, None = unknown
    prior_weight: float = 4.0
    decay: float = 0.98  # per step: a half-life of about 34 steps
    default: float = 0.5  # alpha_1 when nothing is known at all
    judged: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.prior = (list(self.prior) + [None] * self.max_depth)[: self.max_depth]
        self.judged = [0.0] * self.max_depth
        self.accepted = [0.0] * self.max_depth

    def observe(self, depth: int, accepted: int) -> None:
        """One step: decay what is known, then count this step's outcomes."""
        self.judged = [v * self.decay for v in self.judged]
        self.accepted = [v * self.decay for v in self.accepted]
        for d, ok in depth_outcomes(min(depth, self.max_depth), accepted):
            self.judged[d - 1] += 1.0
            self.accepted[d - 1] += 1.0 if ok else 0.0

    def rates(self) -> list[float]:
        out, above = [], self.default
        for a, n, p in zip(self.accepted, self.judged, self.prior):
            above = (a + self.prior_weight * (above if p is None else p)) / (n + self.prior_weight)
            out.append(above)
        return out


def expected_gains(rates: list[float], max_k: int) -> list[float]:
    """[E(0), .., E(max_k)]: E(k) is the output tokens of a step drafting k deep (the accepted
    path plus the one the target adds)."""
    total, reach, out = 1.0, 1.0, [1.0]
    for d in range(max(max_k, 0)):
        reach *= rates[d]
        total += reach
        out.append(total)
    return out


def expected_tokens(rates: list[float], k: int) -> float:
    """E(k) (see expected_gains)."""
    return expected_gains(rates, k)[-1]


# -- the plan ----------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One running request as the planner sees it."""

    req_id: str
    rates: list[float]  # alpha_1..alpha_max (at least max_k of them)
    max_k: int  # this request's cap (remaining tokens, the draft's context, max_draft_length)
    min_k: int = 0
    width: int = 1  # tree nodes per level (1 = a chain)
    # Its tree is trimmed once proposed (trim.py): only nodes that pay for their verification are
    # verified, so proposing deeper costs drafting only.
    trimmed: bool = False
    gains: list[float] = field(init=False, repr=False)  # gains[k] = E(k) for k = 0..max_k

    def __post_init__(self):
        self.gains = expected_gains(self.rates, self.max_k)

    def verified(self, k: int) -> int:
        """Nodes verified when it drafts k deep (none before trimming, for a trimmed request)."""
        return 0 if self.trimmed else k * self.width


@dataclass
class Plan:
    k: dict[str, int]
    expected_tokens: float  # sum over requests of E_i(k_i)
    step_ms: float  # predicted
    plain_tokens_per_s: float  # the same batch with k = 0 everywhere (if allowed)

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.expected_tokens / self.step_ms


def _shape(cands: list[Candidate], ks: list[int], depth: int | None = None, large: bool = False) -> StepShape:
    nodes = sum(k * c.width for c, k in zip(cands, ks))
    verified = sum(c.verified(k) for c, k in zip(cands, ks))
    drafting = sum(1 for k in ks if k)
    deepest = max(ks, default=0) if depth is None or not drafting else depth
    return StepShape(len(cands), drafting, nodes, deepest, verified, large)


def evaluate(cands: list[Candidate], ks: list[int], cost: LatencyModel,
             depth: int | None = None, large: bool = False) -> tuple[float, float]:
    """(expected output tokens, predicted step ms) of a choice of k per request (with the
    draft's depth term charged at `depth` instead of the deepest k, when given, and the route
    step charged whatever the rows when `large`)."""
    tokens = sum(c.gains[k] for c, k in zip(cands, ks))
    return tokens, cost.step_ms(_shape(cands, ks, depth, large))


def _choose(cands: list[Candidate], cap: int, lam: float, cost: LatencyModel) -> list[int]:
    """Maximize sum_i E_i(k_i) - lam * T(k) over k_i <= cap, with the draft's depth term charged
    at the cap. Without the shared terms the problem separates by request."""
    dw, node_ms = cost.draft.weights, cost.node_ms()  # [1, drafting, nodes, depth]; verify ms per node

    def value(c: Candidate, k: int) -> float:
        return c.gains[k] - lam * (dw[2] * k * c.width + node_ms * c.verified(k) + (dw[1] if k else 0.0))

    def best(c: Candidate, r: range) -> int:
        # Past k = 0 the cost grows linearly in k and E(k) is concave (its increments, path
        # probabilities, never grow), so the best k >= 1 is the last one whose increment beats
        # the cost of a level (a binary search); ties: smallest k.
        per_level = lam * c.width * (dw[2] + (0.0 if c.trimmed else node_ms))
        lo, hi = max(r.start, 1), r.stop - 1
        while lo < hi:  # the last k in [max(start, 1), stop - 1] with gains[k] - gains[k - 1] > per_level
            mid = (lo + hi + 1) // 2
            if c.gains[mid] - c.gains[mid - 1] > per_level:
                lo = mid
            else:
                hi = mid - 1
        if r.start == 0 and (lo > r.stop - 1 or value(c, 0) >= value(c, lo)):
            return 0
        return lo

    ranges = [range(min(c.min_k, min(cap, c.max_k)), min(cap, c.max_k) + 1) for c in cands]
    ks = [best(c, r) for c, r in zip(cands, ranges)]
    if any(ks) and all(r.start == 0 for r in ranges):  # or draft nothing and skip the shared terms
        drafting = sum(value(c, k) for c, k in zip(cands, ks)) - lam * (dw[0] + dw[3] * cap)
        if sum(value(c, 0) for c in cands) >= drafting:
            ks = [0] * len(cands)
    return ks


def _small_shapes(cands: list[Candidate], route_rows: int) -> list[list[int]]:
    """Every choice of k whose verify forward stays within `route_rows` rows (none past a few
    requests, nor without a route step)."""
    room = route_rows - len(cands)
    if route_rows <= 0 or room < 0:
        return []
    ranges = [range(min(c.min_k, c.max_k), min(c.max_k, room // c.width if not c.trimmed else c.max_k) + 1)
              for c in cands]
    return [list(ks) for ks in itertools.product(*ranges) if sum(c.verified(k) for c, k in zip(cands, ks)) <= room]


def plan(cands: list[Candidate], cost: LatencyModel) -> Plan:
    """The k per request maximizing expected batch tokens per second. Exact for the linear
    latency model: for each cap on the deepest draft, Dinkelbach's iteration on the ratio with the
    route step always charged (the optimum's own depth is one of the caps, where the capped cost
    is the true cost), then every shape small enough to skip the route step, at its true cost. (A
    shape with the step charged when it is not due only looks worse, so the best of both is the
    true optimum.) Caps run deepest first and each one's iteration starts from the best ratio
    found so far, so a cap that cannot beat it is dropped after one step: a shape of depth d < cap
    is judged at its true cost under cap d. One request: every k at its true cost."""
    if not cands:
        return Plan({}, 0.0, 0.0, 0.0)
    lowest = max(min(c.min_k, c.max_k) for c in cands)  # every request's own floor fits under it
    if len(cands) == 1:
        best = [_one_request(cands[0], cost, lowest)]
    else:  # the search below, plus the shapes small enough to skip the route step
        best, best_ratio = _search_caps(cands, cost, lowest)
        for ks in _small_shapes(cands, cost.route_rows):
            tok, ms = evaluate(cands, ks, cost)
            if tok / ms > best_ratio * (1 + 1e-12):
                best, best_ratio = ks, tok / ms
    tok, ms = evaluate(cands, best, cost)
    ptok, pms = evaluate(cands, [min(c.min_k, c.max_k) for c in cands], cost)
    return Plan(dict(zip((c.req_id for c in cands), best)), tok, ms, 1e3 * ptok / pms)


def _one_request(c: Candidate, cost: LatencyModel, lowest: int) -> int:
    """One request's best k: every k at its true cost (exact with a row curve too)."""
    best_k, best_ratio = lowest, -1.0
    for k in range(lowest, c.max_k + 1):
        nodes = k * c.width
        ms = cost.step_ms(StepShape(1, 1 if k else 0, nodes, k, c.verified(k)))
        if c.gains[k] / ms > best_ratio * (1 + 1e-12):
            best_k, best_ratio = k, c.gains[k] / ms
    return best_k


def _search_caps(cands: list[Candidate], cost: LatencyModel, lowest: int) -> tuple[list[int] | None, float]:
    """Dinkelbach's iteration per cap on the deepest draft, route step always charged, with the
    row curve at its average slope (so exact without one); the best (ks, true ratio) found. A
    draft whose cost does not grow with depth (an n-gram lookup) needs the deepest cap only: a
    lower one only shrinks the choice at the same cost."""
    best, best_ratio = None, -1.0
    deepest = max(c.max_k for c in cands)
    for cap in range(deepest, lowest - 1, -1) if cost.draft.weights[3] > 0 else [deepest]:
        ks, lam = None, max(best_ratio, 0.0)
        for _ in range(50):
            new = _choose(cands, cap, lam, cost)
            tok, ms = evaluate(cands, new, cost, depth=cap, large=True)
            if tok / ms <= lam * (1 + 1e-12):
                break
            ks, lam = new, tok / ms
        if ks is None:  # nothing under this cap beats the best so far
            continue
        tok, ms = evaluate(cands, ks, cost)
        if tok / ms > best_ratio * (1 + 1e-12):
            best, best_ratio = ks, tok / ms
    return best, best_ratio
