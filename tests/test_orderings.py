"""The papers' orderings table: claims matched to bench labels however the budget was written."""

from __future__ import annotations

from specviz.apps.orderings import ordering_table
from specviz.apps.results import MethodSummary


def run(tau: float, speedup: float = 1.0, alpha: tuple = (), nodes: float | None = None) -> MethodSummary:
    return MethodSummary(prompts=1, new_tokens=8, wall_s=1.0, tokens_per_s=8.0, speedup=speedup, identical_to_ar=1,
                         tau=tau, alpha_conditional=list(alpha), mean_tree_size=nodes)


def test_a_preset_and_its_explicit_settings_name_the_same_run_and_the_bar_decides():
    results = {
        "ar": run(1.0),
        "eagle2:preset=paper": run(2.0, 0.5, (0.6, 0.5, 0.4, 0.3, 0.2)),
        "hass:depth=6:top_k=10:total_tokens=60": run(2.2, 0.6, (0.55, 0.6)),  # +10 %: clears HASS's 5 %
        "fspad:total_tokens=60:depth=6:top_k=10": run(2.04, 0.5),  # +2 %: short of FSPAD's 3 %
        "redrafter:preset=paper": run(1.5, nodes=10.5), "medusa:heads=4:top_k=4:total_tokens=16": run(1.25, nodes=16),
    }
    rows = ordering_table(results).splitlines()[2:]
    assert len(rows) == 3  # eagle3, the 16-token tree, semi-AR and lookahead were not run
    hass, fspad, redrafter = rows
    assert "`hass` over `eagle2`" in hass and "2.20 / 2.00 | 1.100 | ≥ 1.05: **holds** | 1.20 |" in hass
    assert hass.endswith("| 0.55 / 0.60 vs 0.60 / 0.50 / 0.40 / 0.30 |")  # the per-depth figures, four at most
    assert "`fspad` over `eagle2`" in fspad and "1.020 | ≥ 1.03: does not hold" in fspad
    assert "`redrafter` over `medusa`" in redrafter and "1.200 | ≥ 1.15: **holds**" in redrafter
    assert "| 4 beams × 4 vs Medusa 4/4/16 | 10.5 / 16.0 | 1.50 / 1.25 |" in redrafter  # what each verified
    assert "| – / – | 2.20 / 2.00 |" in hass  # no tree sizes recorded


def test_a_claim_without_a_bar_is_reported_and_nothing_matched_is_empty():
    rows = ordering_table({"pld": run(1.5, 1.2), "lookahead": run(1.8, 0.9)}).splitlines()
    assert len(rows) == 3 and "1.80 / 1.50 | 1.200 | – | 0.75 | – vs – |" in rows[2]


def test_redrafter_is_compared_at_each_beam_width_against_the_medusa_tree_of_about_its_merged_size():
    results = {"medusa:heads=4:top_k=8:total_tokens=60": run(1.9, nodes=60),
               "redrafter:width=28:length=4": run(2.3, nodes=57), "redrafter:width=15:length=4": run(2.0)}
    rows = ordering_table(results).splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["15 beams × 4 vs Medusa 4/8/60", "28 beams × 4 vs Medusa 4/8/60"]
    assert "| 57.0 / 60.0 | 2.30 / 1.90 | 1.211 | ≥ 1.15: **holds** |" in rows[1]
    assert ordering_table({"ar": run(1.0), "eagle2": run(1.5)}) == ""
