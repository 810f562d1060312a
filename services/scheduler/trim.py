"""Trimming proposed draft trees to the nodes worth verifying, batch-wide (plain Python, no torch).

The planner (policy.py) decides before drafting how deep each request may draft, from average
acceptance. Once the trees are back, each node says more: the proposer's confidence c in it (a
draft model's q of the token; the n-gram proposer's share of matched continuations through it).
As EAGLE-2's dynamic trees do, the step then verifies only the nodes whose expected gain pays
for their verification cost:

- `NodeCalibration` (acceptance.py) turns (depth, c) into alpha = P(node accepted | its parent
  accepted), counted online per depth and confidence bin (decayed), starting from c itself; a
  request whose nodes pass more or less often than the calibration expects scales it (its own
  observed / expected ratio, `RequestScale`, acceptance.py). A node's value is its path
  probability, the product of alpha along its path: the expected tokens it adds.
- Verifying a node costs what the latency model charges for one more row plus its request's
  node context term (a row attends to every token its request holds), so the set of nodes
  maximizing the step's expected tokens per ms,

      (batch + sum of kept values) / (step ms so far + verify ms of the kept nodes),

  is taken as the best prefix of the nodes sorted by value per ms of their verification (every
  prefix is tried, at the latency model's cost; exact where that cost is linear in the nodes:
  a node pays iff its value per ms beats the best ratio). A node's value is first capped by its
  parent's and its previous sibling's, so every prefix is a valid tree: a node's parent and its
  earlier siblings come with it (what the verifier's sibling-by-sibling rejection sampling
  needs). Dropping nodes never changes what a kept node's q is.

Lossless only where the choice cannot depend on a random draw the verification then relies on:
a sampling request's tree is trimmed only when every node is a point-mass proposal (the n-gram's,
a function of the context); a draft model's sampled tokens are verified as proposed (choosing
them by their own q would bias the output). Greedy requests are always trimmed: the target's
argmax decides whatever subtree is verified. A proposer's `confidence` must likewise be a
function of the context alone.
"""

from __future__ import annotations

import math

from services.common.tree import DraftTree
from services.scheduler.acceptance import NodeCalibration
from services.scheduler.latency import LatencyModel, row_context


def trimmable(tree: DraftTree, greedy: bool) -> bool:
    """May this request's tree be trimmed by its nodes' confidence without bias? (see above)"""
    return greedy or all(len(ids) == 1 for ids in tree.q_ids)


def node_confidence(tree: DraftTree) -> list[float]:
    """The proposer's confidence in each node: its `confidence` when it sent one, else q of the
    node's token (the draft model's own probability)."""
    conf = tree.confidence
    if len(conf) == len(tree.tokens):
        return [min(1.0, max(0.0, float(c))) if math.isfinite(c) else 0.0 for c in conf]
    out = []
    for tok, ids, probs in zip(tree.tokens, tree.q_ids, tree.q_probs):
        out.append(next((float(p) for i, p in zip(ids, probs) if i == tok), 0.0))
    return out


def node_values(tree: DraftTree, conf: list[float], calib: NodeCalibration, scale: float = 1.0) -> list[float]:
    """Each node's path probability (alpha scaled by the request's `scale`), capped by its
    parent's and its previous sibling's value."""
    values: list[float] = []
    last_child: dict[int, int] = {}  # parent -> its latest child so far
    depths = tree.depths()
    for i, parent in enumerate(tree.parents):
        v = min(1.0, calib.rate(depths[i], conf[i]) * scale) * (values[parent] if parent >= 0 else 1.0)
        if parent >= 0:
            v = min(v, values[parent])
        if parent in last_child:
            v = min(v, values[last_child[parent]])
        last_child[parent] = i
        values.append(v)
    return values


def trim(trees: list[DraftTree], calib: NodeCalibration, latency: LatencyModel, spent_ms: float,
         batch: int | None = None, fixed_nodes: int = 0, min_depth: int = 0, scales: list[float] | None = None,
         contexts: list[int] | None = None, context: float = 0.0, fixed_node_context: float = 0.0
         ) -> tuple[list[DraftTree], list[list[float]]]:
    """Trim every request's tree so the step's expected tokens per ms is highest; `spent_ms` is
    what the step cost before verification (drafting), `batch` the requests verified (default:
    one per tree; requests without a tree still yield a token each), `fixed_nodes` the draft
    nodes of the step's untrimmable trees, `min_depth` the depth of each tree's first chain that
    is always kept (--min-draft-length), `scales` each request's `RequestScale`, `contexts` the
    tokens each tree's request holds (default 0), `context` the batch's (StepShape.context) and
    `fixed_node_context` that of the untrimmable trees' nodes (StepShape.node_context's share).
    Returns the trees and their nodes' confidences (for `NodeCalibration.observe` once verified)."""
    batch = len(trees) if batch is None else batch
    scales = scales or [1.0] * len(trees)
    contexts = contexts or [0] * len(trees)
    confs = [node_confidence(t) for t in trees]
    keep: list[list[int]] = [t.first_path()[:min_depth] for t in trees]
    forced_nodes, forced_gain = sum(len(k) for k in keep), 0.0
    ranked = []  # (value, request, node) of the nodes that may be cut
    for r, (tree, conf) in enumerate(zip(trees, confs)):
        forced = set(keep[r])
        for i, v in enumerate(node_values(tree, conf, calib, scales[r])):
            if i in forced:
                forced_gain += v
            else:
                ranked.append((v, r, i))
    # By value per ms of its verification: within a request the order by value (one price), so
    # parents and earlier siblings still come first (on ties by index)
    price = [max(latency.node_ms(c), 1e-9) for c in contexts]
    ranked.sort(key=lambda x: (-x[0] / price[x[1]], x[1], x[2]))
    base_nodes, base_tokens = fixed_nodes + forced_nodes, batch + forced_gain
    node_context = fixed_node_context + sum(row_context(len(k), c) for k, c in zip(keep, contexts))
    best_n, best_ratio, gained, rows_ms = 0, -1.0, 0.0, 0.0
    costs = latency.verify_ms_from(batch, base_nodes, len(ranked) + 1, context, node_context)
    for n, ms in enumerate(costs):  # every prefix, at the latency model's cost (not linear in n)
        if n:
            gained += ranked[n - 1][0]
            rows_ms += latency.context_ms(contexts[ranked[n - 1][1]])
        ratio = (base_tokens + gained) / max(spent_ms + ms + rows_ms, 1e-9)
        if ratio > best_ratio:
            best_n, best_ratio = n, ratio
    for _, r, i in ranked[:best_n]:
        keep[r].append(i)
    out_trees, out_confs = [], []
    for tree, conf, nodes in zip(trees, confs, keep):
        if len(nodes) == len(tree.tokens):
            out_trees.append(tree)
            out_confs.append(conf)
        else:
            out_trees.append(tree.subtree(nodes))
            out_confs.append([conf[i] for i in sorted(nodes)])
    return out_trees, out_confs
