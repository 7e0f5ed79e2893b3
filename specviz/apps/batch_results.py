"""A batch-size sweep's results as typed data (``apps.batching`` measures them): one point per method and batch
size, read and written as JSON, rendered as one Markdown table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specviz.core import files
from specviz.core.errors import SettingsError


@dataclass(frozen=True)
class BatchPoint:
    """One method at one batch size."""

    method: str  # its label: the spec as given ("redrafter:tree_attention=0")
    batch_size: int
    sequences: int
    new_tokens: int
    wall_s: float
    tau: float  # tokens per target forward, over every sequence's steps
    throughput: float  # all sequences' new tokens per second
    sequence_tok_s: float  # each sequence's tokens over its own time in the batch, averaged
    identical: int | None = None  # sequences equal to AR's at this batch size (greedy runs only)
    settings: dict = field(default_factory=dict)  # what the method ran at
    runs: list[float] = field(default_factory=list)  # each run's throughput (AR's point pools several)
    baseline: float | None = None  # AR's throughput around this run (the two AR runs beside it), where measured


@dataclass
class BatchSweep:
    target: str
    device: str
    dtype: str
    machine: str
    date: str
    questions: str
    max_new_tokens: int
    sampling: dict
    points: list[BatchPoint] = field(default_factory=list)
    engine: str = ""  # the path the target's forwards took ("eager", "compiled"; "": a sweep from before it was kept)

    def point(self, method: str, batch_size: int) -> BatchPoint | None:
        return next((p for p in self.points if p.method == method and p.batch_size == batch_size), None)

    def speedup(self, point: BatchPoint) -> float | None:
        """``point``'s throughput over AR's around it (its ``baseline``), else over AR's point at its batch size."""
        if point.method == "ar":
            return 1.0
        if point.baseline:
            return point.throughput / point.baseline
        ar = self.point("ar", point.batch_size)
        return point.throughput / ar.throughput if ar and ar.throughput else None

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "points"},
                "points": [asdict(p) for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict) -> BatchSweep:
        return cls(**{k: v for k, v in d.items() if k != "points"}, points=[BatchPoint(**p) for p in d["points"]])

    def save(self, path: Path) -> None:
        files.atomic_write(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> BatchSweep:
        try:
            return cls.from_dict(json.loads(files.read_bytes(Path(path))))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SettingsError(f"{path} is not a batch sweep results file ({e})") from None

    def markdown(self) -> str:
        """Per method and batch size: throughput, its speedup over AR there, each sequence's speed and τ."""
        sizes = sorted({p.batch_size for p in self.points})
        methods = list(dict.fromkeys(p.method for p in self.points))
        engine = f", {self.engine} forwards" if self.engine else ""
        head = (f"{self.questions}, {self.max_new_tokens} new tokens, {self.dtype}{engine} on {self.machine}, "
                f"{self.date}. "
                "Each cell: throughput in tok/s (× AR at the same batch size, the AR runs just before and after it "
                "where measured) · one sequence's tok/s · τ.")
        rows = ["| method | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for m in methods:
            rows.append(f"| {m} | " + " | ".join(self._cell(self.point(m, b)) for b in sizes) + " |")
        return head + "\n\n" + "\n".join(rows)


    def _cell(self, p: BatchPoint | None) -> str:
        if p is None:
            return "–"
        speedup = self.speedup(p)
        times = "" if speedup is None else f" ({speedup:.2f}×)"
        return f"{p.throughput:.1f}{times} · {p.sequence_tok_s:.1f} · τ {p.tau:.2f}"
