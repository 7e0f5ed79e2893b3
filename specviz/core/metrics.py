"""Run metrics and run comparisons from StepRecords: the one place for these definitions.

- tau: tokens per target forward over the decode steps, bonus included (AR = 1.0).
- alpha_conditional[k]: accepted at depth k / steps whose verification tested depth k, that is, accepted
  the k-1 drafts before it and had a draft below them (EAGLE's alpha, Spec-Bench).
- alpha_unconditional[k]: accepted at depth k / all decode steps (vLLM).
- speedup: AR's time per token over the method's (same prompts, same process).
- identical to AR: the same tokens as AR (so far, while either still runs).
- divergence: where a run first leaves AR's tokens, and whether AR's choice there was a near-tie (its
  top-2 logit gap within the precision's tolerance: "identical up to floating point") or a clear decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from .engine import StepRecord, output_ids
from .timing import PHASES


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


def decode_steps(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The steps that verified a draft: every record but the prefill's."""
    return [r for r in records if r.step > 0]


def tau(records: Sequence[StepRecord]) -> float:
    decode = decode_steps(records)
    return sum(r.accepted + 1 for r in decode) / len(decode) if decode else 1.0


def acceptance_counts(records: Sequence[StepRecord]) -> tuple[list[int], list[int], int]:
    """(accepted, tested) per depth 1..deepest draft, and the decode steps: the counts behind both α.

    Verification tests depth k when it accepted the k-1 drafts before it and the last of them (the root for
    k = 1) has a child in the draft: EAGLE's count (its ``alpha_num``)."""
    decode = decode_steps(records)
    depth = max((r.tree.max_depth for r in decode), default=0)
    tested, accepted = [0] * depth, [0] * depth
    for r in decode:
        parents = set(r.tree.parents.tolist())
        for k, node in enumerate([0, *r.path][:depth]):  # the node depth k + 1 hangs from
            tested[k] += node in parents
        for k in range(r.accepted):
            accepted[k] += 1
    return accepted, tested, len(decode)


def acceptance_by_depth(records: Sequence[StepRecord]) -> tuple[list[float], list[float]]:
    """(conditional, unconditional) α for depths 1..deepest draft; see the module docstring
    (``acceptance_counts`` gives the counts)."""
    accepted, tested, steps = acceptance_counts(records)
    cond = [a / t if t else 0.0 for a, t in zip(accepted, tested)]
    return cond, [a / steps for a in accepted]


def speedup(tokens: int, wall_s: float, ar_tokens: int, ar_wall_s: float) -> float:
    """AR's seconds per token over the method's; 0.0 when either made nothing or took no time."""
    if not (tokens and ar_tokens and wall_s > 0 and ar_wall_s > 0):
        return 0.0
    return (ar_wall_s / ar_tokens) / (wall_s / tokens)


def identical(ids: Sequence[int], ar_ids: Sequence[int], so_far: bool = False) -> bool:
    """Same tokens as AR; with ``so_far``, the same up to the shorter of the two (runs still going)."""
    if so_far:
        n = min(len(ids), len(ar_ids))
        return list(ids[:n]) == list(ar_ids[:n])
    return list(ids) == list(ar_ids)


# Logit gap below which a divergence from AR is a floating-point near-tie, by dtype: twice the largest
# difference measured between the logits of one-token decode steps and of one forward over the whole
# sequence on the embedded target (docs/methods/README.md, Exactness).
TIE_TOLERANCE = {"float32": 2e-4, "float16": 0.2, "bfloat16": 2.0}


@dataclass(frozen=True)
class Divergence:
    kind: str  # "identical" | "near-tie" (identical up to floating point) | "clear" (a real difference)
    at: int | None = None  # index of the first differing token
    gap: float | None = None  # AR's top-1 minus top-2 logit there

    def describe(self) -> str:
        if self.kind == "identical":
            return "identical to AR"
        where = f"diverged from AR at token {self.at + 1}"
        if self.gap is None:
            return f"{where} (a clear decision: AR's output ends there)"
        if self.kind == "near-tie":
            return (f"{where}, where AR's top-2 logits were {self.gap:.3g} apart: "
                    "a near-tie (identical up to floating point)")
        return f"{where}, where AR's top-2 logits were {self.gap:.3g} apart: a clear decision"


def token_margins(records: Sequence[StepRecord]) -> list[float]:
    """The target's top-1 minus top-2 logit for each emitted token, in order."""
    return [m for r in records for m in r.margins]


