"""Spec-Bench questions: one JSON object a line, `{"question_id", "category", "turns": [...]}`.

The benchmark uses the first turn of each question (the chat template is applied by the caller).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    text: str  # the first turn


def load_questions(path: str | Path, categories: list[str] | None = None,
                   limit: int | None = None) -> list[Question]:
    """Questions of `path` in file order; only `categories` when given (a name that matches no
    question is an error), at most `limit` per category when given."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be a positive integer, got {limit}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"questions file {path} does not exist")
    wanted = set(categories) if categories else None
    taken: dict[str, int] = {}
    seen_categories: set[str] = set()
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("category"), str) \
                    or not isinstance(obj.get("turns"), list) or not obj["turns"] \
                    or not isinstance(obj["turns"][0], str) or "question_id" not in obj:
                raise ValueError(f'{path}:{n}: expected {{"question_id": ..., "category": str, '
                                 f'"turns": [str, ...]}} (the Spec-Bench format)')
            cat = obj["category"]
            seen_categories.add(cat)
            if wanted is not None and cat not in wanted:
                continue
            if limit is not None and taken.get(cat, 0) >= limit:
                continue
            taken[cat] = taken.get(cat, 0) + 1
            out.append(Question(obj["question_id"], cat, obj["turns"][0]))
    if wanted is not None and wanted - seen_categories:
        raise ValueError(f"--categories: no question of category {', '.join(sorted(wanted - seen_categories))} "
                         f"in {path} (it has: {', '.join(sorted(seen_categories))})")
    if not out:
        raise ValueError(f"no questions selected from {path}")
    return out


def categories_in_order(questions: list[Question]) -> list[str]:
    """Each category once, in the order of first appearance."""
    return list(dict.fromkeys(q.category for q in questions))
