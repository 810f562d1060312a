"""How often drafts are accepted: the scheduler's acceptance estimates (plain Python, no torch).

- `depth_outcomes`: which draft depths of one step the path reached (d - 1 tokens accepted, d
  within the draft length k it was given) and whether each was accepted; the unit every count
  below is made of.
- `Acceptance`: one request's per-depth alpha_d = P(a depth-d draft token is offered and
  accepted | the path reached depth d - 1, k >= d), its own decayed counts over a prior, and how
  many nodes its trees hold for verification per draft token accepted. The planner (policy.py,
  via controller.py) prices each request's draft length with both.
- `AcceptanceStats`: weighted judged/accepted counts per depth, trusted from MIN_JUDGED
  observations on; the priors (priors.py) keep one per request class, locally and summed from
  Redis, and seed each new request's `Acceptance` with its rates.
- `NodeCalibration`: alpha(depth, proposer confidence) per depth and confidence bin, learned
  online; the trim (trim.py) values each proposed node with it.
- `RequestScale`: how one request's nodes fare against that calibration (observed / expected),
  which the trim multiplies into the calibration for that request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.tree import DraftTree

MIN_JUDGED = 10.0  # weighted observations before a depth's shared rate is trusted

BINS = 10  # NodeCalibration: confidence bins over [0, 1]
MAX_DEPTH = 8  # NodeCalibration: depths beyond share the last row


def depth_outcomes(k: int, accepted: int) -> list[tuple[int, bool]]:
    """(depth d, accepted?) for every depth d <= k the path reached (d - 1 tokens accepted) in a
    step given draft length k that had `accepted` tokens accepted. A depth the draft did not
    reach (it stopped early, or the trim cut it) counts as not accepted: the planner prices k
    by what drafting k deep yields, and a draft that stops early when unsure would otherwise
    look sure at every depth it reaches."""
    return [(d, d <= accepted) for d in range(1, min(k, accepted + 1) + 1)]


# -- per request, per depth (the planner) ------------------------------------------------------
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
        self.kept = 0.0  # nodes its verified trees held (decayed like the counts above)
        self.hits = 0.0  # draft tokens those trees got accepted

    def observe(self, k: int, accepted: int, kept: int | None = None) -> None:
        """One step given draft length k: decay what is known, then count its outcomes; `kept`:
        the nodes its verified tree held."""
        self.judged = [v * self.decay for v in self.judged]
        self.accepted = [v * self.decay for v in self.accepted]
        for d, ok in depth_outcomes(min(k, self.max_depth), accepted):
            self.judged[d - 1] += 1.0
            self.accepted[d - 1] += 1.0 if ok else 0.0
        self.kept = self.kept * self.decay + (kept or 0)
        self.hits = self.hits * self.decay + (accepted if kept is not None else 0)

    def kept_per_token(self, prior: float) -> float:
        """Nodes its trees held for verification per draft token accepted, over `prior` (what
        every request's trees held lately) worth `prior_weight` tokens."""
        return (self.kept + self.prior_weight * prior) / (self.hits + self.prior_weight)

    def rates(self) -> list[float]:
        out, above = [], self.default
        for a, n, p in zip(self.accepted, self.judged, self.prior):
            above = (a + self.prior_weight * (above if p is None else p)) / (n + self.prior_weight)
            out.append(above)
        return out


# -- per request class (the priors) ------------------------------------------------------------
@dataclass
class AcceptanceStats:
    """Weighted counts per depth: judged (the path reached d - 1) and accepted."""

    judged: dict[int, float] = field(default_factory=dict)
    accepted: dict[int, float] = field(default_factory=dict)

    def add(self, k: int, accepted: int, weight: float = 1.0) -> None:
        for d, ok in depth_outcomes(k, accepted):
            self.judged[d] = self.judged.get(d, 0.0) + weight
            if ok:
                self.accepted[d] = self.accepted.get(d, 0.0) + weight

    def scale(self, factor: float) -> None:
        self.judged = {d: v * factor for d, v in self.judged.items()}
        self.accepted = {d: v * factor for d, v in self.accepted.items()}

    def merge(self, other: "AcceptanceStats", weight: float) -> None:
        for d, v in other.judged.items():
            self.judged[d] = self.judged.get(d, 0.0) + weight * v
        for d, v in other.accepted.items():
            self.accepted[d] = self.accepted.get(d, 0.0) + weight * v

    def rate(self, depth: int) -> float | None:
        """P(the depth-th draft token is accepted | the path reached depth - 1), or None."""
        n = self.judged.get(depth, 0.0)
        return self.accepted.get(depth, 0.0) / n if n >= MIN_JUDGED else None

    def rates(self, max_depth: int) -> list[float | None]:
        return [self.rate(d) for d in range(1, max_depth + 1)]


# -- per node, by the proposer's confidence (the trim) -----------------------------------------
class NodeCalibration:
    """alpha(depth, confidence): counts per (depth, bin) over a prior worth `prior_weight`
    observations at the bin's own confidence. Every observed tree decays all counts, so a bin that
    is no longer verified (trimmed for looking bad) drifts back to its prior and gets re-tried."""

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.998):
        self.prior_weight, self.decay = prior_weight, decay
        self.judged = [[0.0] * BINS for _ in range(MAX_DEPTH)]
        self.accepted = [[0.0] * BINS for _ in range(MAX_DEPTH)]

    @staticmethod
    def _cell(depth: int, conf: float) -> tuple[int, int]:
        return min(max(depth, 1), MAX_DEPTH) - 1, min(int(conf * BINS), BINS - 1)

    def rate(self, depth: int, conf: float) -> float:
        d, b = self._cell(depth, conf)
        prior = (b + 0.5) / BINS
        return (self.accepted[d][b] + self.prior_weight * prior) / (self.judged[d][b] + self.prior_weight)

    def observe(self, tree: DraftTree, conf: list[float], accepted_nodes: list[int]) -> tuple[float, int]:
        """Learn from one verified tree: every node whose parent was accepted (or is the root)
        was judged; the accepted ones passed. Returns (passes the calibration expected of the
        judged nodes, passes seen)."""
        accepted = set(accepted_nodes)
        depths = tree.depths()
        expected, passed = 0.0, 0
        for table in (self.judged, self.accepted):
            for row in table:
                row[:] = [v * self.decay for v in row]
        for i, parent in enumerate(tree.parents):
            if parent >= 0 and parent not in accepted:
                continue
            expected += self.rate(depths[i], conf[i])
            passed += i in accepted
            d, b = self._cell(depths[i], conf[i])
            self.judged[d][b] += 1.0
            self.accepted[d][b] += 1.0 if i in accepted else 0.0
        return expected, passed


class RequestScale:
    """How one request's nodes fare against the calibration: (passes + w) / (expected + w) over
    its recent steps (decayed), so a request the shared calibration flatters is trimmed harder.
    A step whose tree was trimmed away counts as (0, 0): the scale drifts back to 1 and the
    request's nodes are tried again (an n-gram that failed on one passage may fit the next)."""

    def __init__(self, weight: float = 2.0, decay: float = 0.9):
        self.weight, self.decay = weight, decay
        self.expected = self.passed = 0.0

    def observe(self, expected: float, passed: int) -> None:
        self.expected = self.expected * self.decay + expected
        self.passed = self.passed * self.decay + passed

    @property
    def value(self) -> float:
        return (self.passed + self.weight) / (self.expected + self.weight)
