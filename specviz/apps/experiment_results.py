"""An experiment's results as typed data: each arm's training facts and its bench figures, per temperature.

Saved as JSON beside the shipped benches (``assets/experiments``); ``markdown`` renders the table the README
and the Benchmark tab show, and ``experiment_plot`` the figure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specviz.core.files import atomic_write

from .results import markdown_rows

SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "experiments"


@dataclass(frozen=True)
class Training:
    """What a trained arm's card says of its run."""

    val: dict[str, float]  # held-out agreement per depth (acc1, acc2, ...) after the last epoch
    parameters: int  # trained parameters
    wall_s: float
    steps: int
    machine: str
    lora_parameters: int | None = None  # joint training: the LoRA's on the target

    @classmethod
    def from_card(cls, card: dict) -> Training:
        val = card["history"][-1]["val"] if card.get("history") else {}
        return cls({k: v for k, v in val.items() if k.startswith("acc")}, card["parameters"]["trained"],
                   card["training"]["wall_s"], card["training"]["steps"], card["training"]["machine"],
                   (card.get("joint") or {}).get("lora_parameters"))

    def agreement(self, depth: int) -> float | None:
        return self.val.get(f"acc{depth}")


@dataclass(frozen=True)
class ArmResult:
    label: str
    spec: str  # as benched, with its settings; a checkpoint's folder as experiment_run.recorded names it
    temperature: float
    tau: float | None
    speedup: float
    tokens_per_s: float
    identical_to_ar: int
    prompts: int
    alpha: list[float] | None = None  # acceptance per depth, given the depth was reached
    compression: float | None = None  # merged beams' compression ratio, where beams were merged
    x: float | None = None
    train: str | None = None  # the trained method or variant
    training: Training | None = None
    draft_ms: float | None = None  # drafting time per generated token (the bench's latency split)
    target_rouge_l: float | None = None  # the arm's target's own answers against a domain's references
    lam: float | None = None  # trained jointly with a LoRA on the target at this lambda

    @classmethod
    def from_dict(cls, d: dict) -> ArmResult:
        t = d.get("training")
        return cls(**{**d, "training": None if t is None else Training(**t)})


@dataclass
class ExperimentResult:
    name: str
    paper: str
    reproduces: str
    question: str
    budget: dict
    questions: str  # the question set and how many were run
    max_new_tokens: int
    machine: str
    date: str
    arms: list[ArmResult] = field(default_factory=list)
    complete: bool = False
    axis: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExperimentResult:
        return cls(**{**d, "arms": [ArmResult.from_dict(a) for a in d.get("arms", [])]})

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ExperimentResult:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def temperatures(self) -> list[float]:
        return sorted({a.temperature for a in self.arms})

    def markdown(self) -> str:
        """One row per arm (and temperature, where several ran): agreement per depth in training, then τ,
        speedup, acceptance per depth and exactness on the bench."""
        depths = max((len(a.training.val) for a in self.arms if a.training), default=0)
        several = len(self.temperatures) > 1
        domain = any(a.target_rouge_l is not None or a.lam is not None for a in self.arms)
        merged = any((a.compression or 1.0) > 1.0 for a in self.arms)  # beams merged into a tree (ReDrafter)
        header = ["arm", *(["T"] if several else []), *(f"val acc{d}" for d in range(1, depths + 1)),
                  "τ", *(["beam tokens per tree token"] if merged else []), "speedup", "draft ms/token",
                  "α by depth", "identical to AR",
                  *(["target Rouge-L", "trained parameters (+ LoRA)"] if domain else [])]
        rows = []
        for a in self.arms:
            val = [f"{a.training.agreement(d):.3f}" if a.training and a.training.agreement(d) is not None else "–"
                   for d in range(1, depths + 1)]
            alpha = " ".join(f"{x:.2f}" for x in (a.alpha or [])[:6]) or "–"
            tau = "–" if a.tau is None else f"{a.tau:.2f}"
            exact = f"{a.identical_to_ar}/{a.prompts}" if a.temperature == 0 else "sampled"
            draft = "–" if a.draft_ms is None else f"{a.draft_ms:.1f}"
            extra = []
            if domain:
                lora = a.training.lora_parameters if a.training else None
                params = "–" if not a.training else f"{a.training.parameters:,}" + (f" (+ {lora:,})" if lora else "")
                extra = ["–" if a.target_rouge_l is None else f"{a.target_rouge_l:.3f}", params]
            compression = [f"{a.compression:.2f}" if a.compression else "–"] if merged else []
            rows.append("| " + " | ".join([a.label, *([f"{a.temperature:g}"] if several else []), *val, tau,
                                            *compression, f"{a.speedup:.2f}×", draft, alpha, exact, *extra]) + " |")
        budget = self.budget or {}
        head = (f"**{self.name}** ({self.paper}, {self.reproduces}): {self.question}  \n"
                f"Budget `{budget.get('name', 'shipped')}`"
                + (f" ({budget['samples']} prompts, {budget['epochs']} epoch{'s' * (budget['epochs'] != 1)})"
                   if budget else "")
                + f"; {self.questions}, {self.max_new_tokens} new tokens; {self.machine}, {self.date}"
                + ("" if self.complete else "; **incomplete**") + "\n\n")
        return head + markdown_rows(header, rows) + self._trained_on()

    def _trained_on(self) -> str:
        """Where each arm trained, said only where the arms' machines differ (a shipped base trained on a GPU
        beside variants trained here): agreement is comparable across machines, training time is not."""
        machines: dict[str, list[str]] = {}
        for a in self.arms:
            if a.training and a.label not in machines.get(a.training.machine, []):
                machines.setdefault(a.training.machine, []).append(a.label)
        if len(machines) < 2:
            return ""
        return "\n\nTrained on: " + "; ".join(f"{m} ({', '.join(labels)})" for m, labels in machines.items()) + "."


def shipped_experiments(folder: Path | None = None) -> dict[str, ExperimentResult]:
    """The results shipped with the project (``assets/experiments``), by file stem; unreadable files are left out."""
    found, folder = {}, folder or SHIPPED
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            found[path.stem] = ExperimentResult.load(path)
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return found
