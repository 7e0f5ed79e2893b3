"""A bench's figures written into the cards of the shipped checkpoints it ran, one entry per question set."""

from __future__ import annotations

from pathlib import Path

from drafters.checkpoint import CARD, default_path, read_card, shareable_path, update_card

from .methods import parse_method
from .results import BenchResult

CARD_FIGURES = ("tau", "alpha_conditional", "alpha_unconditional", "tokens_per_s", "speedup", "identical_to_ar",
                "prompts")


def card_key(questions: str | None) -> str:
    """'mtbench', 'humaneval' or 'bench:<file>', after the question set, so one set never overwrites another."""
    name = (questions or "mt-bench").lower()
    if name in ("mt-bench", "humaneval"):
        return name.replace("-", "")
    return "bench:" + Path(name).name


def record_benchmark(result: BenchResult, source: str) -> list[Path]:
    """Write each trained method's figures into its checkpoint's card (engine methods with a card only);
    returns the folders touched. ``source``: the results file, named as the repository would share it."""
    touched, key = [], card_key(result.questions)
    for label, m in result.methods.items():
        name, settings = parse_method(label)
        folder = Path(settings.get("checkpoint") or default_path(name))
        if m.tau is None or not (folder / CARD).exists():
            continue
        figures = m.to_dict()
        entry = {k: figures[k] for k in CARD_FIGURES if figures.get(k) is not None}
        entry.update(questions=result.questions, max_new_tokens=result.max_new_tokens, dtype=result.dtype,
                     machine=result.machine, cores_used=result.cores_used, date=result.date,
                     results_file=shareable_path(source))
        bench = read_card(folder).get(key) or {}
        bench[label] = entry
        update_card(folder, **{key: bench})
        touched.append(folder)
    return touched
