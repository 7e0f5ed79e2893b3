"""``profile --train``'s results as typed data: a training step's mean time per phase for each method, what it
trained on, and a whole run's projected time; ``text`` for the terminal, ``markdown`` for docs/results.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .results import markdown_rows

PHASES = ("taps", "forward", "backward", "optimizer")


@dataclass
class StepProfile:
    """One method's timed steps: mean ms per phase, and the tokens each step trained on."""

    method: str
    ms: dict[str, float]  # per phase of ``PHASES`` and "total"
    step_ms: list[float]  # each timed step's total, in order
    answer_tokens: float  # positions the loss counted, per step
    padded_tokens: float  # the batch as padded, per step

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / (self.ms["total"] / 1000)


@dataclass
class TrainProfile:
    target: str
    device: str
    precision: str  # "bf16" autocast or "no"
    threads: int
    machine: str
    date: str
    data: str  # where the sampled sequences came from
    sequences: int  # how many were sampled
    batch_tokens: int
    warmup: int
    steps: int
    run_steps: int | None  # steps of a whole run at the budget, where its sequences are known
    rows: list[StepProfile] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainProfile":
        return cls(**{**d, "rows": [StepProfile(**r) for r in d["rows"]]})

    @staticmethod
    def is_one(d: dict) -> bool:
        """Whether a results file's object is a training profile (``report`` sorts files by their keys)."""
        return {"rows", "run_steps", "batch_tokens", "precision"} <= d.keys()

    def markdown(self) -> str:
        autocast = "bf16 autocast" if self.precision == "bf16" else "fp32"
        rows = [f"| `{r.method}` | " + " | ".join(f"{r.ms[p]:.0f}" for p in (*PHASES, "total"))
                + f" | {r.tokens_per_s:,.0f} |" + (f" {self.run_steps * r.ms['total'] / 3.6e6:.2f} h |"
                                                    if self.run_steps else "") for r in self.rows]
        header = ["method", *(f"{p} ms" for p in PHASES), "step ms", "answer tok/s"]
        header += [f"whole run ({self.run_steps:,} steps)"] if self.run_steps else []
        return (f"{self.machine}, {self.device}, {self.date}: {autocast}, {self.batch_tokens:,}-token batches, "
                f"the mean of {self.steps} steps after {self.warmup} warm-up, on {self.steps} of a whole run's "
                f"batches from {self.data}.\n\n" + markdown_rows(header, rows))

    def text(self) -> str:
        autocast = "bf16 autocast" if self.precision == "bf16" else "fp32"
        lines = [f"training step by phase, ms (mean of {self.steps} steps after {self.warmup} warm-up), {autocast}, "
                 f"{self.batch_tokens:,}-token batches, {self.device}, on {self.machine}",
                 f"  data: {self.steps} of a whole run's batches ({self.sequences} sequences), from {self.data}",
                 f"  {'method':18} " + " ".join(f"{p:>9}" for p in (*PHASES, "total")) + "   answer tok/s"
                 + (f"   whole run ({self.run_steps:,} steps)" if self.run_steps else "")]
        for row in self.rows:
            line = f"  {row.method:18} " + " ".join(f"{row.ms[p]:9.1f}" for p in (*PHASES, "total"))
            line += f"   {row.tokens_per_s:12,.0f}"
            if self.run_steps:
                line += f"   {self.run_steps * row.ms['total'] / 3.6e6:8.2f} h"
            lines.append(line)
        lines.append("  the timed batches are a whole run's own, spread from its shortest to its longest (each row's "
                     "step_ms in the results file)")
        return "\n".join(lines)
