"""Draft budgets chosen from the hardware: the verify-cost curve and the drafter's own acceptance.

A step costs draft + verify(nodes + 1) + the rest, and brings 1 + accepted tokens. A warm-up run with
the drafter's largest budget shows, at every step, the path the target accepted and the rank of every
node (the order in which the drafter's budget rule keeps nodes). A smaller budget keeps the
best-ranked nodes up to a depth, so it would have accepted the longest prefix of that path whose nodes
it keeps: exact for nested budgets (EAGLE-2's reranked tree, Medusa's static tree, a chain's length),
a lower bound otherwise (beam search). The chooser maximises expected tokens per second.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .engine import StepRecord
from .metrics import decode_steps


@dataclass(frozen=True)
class VerifyCurve:
    """ms of one target forward against the tokens it verifies, linear between measured points."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("a verify curve needs increasing token counts, one time each")

    @classmethod
    def fit(cls, tokens, ms) -> "VerifyCurve":
        """The closest non-decreasing curve to the measured one (least squares: pool adjacent violators).
        More tokens never cost less in a real run: a dip at one size (a kernel that happens to suit it,
        or noise) is not there when the context and the shapes change from step to step, so a chooser
        that trusts it picks that size and is slower than it expected."""
        blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
        for v in ms:
            blocks.append([v, 1])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        return cls(tuple(tokens), tuple(total / count for total, count in blocks for _ in range(int(count))))

    def __call__(self, n: float) -> float:
        t, ms = self.tokens, self.ms
        if len(t) == 1:
            return ms[0]
        i = min(max(bisect.bisect_left(t, n), 1), len(t) - 1)  # the segment [i-1, i]; extrapolates at the ends
        slope = (ms[i] - ms[i - 1]) / (t[i] - t[i - 1])
        return max(ms[i - 1] + slope * (n - t[i - 1]), 0.0)


def padding(tokens: Sequence[int], ms: Sequence[float], margin: float = 0.1) -> dict[int, int]:
    """Measured sizes worth verifying as a larger one: n -> the cheapest measured m > n, where m costs at
    least ``margin`` less than n (small matrix products: on some CPUs 2, 3 or 7 rows take longer than 4
    or 8). The margin keeps a noisy dip from attracting sizes it does not really help."""
    pad = {}
    for i, n in enumerate(tokens):
        j = min(range(i, len(tokens)), key=lambda k: (ms[k], k))
        if j != i and ms[j] < (1 - margin) * ms[i]:
            pad[n] = tokens[j]
    return pad


def padded_curve(tokens: Sequence[int], ms: Sequence[float], pad: dict[int, int]) -> VerifyCurve:
    """The fitted curve of what each size costs once ``pad`` applies."""
    cost = dict(zip(tokens, ms))
    return VerifyCurve.fit(tokens, [cost[pad.get(n, n)] for n in tokens])


def node_ranks(tree) -> torch.Tensor:
    """The order in which the tree's budget rule keeps each node: ``info["rank"]``, else node order."""
    return tree.info.get("rank", torch.arange(len(tree)))


def kept(tree, depth: int, size: int) -> torch.Tensor:
    """[N] bool: the nodes a budget of ``size`` nodes up to ``depth`` keeps (the best-ranked ones)."""
    ranks, shallow = node_ranks(tree), tree.depths <= depth
    order = torch.where(shallow, ranks, torch.iinfo(torch.long).max).argsort()
    keep = torch.zeros(len(tree), dtype=torch.bool)
    keep[order[: min(size, int(shallow.sum()))]] = True
    return keep


@dataclass(frozen=True)
class Estimate:
    """What a budget would have done over the warm-up steps, per step on average."""

    tokens: float  # 1 + accepted
    nodes: float  # draft nodes verified


def estimate(records: Sequence[StepRecord], depth: int, size: int) -> Estimate:
    """Replay the warm-up: the accepted prefix and tree size a budget (depth, size) would have had."""
    steps = decode_steps(records)
    if not steps:
        return Estimate(1.0, 0.0)
    tokens = nodes = 0.0
    for r in steps:
        keep = kept(r.tree, depth, size) if len(r.tree) else torch.zeros(0, dtype=torch.bool)
        accepted = 0
        for node in r.path:
            if not keep[node - 1]:
                break
            accepted += 1
        tokens += 1 + accepted
        nodes += int(keep.sum())
    return Estimate(tokens / len(steps), nodes / len(steps))


@dataclass(frozen=True)
class Option:
    """One budget to consider: its settings, its estimate and its per-step costs besides the verify."""

    settings: dict
    estimate: Estimate
    draft_ms: float
    other_ms: float = 0.0
    chain: bool = False  # verified as a chain (plain causal attention) rather than a tree (a 4D mask)


@dataclass(frozen=True)
class Budget:
    settings: dict
    tokens_per_step: float
    step_ms: float
    expected_speedup: float  # expected tokens/s over AR's (one-token verifies plus AR's own overhead)
    phase_ms: dict[str, float] | None = None  # the step's expected draft / verify / accept+other ms

    @property
    def slower_than_ar(self) -> bool:
        return self.expected_speedup < 1.0


def phase_ms(option: Option, curve: VerifyCurve, tree_curve: VerifyCurve | None = None) -> dict[str, float]:
    verify = curve if option.chain or tree_curve is None else tree_curve
    return {"draft": option.draft_ms, "verify": verify(option.estimate.nodes + 1), "accept+other": option.other_ms}


def step_ms(option: Option, curve: VerifyCurve, tree_curve: VerifyCurve | None = None) -> float:
    return sum(phase_ms(option, curve, tree_curve).values())


def choose(options: Sequence[Option], curve: VerifyCurve, ar_other_ms: float = 0.0,
           tree_curve: VerifyCurve | None = None) -> Budget:
    """The option with the most expected tokens per second, and its expected speedup over AR. ``curve``
    is the cost of verifying a chain; ``tree_curve``, where given, of a tree (its attention takes a mask)."""
    if not options:
        raise ValueError("no budget to choose from")
    best = max(options, key=lambda o: o.estimate.tokens / step_ms(o, curve, tree_curve))
    ms = step_ms(best, curve, tree_curve)
    ar_ms = curve(1) + ar_other_ms
    return Budget(best.settings, best.estimate.tokens, ms, best.estimate.tokens / ms * ar_ms,
                  phase_ms(best, curve, tree_curve))
