"""A request's grammar at a worker: llguidance's matcher kept at the request's committed tokens,
and the token masks it gives the rows of a draft tree.

Row 0 of a tree is the root (the state after the committed tokens), row i + 1 node i (the state
after the node's path). The verifier masks the target's logits with every row, so the accepted,
recovered and bonus tokens all come from the grammar-masked distribution: exactly plain
constrained decoding. A node whose token the grammar refuses has p = 0 and is always rejected;
its row and its descendants' rows stay unmasked (never reached).

A draft worker prunes such nodes before they cost a verified row, where that is exact: at
temperature 0 always; above it only when the node's whole q lies outside the grammar (then its
rejection leaves the residual p - q equal to p). A node drawn from a q with mass inside the
grammar stays: its rejection shapes the residual its later siblings are tried against.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import torch

from services.common.grammar import Grammar
from services.common.sequence import Sequence, common_prefix
from services.common.tree import MAX_TREE_NODES, DraftTree, path_to

_SHIFTS = torch.arange(32, dtype=torch.int32)


class Constraints:
    """A worker's grammar engine: llguidance's view of the target's tokenizer, built on first use
    (about half a second for a 49k vocabulary), and each request's `Constraint`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        # A compiled matcher per grammar text, copied for each request (a copy costs ~1 us, a
        # compile ~0.7 ms: n samples and repeated schemas compile once).
        self._template = lru_cache(maxsize=64)(self._compile)

    @cached_property
    def tokenizer(self):
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                eos_token=self.eos_token_ids or None)
        except (ValueError, TypeError) as e:  # llguidance reads byte-level and SentencePiece tokenizers
            raise ValueError(f"structured outputs need a tokenizer the grammar engine can read: {e}") from None

    def check(self, grammar: Grammar) -> None:
        """ValueError when the grammar is malformed or cannot work with this tokenizer."""
        grammar.validate()
        self.matcher(grammar)

    def matcher(self, grammar: Grammar):
        """A new matcher at the grammar's start; ValueError when the engine rejects the grammar."""
        return self._template(grammar.engine_form()).deep_copy()

    def _compile(self, engine_form: str):
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, engine_form, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar engine rejects the grammar: {m.get_error().strip().splitlines()[0]}")
        return m

    def of(self, seq: Sequence) -> Constraint | None:
        """The sequence's constraint at its committed tokens (None without a grammar)."""
        grammar = seq.params.grammar
        if grammar is None:
            return None
        if seq.constraint is None:
            seq.constraint = Constraint(self.matcher(grammar), grammar.start, self.tokenizer.vocab_size)
        seq.constraint.follow(seq.tokens)
        return seq.constraint


