"""Run metrics from StepRecords, named as in DESIGN §3.

- tau: tokens per target forward over decode steps, bonus included (AR = 1.0).
- alpha_conditional[k]: accepted at depth k / steps whose draft reached depth k (Spec-Bench, EAGLE).
- alpha_unconditional[k]: accepted at depth k / all decode steps (vLLM).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .engine import StepRecord

PHASES = ("draft", "verify", "accept", "other")


@dataclass
class RunMetrics:
    new_tokens: int
    steps: int  # decode steps (target forwards after the prefill)
    wall_s: float
    tau: float
    tokens_per_s: float
    alpha_conditional: list[float] = field(default_factory=list)  # index 0 = depth 1
    alpha_unconditional: list[float] = field(default_factory=list)
    latency_ms: dict[str, float] = field(default_factory=dict)  # per generated token, by phase
    mean_tree_size: float = 0.0
    mean_compression: float | None = None  # beams x length / tree nodes, for beam drafters (ReDrafter)

    def as_dict(self) -> dict:
        return asdict(self)


def acceptance_by_depth(records: list[StepRecord]) -> tuple[list[float], list[float]]:
    decode = [r for r in records if r.step > 0]
    depth = max((r.tree.max_depth for r in decode), default=0)
    cond, uncond = [], []
    for k in range(1, depth + 1):
        reached = sum(r.tree.max_depth >= k for r in decode)
        accepted = sum(r.accepted >= k for r in decode)
        cond.append(accepted / reached if reached else 0.0)
        uncond.append(accepted / len(decode) if decode else 0.0)
    return cond, uncond


def summarize(records: list[StepRecord], wall_s: float | None = None) -> RunMetrics:
    decode = [r for r in records if r.step > 0]
    new_tokens = sum(len(r.tokens) for r in records)
    wall = wall_s if wall_s is not None else sum(r.timings.total for r in records)
    cond, uncond = acceptance_by_depth(records)
    ratios = [r.tree.info["compression"] for r in decode if "compression" in r.tree.info]
    per_phase = {p: sum(getattr(r.timings, p) for r in records) for p in PHASES}
    return RunMetrics(
        new_tokens=new_tokens,
        steps=len(decode),
        wall_s=wall,
        tau=sum(r.accepted + 1 for r in decode) / len(decode) if decode else 1.0,
        tokens_per_s=new_tokens / wall if wall > 0 else 0.0,
        alpha_conditional=cond,
        alpha_unconditional=uncond,
        latency_ms={p: 1000 * v / max(new_tokens, 1) for p, v in per_phase.items()},
        mean_tree_size=sum(len(r.tree) for r in decode) / len(decode) if decode else 0.0,
        mean_compression=sum(ratios) / len(ratios) if ratios else None,
    )


def extra_memory_pct(drafter_params: int, target_params: int) -> float:
    return 100.0 * drafter_params / target_params if target_params else 0.0
