"""The verifier's judgement of one draft tree (what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree node indices of the accepted path, root downwards
    tokens: list[int]  # accepted tokens followed by the recovered or bonus token
    bonus: bool  # True when the path reached a leaf (no rejection)