class Constraint:
    def __init__(self, matcher, start: int, vocab_size: int):
        self.matcher, self.start = matcher, start
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self.consumed: list[int] = []  # the output tokens the matcher has taken

    def follow(self, tokens: list[int]) -> None:
        """Bring the matcher to the committed tokens (prompt + output): roll back what they no
        longer hold, take the new ones. ValueError when a committed token breaks the grammar."""
        out = tokens[self.start:]
        common = common_prefix(out, self.consumed)
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        new = out[common:]
        taken = self.matcher.try_consume_tokens(new) if new else 0
        self.consumed.extend(new[:taken])
        # Past the grammar's end (ignore_eos) only end tokens follow: they leave the state as is.
        if taken < len(new) and not self.matcher.is_stopped():
            raise ValueError("a committed token lies outside the request's grammar")

    def rows(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        """Bitmasks [len(tree) + 1, words] int32 (bit t of a row: token t allowed) and, per node,
        whether the grammar takes its token after its path. Rows of refused nodes and their
        descendants are all ones."""
        masks = torch.full((len(tree) + 1, self.words), -1, dtype=torch.int32)
        ok = [False] * len(tree)
        kids = tree.children()
        self._fill(masks[0])
        stack: list[int | None] = [c for c in reversed(kids[0])]  # None: leave the node above
        while stack:
            c = stack.pop()
            if c is None:
                self.matcher.rollback(1)
                continue
            parent_row = masks[tree.parents[c] + 1]
            if not _allowed(parent_row, tree.tokens[c]):
                continue
            if self.matcher.is_stopped():  # an end token past the grammar's end: the state stays
                masks[c + 1] = parent_row
            elif self.matcher.try_consume_tokens([tree.tokens[c]]) == 1:
                self._fill(masks[c + 1])
                stack.append(None)
            else:  # the mask allowed what the matcher does not take (unexpected): refused all the same
                continue
            ok[c] = True
            stack.extend(reversed(kids[c + 1]))
        return masks, ok

    def path_masks(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """Bitmasks [len(nodes), words] after each node's path (node -1: the root), for a draft
        growing its tree; all ones for a node the grammar refuses."""
        masks = torch.full((len(nodes), self.words), -1, dtype=torch.int32)
        for row, node in enumerate(nodes):
            path = [tree.tokens[n] for n in path_to(node, tree.parents)]
            taken = self.matcher.try_consume_tokens(path) if path else 0
            if taken == len(path) or self.matcher.is_stopped():  # past the end: end tokens only
                self._fill(masks[row])
            if taken:
                self.matcher.rollback(taken)
        return masks

    def forced(self, path: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after `path`: each the only token it allows
        (an end token last when the grammar is complete). The masked target gives each p = 1,
        so as draft nodes they are always accepted (the jump-forward of other servers, here
        verified like any draft)."""
        taken = self.matcher.try_consume_tokens(path) if path else 0
        out: list[int] = []
        consumed = 0
        row = torch.empty(self.words, dtype=torch.int32)
        while taken == len(path) and len(out) < limit:
            self._fill(row)
            token = _only(row)
            if token is None:
                break
            if self.matcher.is_stopped():  # the grammar is complete: its end token ends the chain
                out.append(token)
                break
            if self.matcher.try_consume_tokens([token]) != 1:
                break
            out.append(token)
            consumed += 1
        if taken + consumed:
            self.matcher.rollback(taken + consumed)
        return out

    def extend_forced(self, tree: DraftTree, depth: int) -> DraftTree:
        """The tree with its first path continued by the tokens the grammar forces after it,
        down to `depth` (a copy; the proposer keeps its own)."""
        path = tree.first_path()
        room = min(depth - len(path), MAX_TREE_NODES - len(tree))
        forced = self.forced([tree.tokens[n] for n in path], room) if room > 0 else []
        if not forced:
            return tree
        out = tree.subtree(list(range(len(tree))))
        parent = path[-1] if path else -1
        for token in forced:
            parent = out.add(token, parent, [token], [1.0])
            if out.confidence:
                out.confidence.append(1.0)
        return out

    def mask(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """logits [len(tree) + 1, vocab] with every token the grammar refuses at -inf."""
        masks, _ = self.rows(tree)
        return apply_masks(logits, masks)

    def prune(self, tree: DraftTree, greedy: bool) -> DraftTree:
        """The tree without the nodes the verifier would reject for the grammar alone, where
        dropping them is exact (see the module's docstring)."""
        masks, ok = self.rows(tree)
        keep, live = [], set()  # live: kept nodes whose token the grammar takes
        for c, parent in enumerate(tree.parents):
            if parent >= 0 and parent not in live:
                continue
            if ok[c]:
                keep.append(c)
                live.add(c)
            elif not greedy and any(p > 0 and _allowed(masks[parent + 1], i)
                                    for i, p in zip(tree.q_ids[c], tree.q_probs[c])):
                keep.append(c)
        return tree if len(keep) == len(tree) else tree.subtree(keep)

    def _fill(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def _only(row: torch.Tensor) -> int | None:
    """The token of a bitmask row that allows exactly one, else None."""
    words = torch.nonzero(row).flatten()
    if len(words) != 1:
        return None
    bits = int(row[words[0]]) & 0xFFFFFFFF
    return None if bits & (bits - 1) else int(words[0]) * 32 + bits.bit_length() - 1


def _allowed(row: torch.Tensor, token: int) -> bool:
    return 0 <= token < row.numel() * 32 and bool((int(row[token // 32]) >> (token % 32)) & 1)


def allowed_tokens(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """masks [rows, words] int32 -> [rows, vocab] bool (ids past the engine's vocabulary: refused)."""
    allowed = ((masks.unsqueeze(-1) >> _SHIFTS) & 1).view(masks.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], masks [rows, words] int32 -> logits with refused tokens at -inf."""
    return logits.masked_fill(~allowed_tokens(masks, logits.shape[1]), float("-inf"))
