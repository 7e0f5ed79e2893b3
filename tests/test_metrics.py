"""metrics: τ, both α definitions, speedup, identical-to-AR and per-category comparisons on hand-built
step records; the phase timer on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import specviz.core.timing as timing
from specviz.core.engine import StepRecord
from specviz.core.metrics import (
    acceptance_by_depth,
    compare,
    decode_steps,
    divergence,
    extra_memory_pct,
    identical,
    speedup,
    summarize,
    tau,
)
from specviz.core.timing import PhaseTimer, Timings
from specviz.core.tree import DraftTree


def step(n: int, depth: int, accepted: int, tokens: int | None = None, ms: float = 10.0) -> StepRecord:
    """Decode step ``n`` whose draft is a chain ``depth`` deep with ``accepted`` of it kept."""
    tree = DraftTree.chain(list(range(depth)))
    emitted = list(range(accepted + 1 if tokens is None else tokens))
    return StepRecord(step=n, tree=tree, path=list(range(1, accepted + 1)), tokens=emitted, bonus=0,
                      timings=Timings(draft=ms / 4000, verify=ms / 2000, accept=ms / 8000, other=ms / 8000))


PREFILL = StepRecord(step=0, tree=DraftTree.empty(), path=[], tokens=[7], bonus=7, timings=Timings(verify=0.05))
# four decode steps: drafts 3, 3, 1 and 2 deep; accepted 2, 0, 1 and 2
RECORDS = [PREFILL, step(1, 3, 2), step(2, 3, 0), step(3, 1, 1), step(4, 2, 2)]


def test_decode_steps_leave_out_the_prefill():
    assert [r.step for r in decode_steps(RECORDS)] == [1, 2, 3, 4]


def test_tau_counts_the_bonus_token():
    assert tau(RECORDS) == pytest.approx((3 + 1 + 2 + 3) / 4)
    assert tau([PREFILL]) == 1.0  # no decode step: AR's value


def test_alpha_conditional_and_unconditional_by_hand():
    cond, uncond = acceptance_by_depth(RECORDS)
    # depth 1: tested by all 4 steps, accepted by 3 (steps 1, 3, 4)
    # depth 2: tested by steps 1 and 4 (step 2 stopped at depth 1, step 3's chain ends there), accepted by both
    # depth 3: tested by step 1 only, accepted by none
    assert cond == pytest.approx([3 / 4, 2 / 2, 0 / 1])
    assert uncond == pytest.approx([3 / 4, 2 / 4, 0 / 4])


def test_alpha_conditional_counts_a_depth_only_below_the_accepted_node():
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]))  # nodes 1, 2 at depth 1; node 3 under 1
    below_a_leaf = StepRecord(step=1, tree=tree, path=[2], tokens=[6, 9], bonus=9)  # kept node 2: no child
    below_a_parent = StepRecord(step=2, tree=tree, path=[1], tokens=[5, 9], bonus=9)  # kept node 1, rejected 3
    assert acceptance_by_depth([PREFILL, below_a_leaf]) == ([1.0, 0.0], [1.0, 0.0])
    assert acceptance_by_depth([PREFILL, below_a_leaf, below_a_parent]) == ([1.0, 0 / 1], [1.0, 0.0])


def test_alpha_of_a_run_without_drafts_is_empty():
    assert acceptance_by_depth([PREFILL, step(1, 0, 0)]) == ([], [])


def test_speedup_is_ars_time_per_token_over_the_methods():
    assert speedup(tokens=30, wall_s=1.0, ar_tokens=20, ar_wall_s=1.0) == pytest.approx(1.5)
    assert speedup(10, 2.0, 10, 1.0) == pytest.approx(0.5)
    assert speedup(0, 1.0, 10, 1.0) == 0.0 and speedup(10, 0.0, 10, 1.0) == 0.0


def test_identical_whole_and_so_far():
    assert identical([1, 2, 3], [1, 2, 3]) and not identical([1, 2], [1, 2, 3])
    assert identical([1, 2], [1, 2, 3], so_far=True) and not identical([1, 4], [1, 2, 3], so_far=True)


def test_summarize_latency_is_per_generated_token():
    m = summarize(RECORDS)
    assert m.new_tokens == 1 + 3 + 1 + 2 + 3 and m.steps == 4
    total_verify = 0.05 + 4 * 10 / 2000
    assert m.latency_ms["verify"] == pytest.approx(1000 * total_verify / m.new_tokens)
    assert m.wall_s == pytest.approx(sum(r.timings.total for r in RECORDS))
    assert m.mean_tree_size == pytest.approx((3 + 3 + 1 + 2) / 4)


@dataclass
class Run:
    output: list[int]
    wall_s: float
    records: list[StepRecord] | None = None


def test_compare_against_ar_overall_and_per_category():
    ar = [Run([1, 2, 3, 4], 4.0), Run([5, 6], 2.0), Run([7, 8], 2.0)]
    fast = [Run([1, 2, 3, 4], 1.0, RECORDS), Run([5, 6], 1.0, RECORDS[:2]), Run([7, 9], 2.0, RECORDS[:3])]
    out = compare(fast, ar, ["code", "math", "code"])
    assert out["prompts"] == 3 and out["new_tokens"] == 8 and out["identical_to_ar"] == 2
    assert out["speedup"] == pytest.approx((8.0 / 8) / (4.0 / 8))
    assert out["tau"] == pytest.approx(tau(RECORDS + RECORDS[:2] + RECORDS[:3]))
    code, math_ = out["by_category"]["code"], out["by_category"]["math"]
    assert code["speedup"] == pytest.approx((6.0 / 6) / (3.0 / 6)) and math_["speedup"] == pytest.approx(2.0)
    assert code["tau"] == pytest.approx(tau(RECORDS + RECORDS[:3])) and math_["tau"] == pytest.approx(3.0)
    hf = compare([Run([1, 2, 3, 4], 2.0)], ar[:1], ["code"])  # an outside baseline: no records, no τ
    assert "tau" not in hf and hf["by_category"]["code"]["tau"] is None


def test_extra_memory_pct():
    assert extra_memory_pct(5, 200) == pytest.approx(2.5) and extra_memory_pct(5, 0) == 0.0


def test_phase_timer_charges_each_block_to_its_phase(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 3.5, 10.0, 10.25])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timer = PhaseTimer("cpu")
    with timer("draft"):
        pass
    with timer("verify"):
        pass
    with timer("draft"):
        pass
    assert timer.timings == Timings(draft=1.25, verify=2.5)
    assert timer.timings.total == pytest.approx(3.75)


def test_divergence_labels_a_near_tie_and_a_clear_decision():
    ar, margins = [5, 6, 7, 8], [3.0, 0.05, 2.5, 4.0]
    assert divergence([5, 6, 7, 8], ar, margins, 0.1).kind == "identical"
    tie = divergence([5, 9, 7, 8], ar, margins, tolerance=0.1)  # AR's choice at token 2 was a near-tie
    assert (tie.kind, tie.at, tie.gap) == ("near-tie", 1, 0.05) and "identical up to floating point" in tie.describe()
    clear = divergence([5, 6, 1, 8], ar, margins, tolerance=0.1)  # AR's choice at token 3 was clear
    assert (clear.kind, clear.at, clear.gap) == ("clear", 2, 2.5) and "clear decision" in clear.describe()
    assert divergence([5, 9], ar, margins, tolerance=0.01).kind == "clear"  # the same gap, a tighter precision
    assert divergence([5, 6, 7], ar, margins, 0.1) == divergence([5, 6, 7], ar, margins, 0.1)
    assert divergence([5, 6, 7], ar, margins, 10.0).kind == "near-tie"  # stopped early where AR's gap was 4.0
    assert divergence([5, 6, 7, 8, 2], ar, margins, 10.0).gap is None  # went on after AR's end: clear
