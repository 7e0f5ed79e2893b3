"""A domain slice's held-out questions with their reference answers, and Rouge-L against them: how joint
training's experiment measures the target's quality before and after its LoRA (semi-AR Fig. 5)."""

from __future__ import annotations

from drafters.training.sharegpt import first_turns, in_domain, is_validation

from .questions import Question


def domain_questions(domain: str, limit: int, val_fraction: float = 0.02,
                     max_chars: int = 1500) -> tuple[list[Question], list[str]]:
    """The first ``limit`` held-out conversations of ``domain`` (the split training never sees: the same
    stable hash as ``DataRecipe``'s) as questions, and ShareGPT's own answers to them."""
    questions, references = [], []
    for ex in first_turns(max_chars=max_chars):
        if in_domain(ex.prompt, domain) and is_validation(ex.id, val_fraction):
            questions.append(Question(ex.id, domain, ex.prompt))
            references.append(ex.answer)
            if len(questions) >= limit:
                break
    return questions, references


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (one row of the table at a time)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """Rouge-L F1 over whitespace tokens (lower-cased): 2PR / (P + R) with P, R the LCS over each length."""
    c, r = candidate.lower().split(), reference.lower().split()
    if not c or not r:
        return 0.0
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)
