"""What a worker (draft or verifier) holds per request: a `Sequence`, kept in its `Sequences`.

A sequence is the request's committed tokens as this worker was sent them, its sampling
parameters (sent once, with the request's first item to the worker), its random stream (T > 0),
and the model's KV cache with the committed prefix it holds. The same type serves the verifier and
the model proposer, in a service and in-process, so syncing a cache to the committed tokens and
keeping an accepted path are written once (`sync`, `keep_path`).

Step messages carry only the tokens a worker has not seen yet: `offset` (how many it already
has) and `tokens` (the rest). A worker that lost its state, or a new replica, cannot extend an
offset it never saw and answers `need_resync` (`Sequences.update` returns None); the scheduler
then resends from offset 0, with the parameters.

Given the model's vocabulary size and context length, `Sequences.update` also refuses
(ValueError, which a step stream answers with INVALID_ARGUMENT) token ids outside the vocabulary,
a request with no committed token, and more committed tokens than the context holds: the model
would otherwise index past its embedding or position tables, or allocate caches of any size a
client asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.kv_cache import KVCache
from services.common.sampling import SamplingParams, make_generator


def common_prefix(a, b, limit: int | None = None) -> int:
    """How many leading items a and b share, at most `limit`."""
    n, end = 0, min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Sequence:
    req_id: str
    params: SamplingParams
    generator: torch.Generator | None  # this worker's random stream of the request (T > 0)
    tokens: list[int] = field(default_factory=list)  # every committed token (prompt + output so far)
    cache: KVCache | None = None  # a model worker's KV; slots [0, len(cached)) hold `cached`
    cached: list[int] = field(default_factory=list)
    scratch: object = None  # a proposer's own record of the step before (e.g. the tree it drafted)
    constraint: object = None  # its grammar's matcher at a worker that masks (services/common/constraint.py)

    def sync(self) -> bool:
        """Roll the cache back to the longest prefix it shares with the committed tokens, leaving
        at least the last committed token out (the next forward takes it as input: its logits
        are the root's). True when anything was dropped."""
        n = len(self.cached)
        if n < len(self.tokens) and self.tokens[:n] == self.cached:
            return False
        common = common_prefix(self.cached, self.tokens, len(self.tokens) - 1)
        self.cached = self.cached[:common]
        if self.cache is not None:
            self.cache.truncate(common)
        return True

    def keep_path(self, nodes: list[int], tokens: list[int]) -> None:
        """After a forward that fed tree node i into slot len(cached) + i: keep the KV of the
        path `nodes` (root downwards; their token ids `tokens`) next to the cached prefix and
        drop the rest of the tree. Nothing is recomputed."""
        base = len(self.cached)
        self.cache.keep(base, [base + i for i in nodes])
        self.cached = self.cached + list(tokens)

    def nbytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    def share_prefix(self, others, capacity: int) -> bool:
        """Give this sequence, which has no cache yet, a copy of the KV of the longest prefix of
        its tokens that another sequence holds (the other samples of one prompt, n > 1; a shared
        system prompt): copied, not recomputed (its last token stays out, as `sync` leaves it).
        False when none shares a token. Only for caches whose slots hold `cached`, in order."""
        best, donor = 0, None
        for other in others:
            if other is self or other.cache is None:
                continue
            n = common_prefix(other.cached, self.tokens, len(self.tokens) - 1)
            if n > best:
                best, donor = n, other
        if donor is None:
            return False
        self.cache = donor.cache.fork(best, capacity)
        self.cached = donor.cached[:best]
        return True


class Sequences:
    """A worker's sequences by request id; `random_stream` tells the draft's (0) and the
    verifier's (1) streams of one seed apart."""

    def __init__(self, random_stream: int, vocab_size: int | None = None, max_positions: int | None = None):
        self.random_stream = random_stream
        self.vocab_size = vocab_size or None  # None (or 0): token ids are not checked
        self.max_positions = max_positions or None  # None (or 0): no length limit
        self._seqs: dict[str, Sequence] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._seqs

    def ids(self) -> list[str]:
        return list(self._seqs)

    def get(self, req_id: str) -> Sequence | None:
        return self._seqs.get(req_id)

    def update(self, req_id: str, offset: int, tokens: list[int],
               params: SamplingParams | None = None) -> Sequence | None:
        """The request's sequence with `tokens` written from `offset` on, or None when a resync
        is needed. Offset 0 starts the request afresh (with `params`, required then); later
        `params` replace the request's. Raises ValueError (changing nothing) for tokens the model
        cannot take."""
        seq = self._seqs.get(req_id)
        if offset != 0 and (seq is None or not 0 < offset <= len(seq.tokens)):
            return None
        self._check(req_id, offset, tokens)
        if offset == 0:
            if params is None:
                raise ValueError(f"request {req_id!r}: its first item carries no sampling parameters")
            fresh = seq is None or params != seq.params
            seq = seq if not fresh else Sequence(req_id, params, self._generator(params))
            self._seqs[req_id] = seq
        elif params is not None and params != seq.params:
            seq.params, seq.generator, seq.constraint = params, self._generator(params), None
        del seq.tokens[offset:]
        seq.tokens.extend(tokens)
        return seq

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        return None if params.greedy else make_generator(params.seed, self.random_stream)

    def _check(self, req_id: str, offset: int, tokens: list[int]) -> None:
        total = offset + len(tokens)
        if total == 0:
            raise ValueError(f"request {req_id!r}: no committed token (a request needs at least one)")
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(f"request {req_id!r}: {total} committed tokens exceed the context of "
                             f"{self.max_positions} tokens")
        if self.vocab_size is not None:
            bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {req_id!r}: token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def release(self, req_id: str) -> None:
        self._seqs.pop(req_id, None)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._seqs.values())
