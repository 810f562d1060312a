"""A request as the scheduler owns it: prompt, committed tokens, stopping, statistics. (Its random
streams and KV caches live in the workers' sequences: services/common/sequence.py.)"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.detokenizer import Detokenizer
from services.common.hidden_states import HiddenStates, join
from services.common.sampling import SamplingParams
from services.common.verdict import TokenLogprob


@dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0  # draft tokens proposed (tree nodes)
    accepted: int = 0  # draft tokens accepted
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None


class Request:
    def __init__(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, eos_token_ids: tuple[int, ...], draft_length: int, tree_size: int,
                 fixed_k: int | None = None, request_class: str = "default"):
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self.req_id = req_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per output token, when params.logprobs asks
        self.finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled", "error"
        self.error = ""  # why it failed (finish_reason "error")
        self.unavailable = False  # failed for want of a worker replica (retryable elsewhere)
        self.held_since: float | None = None  # when it began to wait for a verifier replica (core.py)
        self.draft_length = draft_length  # the largest k a step may give it
        self.tree_size = tree_size
        self.fixed_k = fixed_k  # None: the adaptive controller chooses its k every step
        self.request_class = request_class  # whose acceptance priors it shares (services/scheduler/priors.py)
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.detok = Detokenizer(tokenizer, params.stop)
        self.stats = RequestStats()
        # Chunked prefill (core.py): the prompt tokens the verifier has been sent so far; the
        # request drafts and decodes once all are (the step sets it to the whole prompt at once
        # when nothing limits its rows).
        self.prefilled = 0
        self.draft_prefilled = 0  # of those, the draft has been sent (a chunk behind the verifier)
        # The target's states the verifier returned since the draft was last sent them (a
        # feature-level draft reads them; empty for the others).
        self.states: list[HiddenStates] = []
        # Another request with the same prompt (n > 1): this one starts once that one has its
        # first token, so the workers copy the prompt's KV (core.py, Sequence.share_prefix).
        self.follows: Request | None = None
        self._grams: set[tuple[int, ...]] = set()  # its m-grams ending before its last token (`recurs`)
        self._gram_size = self._grams_end = 0

    def take_states(self) -> list[HiddenStates]:
        states, self.states = join(self.states), []
        return states

    @property
    def near(self) -> str:
        """The request whose worker replicas this one should join (its prompt's KV is there)."""
        return self.follows.req_id if self.follows is not None else ""

    def may_start(self) -> bool:
        """Whether admission may start it: the request it follows has its first token (or ended)."""
        f = self.follows
        return f is None or f.finished or bool(f.output_ids)

    def copies_prompt(self) -> bool:
        """Its workers will copy its whole prompt's KV from the request it follows, which holds it
        (so sending the prompt costs one verify row: its last token, for the root's logits)."""
        f = self.follows
        return self.prefilled == 0 and f is not None and not f.finished and not f.prefilling

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def recurs(self, m: int) -> bool:
        """Whether its last m committed tokens occurred earlier in it (where a lookup draft finds
        a match). Each token is added to the index once."""
        tokens = self.tokens
        if len(tokens) <= m:
            return False
        if m != self._gram_size:
            self._grams, self._gram_size, self._grams_end = set(), m, m - 1
        for end in range(self._grams_end, len(tokens) - 1):  # the grams ending before the last token
            self._grams.add(tuple(tokens[end - m + 1: end + 1]))
        self._grams_end = len(tokens) - 1
        return tuple(tokens[-m:]) in self._grams

    def draft_budget(self, k: int) -> tuple[int, int]:
        """(draft length, tree size) for this step given a chosen k. A step always yields one
        token beyond the accepted ones, so drafting past the last token the request may still
        emit is wasted work."""
        k = max(0, min(k, self.remaining() - 1))
        return k, (min(self.tree_size, 256) if k else 0)

    def commit(self, tokens: list[int], drafted: int, accepted: int,
               logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Commit one step's output tokens (and their logprobs, when the verifier sent them),
        stopping at EOS, a stop string or max_tokens.

        Returns the tokens actually committed (a prefix of `tokens`).
        """
        self.stats.steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        if self.stats.first_token_at is None:
            self.stats.first_token_at = time.perf_counter()
        committed = []
        for tok in tokens:
            self.output_ids.append(tok)
            committed.append(tok)
            stop = self.detok.add(tok)
            if tok in self.eos_token_ids or stop is not None:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                self.stats.finished_at = time.perf_counter()
                break
        if logprobs is not None:
            self.logprobs.extend(logprobs[:len(committed)])
        return committed

    def last_logprobs(self, n: int) -> list[TokenLogprob] | None:
        """The logprobs of the last `n` output tokens (None when the request asks for none)."""
        if self.params.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - n:] if n else []

    def summary(self) -> dict:
        s = self.stats
        elapsed = (s.finished_at or time.perf_counter()) - s.started
        n = len(self.output_ids)
        return {
            "text": self.text,
            "token_ids": list(self.output_ids),
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "steps": s.steps,
            "drafted_tokens": s.drafted,
            "accepted_tokens": s.accepted,
            "mean_accepted_length": n / s.steps if s.steps else 0.0,
            "acceptance_rate": s.accepted / s.drafted if s.drafted else 0.0,
            "elapsed_s": elapsed,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
        }
