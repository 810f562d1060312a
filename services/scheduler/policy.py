"""The draft-length policy: how many tokens each request drafts this step (plain Python, no torch).

The plan, over each request's per-depth acceptance (acceptance.py: `Acceptance`, alpha_d =
P(the depth-d draft token is accepted | the path reached depth d - 1), from the request's own
decayed counts blended with a prior shared by every scheduler of the model pair and request
class) and the step's latency model (latency.py: `LatencyModel`, fitted from warm-up
measurements and every step's telemetry):

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

import itertools
from dataclasses import dataclass, field, replace

from services.scheduler.latency import LatencyModel, StepShape, row_context


# The deepest draft adaptive may choose unless told (--max-draft-length): trimming cuts a weak match
# short, so a long verbatim one may be drafted deep.
DEFAULT_MAX_DRAFT_LENGTH = 16


# -- expected tokens ---------------------------------------------------------------------------
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
    # Its tree is trimmed once proposed (trim.py): the trim verifies only the nodes that pay for
    # it, `kept_per_token` of them per draft token they get accepted (Acceptance.kept_per_token;
    # 0: free), so a level's verification is charged in proportion to what it adds. (Nodes kept
    # and tokens gained go together: a long, sure match is verified deep, a weak one not at all.)
    trimmed: bool = False
    context: int = 0  # tokens it holds (each of its rows attends to them: LatencyModel's context terms)
    kept_per_token: float = 0.0
    gains: list[float] = field(init=False, repr=False)  # gains[k] = E(k) for k = 0..max_k
    nodes: list[float] = field(init=False, repr=False)  # nodes[k]: verified when drafting k deep

    def __post_init__(self):
        self.gains = expected_gains(self.rates, self.max_k)
        self.nodes = ([(g - 1.0) * self.kept_per_token for g in self.gains] if self.trimmed
                      else [float(k * self.width) for k in range(self.max_k + 1)])

    def verified(self, k: int) -> float:
        """Nodes verified when it drafts k deep."""
        return self.nodes[k]


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
    context = sum(row_context(1, c.context) for c in cands)
    node_context = sum(row_context(c.verified(k), c.context) for c, k in zip(cands, ks))
    routed = sum(c.verified(k) for c, k in zip(cands, ks) if not c.trimmed)  # whole levels: exact sums
    return StepShape(len(cands), drafting, nodes, deepest, verified, large, context, node_context, routed)


def evaluate(cands: list[Candidate], ks: list[int], cost: LatencyModel,
             depth: int | None = None, large: bool = False) -> tuple[float, float]:
    """(expected output tokens, predicted step ms) of a choice of k per request (with the
    draft's depth term charged at `depth` instead of the deepest k, when given, and the route
    step charged whatever the rows when `large`)."""
    tokens = sum(c.gains[k] for c, k in zip(cands, ks))
    return tokens, cost.step_ms(_shape(cands, ks, depth, large))


def _value(c: Candidate, lam: float, dw: list[float], node_ms: float, k: int) -> float:
    """E(k) - lam * (the ms c's own k adds to the step): drafting's per-request and per-node
    terms, and verifying its nodes at `node_ms` each."""
    return c.gains[k] - lam * (dw[2] * k * c.width + node_ms * c.nodes[k] + (dw[1] if k else 0.0))


def _level(c: Candidate, lam: float, dw: list[float], node_ms: float) -> tuple[float, float]:
    """(keep, cost): a level of c's draft adds keep * (E(k) - E(k - 1)) - cost, in tokens at the
    ratio lam (`node_ms`: c's verify ms per node): drafting it, and verifying its nodes, or for a
    trimmed request the nodes the trim keeps for what it adds."""
    if c.trimmed:
        return 1.0 - lam * node_ms * c.kept_per_token, lam * dw[2] * c.width
    return 1.0, lam * (dw[2] + node_ms) * c.width


def _last_paying(c: Candidate, lo: int, hi: int, keep: float, cost: float) -> int:
    """The last k in [lo, hi] (lo >= 1) whose level pays (`_level`), else lo. A level's cost is
    the same at every depth and E(k) is concave (its increments, path probabilities, never
    grow), so the paying levels are a prefix: a binary search."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keep * (c.gains[mid] - c.gains[mid - 1]) > cost:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _deepest_useful_cap(cands: list[Candidate], lam: float, cost: LatencyModel, prices: list[float]) -> int:
    """A cap deeper than this plans no better at a ratio of lam or above: past it, what a level
    adds over all requests (each one's expected tokens less its drafting and verifying, at lam)
    cannot pay the depth term the level adds. Those net gains only fall with depth and with lam,
    so a binary search finds it, and it holds for the rest of the search. `prices`: each one's
    verify ms per node."""
    dw = cost.draft.weights
    levels = [_level(c, lam, dw, node_ms) for c, node_ms in zip(cands, prices)]

    def pays(level: int) -> bool:
        net = sum(max(0.0, keep * (c.gains[level] - c.gains[level - 1]) - price)
                  for c, (keep, price) in zip(cands, levels) if c.max_k >= level)
        return net > lam * dw[3]

    lo, hi = 0, max(c.max_k for c in cands)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pays(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _choose(cands: list[Candidate], cap: int, lam: float, cost: LatencyModel, prices: list[float]) -> list[int]:
    """Maximize sum_i E_i(k_i) - lam * T(k) over k_i <= cap, with the draft's depth term charged
    at the cap. Without the shared terms the problem separates by request: each one's best k >= 1
    (`_last_paying`), or 0 where that is worth more."""
    dw = cost.draft.weights  # [1, drafting, nodes, depth]
    ks, zeros, chosen = [], [], []  # each one's k, and its value at 0 (None: not allowed) and at k
    for c, node_ms in zip(cands, prices):
        r = range(min(c.min_k, min(cap, c.max_k)), min(cap, c.max_k) + 1)
        zero = _value(c, lam, dw, node_ms, 0) if r.start == 0 else None
        k, v = 0, zero
        if r.stop > 1:
            k = _last_paying(c, max(r.start, 1), r.stop - 1, *_level(c, lam, dw, node_ms))
            v = _value(c, lam, dw, node_ms, k)
            if zero is not None and zero >= v:
                k, v = 0, zero
        ks.append(k)
        zeros.append(zero)
        chosen.append(v)
    if any(ks) and all(z is not None for z in zeros):  # or draft nothing and skip the shared terms
        if sum(zeros) >= sum(chosen) - lam * (dw[0] + dw[3] * cap):
            ks = [0] * len(cands)
    return ks


def _small_shapes(cands: list[Candidate], cost: LatencyModel, prices: list[float]
                  ) -> tuple[list[int] | None, float]:
    """The best choice of k whose verify forward stays within `route_rows` rows (none past a few
    requests, nor without a route step), and its ratio. Only untrimmed requests' rows count toward
    the step (StepShape.routed): their k are enumerated within the room, and for each such choice
    the trimmed requests' k are searched as in `_search_caps`, the route step not charged
    (enumerating theirs too grew as (max_k + 1) ** requests: 17 ** 8 shapes for 8 greedy requests
    at route_rows 8)."""
    room = cost.route_rows - len(cands)
    if cost.route_rows <= 0 or room < 0:
        return None, -1.0
    rows = [i for i, c in enumerate(cands) if not c.trimmed]
    ranges = [range(min(cands[i].min_k, cands[i].max_k), min(cands[i].max_k, room // cands[i].width) + 1)
              for i in rows]
    free = len(rows) < len(cands)
    best, best_ratio = None, -1.0
    for combo in itertools.product(*ranges):
        if sum(cands[i].verified(k) for i, k in zip(rows, combo)) > room:
            continue
        pinned = list(cands)
        for i, k in zip(rows, combo):
            pinned[i] = replace(cands[i], min_k=k, max_k=k)
        ks = _search_caps(pinned, cost, max(min(c.min_k, c.max_k) for c in pinned), prices, large=False)[0] if free \
            else list(combo)
        tok, ms = evaluate(cands, ks, cost)
        if tok / ms > best_ratio * (1 + 1e-12):
            best, best_ratio = ks, tok / ms
    return best, best_ratio


def plan(cands: list[Candidate], cost: LatencyModel) -> Plan:
    """The k per request maximizing expected batch tokens per second. Exact for the linear
    latency model: for each cap on the deepest draft, Dinkelbach's iteration on the ratio with the
    route step always charged (the optimum's own depth is one of the caps, where the capped cost
    is the true cost), then every shape small enough to skip the route step, at its true cost. (A
    shape with the step charged when it is not due only looks worse, so the best of both is the
    true optimum.) Caps run deepest first, from the deepest whose level still pays over the batch
    at the best ratio so far (`_deepest_useful_cap`: a deeper cap plans no better), and each
    one's iteration starts from that ratio, so a cap that cannot beat it is dropped after one
    step: a shape of depth d < cap is judged at its true cost under cap d. One request: every k
    at its true cost."""
    if not cands:
        return Plan({}, 0.0, 0.0, 0.0)
    lowest = max(min(c.min_k, c.max_k) for c in cands)  # every request's own floor fits under it
    if len(cands) == 1:
        best = [_one_request(cands[0], cost, lowest)]
    else:  # the search below, plus the shapes small enough to skip the route step
        prices = [cost.node_ms(c.context) for c in cands]  # each one's verify ms per node, once per plan
        best, best_ratio = _search_caps(cands, cost, lowest, prices)
        small, small_ratio = _small_shapes(cands, cost, prices)
        if small_ratio > best_ratio * (1 + 1e-12):
            best = small
    tok, ms = evaluate(cands, best, cost)
    ptok, pms = evaluate(cands, [min(c.min_k, c.max_k) for c in cands], cost)
    return Plan(dict(zip((c.req_id for c in cands), best)), tok, ms, 1e3 * ptok / pms)


def _one_request(c: Candidate, cost: LatencyModel, lowest: int) -> int:
    """One request's best k: every k at its true cost (exact with a row curve too)."""
    best_k, best_ratio = lowest, -1.0
    costs = cost.single_ms(c.max_k, c.width, c.nodes if c.trimmed else None, c.context)  # [k]: ms drafting k deep
    for k in range(lowest, c.max_k + 1):
        ms = costs[k]
        if c.gains[k] / ms > best_ratio * (1 + 1e-12):
            best_k, best_ratio = k, c.gains[k] / ms
    return best_k


def _search_caps(cands: list[Candidate], cost: LatencyModel, lowest: int, prices: list[float], large: bool = True
                 ) -> tuple[list[int], float]:
    """Dinkelbach's iteration per cap on the deepest draft, route step always charged (`large`;
    otherwise as the rows say), with the row curve at its average slope (so exact without one);
    the best (ks, true ratio) found, the floors' if nothing beats them. A draft whose cost does
    not grow with depth (an n-gram lookup) needs the deepest useful cap only: a lower one only
    shrinks the choice at the same cost."""
    best = [min(c.min_k, c.max_k) for c in cands]  # the floors: drafting must beat them
    tok, ms = evaluate(cands, best, cost)
    best_ratio = tok / ms
    useful = max(lowest, _deepest_useful_cap(cands, best_ratio, cost, prices))
    for cap in range(useful, lowest - 1, -1) if cost.draft.weights[3] > 0 else [useful]:
        if cap > useful:  # the best ratio rose since: fewer levels pay
            continue
        ks, lam = None, best_ratio
        for _ in range(50):
            new = _choose(cands, cap, lam, cost, prices)
            tok, ms = evaluate(cands, new, cost, depth=cap, large=large)
            if tok / ms <= lam * (1 + 1e-12):
                break
            ks, lam = new, tok / ms
        if ks is None:  # nothing under this cap beats the best so far
            continue
        tok, ms = evaluate(cands, ks, cost)
        if tok / ms > best_ratio * (1 + 1e-12):
            best, best_ratio = ks, tok / ms
            useful = max(lowest, _deepest_useful_cap(cands, best_ratio, cost, prices))
    return best, best_ratio
