"""One method twice at two settings: a column's label is a method and an optional tag ("eagle2 (paper)"), and
every label races as its own lane, exact against AR, on a tiny target (the embedded tokenizer, hidden 64)."""

from __future__ import annotations

import pytest

from specviz.apps import render
from specviz.apps.methods import split_label
from specviz.apps.web.plan import column_id, plan_race
from specviz.core.errors import SettingsError


def test_a_label_is_a_method_and_an_optional_tag():
    assert split_label("eagle2") == ("eagle2", None) and split_label("semi-attn") == ("semi-attn", None)
    assert split_label("eagle2 (paper)") == ("eagle2", "paper") and split_label("pld (n=2)") == ("pld", "n=2")
    for bad in ("eagle2 (paper", "eagle2(paper)", "Eagle2", "pld ()", "pld (<b>)", "pld (" + "x" * 25 + ")", ""):
        with pytest.raises(SettingsError, match="unknown method; a label is a method's name"):
            split_label(bad)
    assert column_id("eagle2") == "col-eagle2" and column_id("eagle2 (paper)") == "col-eagle2-paper"
    assert column_id("semi-attn") == "col-semi-attn"
    same, copy = render.method_colour("lookahead"), render.method_colour("lookahead (paper)")
    assert copy != same and render.method_colour("lookahead:window=2") == same  # a copy is told apart by colour


def test_one_method_twice_at_two_settings_each_exact(app_state, app_handlers):
    labels = ["ar", "lookahead", "lookahead (paper)", "pld", "pld (one)", "lookahead (untuned)"]
    given = {"pld (one)": {"num_tokens": 1}, "lookahead": {"window": 2}}
    plan = plan_race(app_state, "Count to twenty.", labels, 24, 0.0, 1.0, given)
    assert list(plan.drafters) == labels and plan.notes == []
    drafted = {label: drafter.settings for label, drafter in plan.drafters.items() if label != "ar"}
    assert (drafted["lookahead"].window, drafted["lookahead (paper)"].window) == (2, 15)
    assert (drafted["lookahead (paper)"].ngram, drafted["lookahead (paper)"].guesses) == (5, 15)
    assert drafted["lookahead (untuned)"].window == 4  # the settings class's own value
    assert drafted["pld (one)"].num_tokens == 1 and plan.drafters["pld"] is app_state.drafters["pld"]
    out = app_handlers.compare("Count to twenty.", labels, 24, 0.0, 1.0, given)
    assert set(out["methods"]) == set(labels)
    for label, method in out["methods"].items():
        assert method["error"] is None and method["identical_to_ar"] is True, label
        assert method["metrics"]["new_tokens"] == 24, label
    assert out["methods"]["lookahead (paper)"]["budget"] == "as given"
    sizes = {label: out["methods"][label]["metrics"]["mean_tree_size"] for label in ("lookahead", "lookahead (paper)")}
    assert sizes["lookahead"] != sizes["lookahead (paper)"], sizes  # two settings really ran


def test_labels_that_cannot_run_say_why(app_state):
    labels = ["ar", "eagle2 (paper)", "nonsense (x)", "pld ((", "pld (short)"]
    given = {"pld (short)": {"num_tokens": 99, "checkpoint": "/etc"}}
    plan = plan_race(app_state, "Count.", labels, 8, 0.0, 1.0, given)
    notes = " | ".join(plan.notes)
    assert list(plan.drafters) == ["ar", "pld (short)"]
    assert "eagle2 (paper) is unavailable: " in notes and "nonsense (x): unknown method" in notes
    assert "'pld ((': unknown method; a label is" in notes
    assert "pld (short) num_tokens clamped to" in notes and "pld (short) checkpoint: not a setting" in notes


def test_the_race_tab_has_a_column_per_label_and_refuses_the_rest(app_state, app_handlers):
    assert app_handlers.columns[:len(app_state.drafters)] != [] and "lookahead (paper)" in app_handlers.columns
    assert "pld (paper)" not in app_handlers.columns  # pld has no paper setting of its own
    race = app_handlers.race(None, "Count.", ["ar", "lookahead (paper)", "pld (x)"], 8, 0.0, 1.0, False, "auto", 0,
                             None, *app_handlers.preset("fastest"))
    first = next(race)
    columns, message = first[:len(app_handlers.columns)], first[-2]
    visible = [label for label, column in zip(app_handlers.columns, columns) if column["visible"]]
    assert visible == ["ar", "lookahead (paper)"]
    assert "pld (x): the Race tab has no column for it" in message
    *_, last = race
    column = last[app_handlers.columns.index("lookahead (paper)")]
    assert "lookahead (paper)" in last[-1] and "identical to AR" in column
