"""The verifier's judgement of one draft tree (what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.hidden_states import HiddenStates


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree node indices of the accepted path, root downwards
    tokens: list[int]  # accepted tokens followed by the recovered or bonus token
    bonus: bool  # True when the path reached a leaf (no rejection)
    states: HiddenStates | None = None  # the target's states of the positions committed, when asked
