"""A finished race as a JSON file a teacher can download: every method's every step, with the numbers the page
showed (the draft tree with its token texts, the accepted path, the target's probability of each node, the accept
rule's decisions, the step's time split), so a class can redo any step away from the app.

The layout (``FORMAT``): ``{"format", "prompt", "sampling", "methods": {label: {"output", "text", "error",
"seconds", "steps": [...]}}}``; a method's ``output`` is its steps' ``tokens`` joined, which the tests check.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, fields
from functools import cache
from pathlib import Path

import torch

from specviz.core.engine import StepRecord
from specviz.core.timing import Timings
from specviz.core.tree import DraftTree

FORMAT = "specviz-race/1"


def _rounded(values: list[float]) -> list[float]:
    return [round(float(v), 6) for v in values]


def step_dict(record: StepRecord, text) -> dict:
    """One step as plain data: tensors as lists, the tree's tokens with their ``text(token)``."""
    step = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if isinstance(value, DraftTree):
            tokens = value.tokens.tolist()
            step[f.name] = {"tokens": tokens, "texts": [text(t) for t in tokens], "parents": value.parents.tolist()}
        elif isinstance(value, Timings):
            step[f.name] = asdict(value)
        elif isinstance(value, torch.Tensor):
            step[f.name] = _rounded(value.flatten().tolist())
        elif f.name == "decisions":
            step[f.name] = [asdict(d) for d in value]
        elif f.name == "margins":
            step[f.name] = _rounded(value)
        else:
            step[f.name] = value
    step["accepted"], step["corrected"] = record.accepted, record.corrected
    step["texts"] = [text(t) for t in record.tokens]
    return step


def race_dict(runs: dict, prompt: str, sampling: dict, decode) -> dict:
    """``runs``: the Race tab's state (label -> records, clock, error)."""
    text = cache(lambda token: decode([token]))  # a race's trees repeat their tokens many times over
    methods = {}
    for label, run in runs.items():
        output = [t for r in run["records"] for t in r.tokens]
        methods[label] = {"output": output, "text": decode(output), "error": run.get("error"),
                          "seconds": run.get("clock"), "steps": [step_dict(r, text) for r in run["records"]]}
    return {"format": FORMAT, "prompt": prompt, "sampling": sampling, "methods": methods}


def race_file(race: dict) -> Path:
    """Write ``race`` (``race_dict``) to a fresh temporary file (Gradio serves it for download); its path."""
    path = Path(tempfile.mkdtemp(prefix="specviz-race-")) / "race.json"
    path.write_text(json.dumps(race, ensure_ascii=False))
    return path
