"""Output tokens' log-probabilities, from the verify forward that committed them.

Output token j of a verdict was chosen from row r_j of the verify forward's logits: row 0 (after
the last committed token) for the first, row n + 1 (after tree node n) for the token following
accepted node n. Its log-probability is taken under the request's own sampling distribution
(what vLLM calls processed logprobs): log of softmax(top_p(top_k(logits / T))) when sampling, the
target's plain log-softmax when greedy. Plain decoding reads the same rows of the same forward
ops, so speculation returns the values plain decoding returns.
"""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams, warp_probs
from services.common.verdict import TokenLogprob, Verdict


def token_logprobs(logits: torch.Tensor, verdict: Verdict, params: SamplingParams) -> list[TokenLogprob]:
    """logits: [len(tree) + 1, vocab] of one item; one TokenLogprob per verdict token."""
    rows = [0] + [n + 1 for n in verdict.accepted_nodes[:len(verdict.tokens) - 1]]
    picked = logits[rows]  # [tokens, vocab]
    if params.greedy:
        logp = torch.log_softmax(picked.float(), dim=-1)
    else:
        logp = warp_probs(picked, params.temperature, params.top_k, params.top_p).log()
    chosen = logp.gather(1, torch.tensor(verdict.tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    k = params.logprobs or 0
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [tokens, k]
    out = []
    for tok, lp, values, ids in zip(verdict.tokens, chosen, top_v.tolist(), top_i.tolist()):
        top = [(i, v) for i, v in zip(ids, values) if v != float("-inf")]  # outside top-k / top-p
        out.append(TokenLogprob(tok, lp, top))
    return out
