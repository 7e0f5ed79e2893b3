"""The papers' orderings checked against a bench file: each claim's two methods at one draft budget, their τ
ratio and whether it clears the bar the issue sets from the paper (τ is the tokens per target forward), beside
the draft nodes each actually verified per step."""

from __future__ import annotations

from dataclasses import dataclass

from drafters import METHODS

from .methods import parse_method
from .results import MethodSummary, markdown_rows

PAPER_TREE = METHODS["eagle2"][1].PAPER  # EAGLE-2's 6/10/60 tree, shared by every dynamic-tree method
TREE_16 = {"depth": 4, "top_k": 4, "total_tokens": 16}
MEDUSA_CHAIN_4 = {"heads": 4, "top_k": 1, "total_tokens": 4}


@dataclass(frozen=True)
class Claim:
    paper: str  # where the ordering comes from
    ours: tuple[str, dict]  # the method the paper proposes, at its settings
    baseline: tuple[str, dict]
    bar: float | None  # τ(ours) / τ(baseline) must reach this; None: reported only
    budget: str


def _claims() -> list[Claim]:
    trees = [(PAPER_TREE, "EAGLE-2's paper tree (6/10/60)"), (TREE_16, "16-token tree (4/4/16)")]
    claims = []
    for tree, budget in trees:
        claims += [Claim("HASS (2024)", ("hass", tree), ("eagle2", tree), 1.05, budget),
                   Claim("FSPAD (2024)", ("fspad", tree), ("eagle2", tree), 1.03, budget),
                   Claim("EAGLE-3 (2025)", ("eagle3", tree), ("hass", tree), 1.10, budget)]
    paper = {"preset": "paper"}
    medusa_60 = ("medusa", {"heads": 4, "top_k": 8, "total_tokens": 60})
    beams = [(4, paper, ("medusa", paper), "Medusa 4/4/16"), (7, None, ("medusa", paper), "Medusa 4/4/16"),
             (15, None, medusa_60, "Medusa 4/8/60"), (28, None, medusa_60, "Medusa 4/8/60")]
    # beams merge their shared prefixes, so width x length overstates what is verified: see the nodes column
    claims += [Claim("ReDrafter (2024)", ("redrafter", settings or {"width": width, "length": 4}), medusa, 1.15,
                     f"{width} beams × 4 vs {name}") for width, settings, medusa, name in beams]
    return claims + [
        Claim("Semi-AR", ("semi-attn", paper), ("medusa", MEDUSA_CHAIN_4), 1.0, "chains of 4"),
        Claim("Semi-AR", ("semi-lstm", paper), ("medusa", MEDUSA_CHAIN_4), 1.0, "chains of 4"),
        Claim("Lookahead (2024)", ("lookahead", {}), ("pld", {}), None, "each at its default"),
    ]


def _key(name: str, settings: dict) -> tuple:
    settings = {k: str(v) for k, v in settings.items() if k != "checkpoint"}
    if settings.pop("preset", None) == "paper" and name in METHODS:
        settings = {**{k: str(v) for k, v in METHODS[name][1].PAPER.items()}, **settings}
    return name, tuple(sorted(settings.items()))


def ordering_table(methods: dict[str, MethodSummary]) -> str:
    """A Markdown table of every claim whose two methods a bench ran (``BenchResult.methods``; '' when none)."""
    runs = {_key(*parse_method(label)): m for label, m in methods.items() if m.tau is not None}
    rows = []
    for c in _claims():
        a, b = runs.get(_key(*c.ours)), runs.get(_key(*c.baseline))
        if a is None or b is None:
            continue
        ratio = a.tau / b.tau
        same_run = a.run == b.run  # merged results: speeds compare within one run only
        speed = f"{a.speedup / b.speedup:.2f}" if same_run else "–"
        verdict = "–" if c.bar is None else f"≥ {c.bar:.2f}: " + ("**holds**" if ratio >= c.bar else "does not hold")
        alphas = " vs ".join(" / ".join(f"{x:.2f}" for x in (m.alpha_conditional or [])[:4]) or "–" for m in (a, b))
        nodes = " / ".join("–" if m.mean_tree_size is None else f"{m.mean_tree_size:.1f}" for m in (a, b))
        rows.append(f"| {c.paper}: `{c.ours[0]}` over `{c.baseline[0]}` | {c.budget} | {nodes} | {a.tau:.2f} / "
                    f"{b.tau:.2f} | {ratio:.3f} | {verdict} | {speed} | {alphas} |")
    return markdown_rows(["claim", "budget", "nodes verified per step, ours / baseline", "τ ours / baseline",
                          "τ ratio", "bar", "speed ratio", "α_1..4 conditional, ours vs baseline"], rows)