def first_difference(ids: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where the two differ within the shorter one's length, else None."""
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), None)


def divergence(ids: Sequence[int], ar_ids: Sequence[int], ar_margins: Sequence[float], tolerance: float) -> Divergence:
    """Classify a run against AR: identical, a near-tie divergence, or a clear one (see TIE_TOLERANCE)."""
    if list(ids) == list(ar_ids):
        return Divergence("identical")
    at = first_difference(ids, ar_ids)
    at = min(len(ids), len(ar_ids)) if at is None else at
    gap = ar_margins[at] if at < len(ar_margins) and at < len(ar_ids) else None
    return Divergence("near-tie" if gap is not None and gap <= tolerance else "clear", at, gap)


def summarize(records: Sequence[StepRecord], wall_s: float | None = None) -> RunMetrics:
    decode = decode_steps(records)
    new_tokens = len(output_ids(records))
    wall = wall_s if wall_s is not None else sum(r.timings.total for r in records)
    cond, uncond = acceptance_by_depth(records)
    ratios = [r.tree.info["compression"] for r in decode if "compression" in r.tree.info]
    per_phase = {p: sum(getattr(r.timings, p) for r in records) for p in PHASES}
    return RunMetrics(
        new_tokens=new_tokens,
        steps=len(decode),
        wall_s=wall,
        tau=tau(records),
        tokens_per_s=new_tokens / wall if wall > 0 else 0.0,
        alpha_conditional=cond,
        alpha_unconditional=uncond,
        latency_ms={p: 1000 * v / max(new_tokens, 1) for p, v in per_phase.items()},
        mean_tree_size=sum(len(r.tree) for r in decode) / len(decode) if decode else 0.0,
        mean_compression=sum(ratios) / len(ratios) if ratios else None,
    )


class TimedRun(Protocol):
    """One prompt's run as a comparison needs it: its tokens, its time and (engine runs) its records."""

    output: list[int]
    wall_s: float
    records: list[StepRecord] | None


def compare(runs: Sequence[TimedRun], ar_runs: Sequence[TimedRun], categories: Sequence[str] | None = None,
            tolerance: float | None = None) -> dict:
    """A method's runs against AR's on the same prompts: speed, speedup, identical count, τ and α (engine runs),
    τ and speedup per category when ``categories`` names each prompt's, and with ``tolerance`` (and AR's
    records) the divergences split into near-ties and clear decisions."""
    tokens, wall = sum(len(r.output) for r in runs), sum(r.wall_s for r in runs)
    ar_tokens, ar_wall = sum(len(r.output) for r in ar_runs), sum(r.wall_s for r in ar_runs)
    out = {
        "prompts": len(runs),
        "new_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "speedup": speedup(tokens, wall, ar_tokens, ar_wall),
        "identical_to_ar": sum(identical(r.output, a.output) for r, a in zip(runs, ar_runs)),
    }
    if tolerance is not None and all(a.records is not None for a in ar_runs):
        kinds = [divergence(r.output, a.output, token_margins(a.records), tolerance).kind
                 for r, a in zip(runs, ar_runs)]
        out["exactness"] = {k: kinds.count(k) for k in ("identical", "near-tie", "clear")}
    if runs and runs[0].records is not None:
        m = summarize([rec for r in runs for rec in r.records], wall)
        out.update(tau=m.tau, latency_ms=m.latency_ms, mean_tree_size=m.mean_tree_size,
                   mean_compression=m.mean_compression, alpha_conditional=m.alpha_conditional,
                   alpha_unconditional=m.alpha_unconditional)
    if categories is not None:
        groups: dict[str, list[int]] = {}
        for i, category in enumerate(categories[: len(runs)]):
            groups.setdefault(category, []).append(i)
        out["by_category"] = {category: _category(runs, ar_runs, index) for category, index in groups.items()}
    return out


def _category(runs: Sequence[TimedRun], ar_runs: Sequence[TimedRun], index: list[int]) -> dict:
    mine, ar = [runs[i] for i in index], [ar_runs[i] for i in index]
    records = [rec for r in mine for rec in (r.records or [])]
    return {
        "tau": tau(records) if mine[0].records is not None and decode_steps(records) else None,
        "speedup": speedup(sum(len(r.output) for r in mine), sum(r.wall_s for r in mine),
                           sum(len(r.output) for r in ar), sum(r.wall_s for r in ar)),
    }


def extra_memory_pct(drafter_params: int, target_params: int) -> float:
    return 100.0 * drafter_params / target_params if target_params else 0.0
