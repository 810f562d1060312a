"""Draft and target must share a vocabulary: the verifier compares token ids, not strings."""

from __future__ import annotations

import hashlib


class VocabularyMismatch(ValueError):
    pass


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str = "target",
                          draft_name: str = "draft") -> None:
    """Raise VocabularyMismatch naming the first token id whose token differs."""
    t = {i: s for s, i in target_tokenizer.get_vocab().items()}
    d = {i: s for s, i in draft_tokenizer.get_vocab().items()}
    for i in range(max(len(t), len(d), max(t, default=-1) + 1, max(d, default=-1) + 1)):
        if t.get(i) != d.get(i):
            raise VocabularyMismatch(
                f"draft {draft_name!r} and target {target_name!r} do not share a vocabulary: "
                f"token id {i} is {t.get(i)!r} in the target and {d.get(i)!r} in the draft")


def vocabulary_digest(tokenizer) -> str:
    """sha256 of the (id, token) pairs in id order: what a draft that keeps no tokenizer of its
    own (a feature head) records of its target's."""
    h = hashlib.sha256()
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{token}\n".encode())
    return h.hexdigest()


def check_vocabulary_digest(target_tokenizer, digest: str, target_name: str, draft_name: str) -> None:
    if vocabulary_digest(target_tokenizer) != digest:
        raise VocabularyMismatch(f"draft {draft_name!r} was trained for another vocabulary than target "
                                 f"{target_name!r}'s (tokenizer digests differ)")
