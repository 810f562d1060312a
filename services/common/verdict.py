"""The verifier's judgement of one draft tree (what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.hidden_states import HiddenStates


@dataclass
class TokenLogprob:
    """One output token's log-probability under its request's sampling distribution, and the most
    likely alternatives asked for: (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree node indices of the accepted path, root downwards
    tokens: list[int]  # accepted tokens followed by the recovered or bonus token
    bonus: bool  # True when the path reached a leaf (no rejection)
    states: HiddenStates | None = None  # the target's states of the positions committed, when asked
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them
