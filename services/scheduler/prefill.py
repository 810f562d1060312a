"""Chunked prefill within the one step: which prompts join this step, in how many tokens, and
what the step's verify time teaches the token budget (budget.py).

Running requests' decode rows and draft trees come first; prompts still joining fill what the
budget leaves, first come first served (a chunked prompt keeps its place). A chunk the verifier
did not take is sent again from the prompt's start.
"""

from __future__ import annotations

from services.common.sequence import common_prefix
from services.common.tree import DraftTree
from services.scheduler.budget import StepBudget, positions
from services.scheduler.request import Request
from services.scheduler.workers import Reply


def decode_rows(decoding: list[Request], trees: dict[str, DraftTree]) -> int:
    """Verify rows of the decoding requests: the pending token and the draft tree of each."""
    return sum(1 + len(trees.get(r.req_id, ())) for r in decoding)


def shared_prefix(prompt: list[int], decoding: list[Request]) -> int:
    """Tokens at the start of a prompt whose KV the verifier copies instead of computing, when its
    first chunk joins a step beside the decoding requests (Sequence.share_prefix): the longest
    prefix it shares with what one of them holds (all its tokens but the last). Identical
    questions and a shared system prompt cost no rows there, so they spend none of the budget and
    teach the fit nothing false. (Its verifier replica is assumed to hold them: one replica, or
    an n-sample's leader.)"""
    best = 0
    for r in decoding:
        limit = len(r.prompt_ids) + len(r.output_ids) - 1
        n = common_prefix(prompt, r.prompt_ids, limit)
        if n == len(r.prompt_ids):  # the prompt goes on into what that request has written
            n += common_prefix(prompt[n:], r.output_ids, limit - n)
        best = max(best, n)
    return best


class Prefill:
    def __init__(self, budget: StepBudget):
        self.budget = budget
        self.rows = 0  # verify rows of the last step's prompt chunks (`chunks`), for `observe`
        self.positions = 0.0  # and their positions (budget.positions)

    def split(self, batch: list[Request]) -> tuple[list[Request], list[Request]]:
        """(the requests that decode this step, those whose prompt joins in chunks). When nothing
        limits the step's rows, every prompt joins whole and drafts at once."""
        prompts = [r for r in batch if r.prefilling]
        decoding = [r for r in batch if not r.prefilling]
        if prompts and not self.budget.limited(len(decoding)):
            for r in prompts:
                r.prefilled = len(r.prompt_ids)
            return batch, []
        return decoding, prompts

    def fit_trees(self, decoding: list[Request], prompts_wait: bool, trees: dict[str, DraftTree],
                  confs: dict[str, list[float]]) -> None:
        """Cut the trees (in place) to the deepest level whose nodes fit the row limit: a tree cut at
        a depth is the tree that depth would have drafted, so no draft is biased."""
        room = self.budget.tree_rows(len(decoding), prompts_wait)
        if room is None or sum(len(t) for t in trees.values()) <= room:
            return
        counts = [0] * (1 + max(max(t.depths(), default=0) for t in trees.values()))
        for t in trees.values():
            for d in t.depths():
                counts[d] += 1
        depth = 0
        while depth + 1 < len(counts) and sum(counts[: depth + 2]) <= room:
            depth += 1
        for rid, t in trees.items():
            keep = [i for i, d in enumerate(t.depths()) if d <= depth]
            if len(keep) < len(t):
                trees[rid] = t.subtree(keep)
                if rid in confs:
                    confs[rid] = [confs[rid][i] for i in keep]

    def chunks(self, decoding: list[Request], prompts: list[Request], trees: dict[str, DraftTree],
               spent_ms: float) -> list[tuple[Request, int]]:
        """(request, prompt tokens to send this step), first come first served, within the budget
        the decode rows leave (priced where the first prompt's computed rows start: later
        positions cost more)."""
        out, self.rows, self.positions = [], 0, 0.0
        left, priced = None, False
        for r in prompts:
            if r.finished:  # cancelled while the draft worked
                continue
            n = len(r.prompt_ids) - r.prefilled
            shared = 0 if r.prefilled else min(n - 1, shared_prefix(r.prompt_ids, decoding))
            rows = 1 if r.copies_prompt() else n - shared  # a copied prompt joins whole
            if not priced:
                left = self.budget.prompt_rows(decode_rows(decoding, trees), len(decoding), spent_ms,
                                               waiting=len(prompts), start=r.prefilled + n - rows)
                priced = True
            if left is not None:
                if rows > left:
                    rows, n = left, shared + left if left else 0
                left -= rows
            if n <= 0:
                break
            out.append((r, n))
            self.rows += rows
            self.positions += positions(r.prefilled + n - rows, rows)  # the computed rows end the chunk
        return out

    def observe(self, verify_ms: float, decoding: list[Request], trees: dict[str, DraftTree], fresh: set[str]) -> None:
        """Teach the budget the step's verify time: its decode rows, and its prompt rows (the
        chunks', and the whole tokens of a request sent from its start)."""
        rebuilt = [r for r in decoding if r.req_id in fresh]
        kept = [r for r in decoding if r.req_id not in fresh]
        self.budget.observe(verify_ms, decode_rows(kept, trees) + sum(len(trees.get(r.req_id, ())) for r in rebuilt),
                            self.rows + sum(len(r.tokens) for r in rebuilt),
                            self.positions + sum(positions(0, len(r.tokens)) for r in rebuilt))

    def advance(self, chunks: list[tuple[Request, int]], verified: Reply) -> list[Request]:
        """Count the chunks the verifier took (one it did not take resends from the start); the
        requests whose prompt is now all sent, whose verdict commits their first tokens."""
        joined = []
        for r, n in chunks:
            verdict = verified.results.get(r.req_id)
            if verdict is None:
                r.prefilled = 0
                continue
            r.prefilled += n
            if r.prefilling:
                if verdict.states is not None:
                    r.states.append(verdict.states)
            else:
                joined.append(r)
        return joined
