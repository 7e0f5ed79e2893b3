"""The web app in-process: state, planning and clamping, views, handlers and layout on a tiny target
(the embedded tokenizer, hidden 64), without a server. test_app.py covers the same through gradio_client."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from drafters import METHODS
from specviz.apps import teaching
from specviz.apps.web import space
from specviz.apps.web.handlers import Handlers
from specviz.apps.web.layout import build_demo
from specviz.apps.web.plan import SettingSpec, column_labels, plan_race, setting_specs, slider_settings
from specviz.apps.web.state import AppState, load_state
from specviz.apps.web.views import RaceView, learn_text, next_step, tree_choices, warm_up
from specviz.core.errors import SettingsError, SpecvizError


@pytest.fixture(scope="module")
def state(tiny_target_dir) -> AppState:
    return load_state(str(tiny_target_dir), warm_up=warm_up, tune="now")  # the tuned budgets are asserted


@pytest.fixture(scope="module")
def handlers(state) -> Handlers:
    return Handlers(state, setting_specs(state))


def test_state_lists_what_cannot_run_with_the_reason(state):
    assert {"ar", "pld", "skip"} <= set(state.drafters)
    assert "hidden_size=576" in state.unavailable["eagle2"]  # the shipped checkpoint is for the embedded target
    assert "or give sps any assistant LM" in state.unavailable["sps"]  # its shipped assistant is the embedded's
    assert set(state.drafters) | set(state.unavailable) == set(METHODS) and state.cold_start_s > 0


def test_defaults_and_limits_come_from_the_settings_classes(state):
    assert state.limits("skip")["layers"] == (1, 1)  # a 2-layer target: at most one layer as the draft
    assert state.defaults("skip")["layers"] == 1 and state.drafters["skip"].settings.layers == 1
    sliders = {(s.method, s.name) for s in setting_specs(state)}
    assert ("skip", "num_tokens") in sliders and ("skip", "layers") not in sliders  # one possible value: no slider
    assert state.drafter("pld", {}) is state.drafters["pld"]
    tuned = state.tuned["pld"].settings  # the budget chosen for this machine is where every method starts
    assert tuned and state.drafters["pld"].settings.num_tokens == tuned["num_tokens"]
    assert state.defaults("pld")["num_tokens"] == tuned["num_tokens"]
    assert plan_race(state, "Count.", ["ar", "pld"], 8, 0.0, 1.0, None).expected["pld"] == pytest.approx(
        state.tuned["pld"].expected_speedup)
    n = 2 if tuned["num_tokens"] != 2 else 3
    other = state.drafter("pld", {"num_tokens": n})
    assert other is not state.drafters["pld"] and state.drafter("pld", {"num_tokens": n}) is other


@pytest.mark.parametrize("field", ["max_new_tokens", "temperature", "setting"])
def test_an_integer_too_large_for_a_float_is_clamped_to_its_bound(state, field):
    huge = 10 ** 400
    args = dict(max_new_tokens=8, temperature=0.0, settings=None)
    if field == "setting":
        args["settings"] = {"pld": {"num_tokens": huge}}
    else:
        args[field] = huge
    plan = plan_race(state, "Count.", ["ar", "pld"], args["max_new_tokens"], args["temperature"], 1.0,
                     args["settings"])
    assert any("clamped to" in n for n in plan.notes), plan.notes
    bound = {"max_new_tokens": plan.max_new_tokens == 512, "temperature": plan.sampling.temperature == 2.0,
             "setting": plan.drafters["pld"].settings.num_tokens == 64}
    assert bound[field]


@pytest.mark.parametrize("settings", [[1, 2], "fast", 7])
def test_settings_that_are_not_a_mapping_are_ignored_with_a_note(state, settings):
    plan = plan_race(state, "Count.", ["ar", "pld"], 8, 0.0, 1.0, settings)
    assert any(n.startswith("settings must be a mapping") for n in plan.notes), plan.notes
    assert plan.drafters["pld"] is state.drafters["pld"]


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(state, monkeypatch):
    calls = []
    monkeypatch.setattr(state.target.text, "encode_chat", lambda *a, **k: calls.append(1) or [1])
    with pytest.raises(SettingsError, match="characters; this target's context"):
        plan_race(state, "x" * (8 * state.target.max_length + 1), ["ar"], 8, 0.0, 1.0, None)
    assert calls == []


def test_plan_clamps_and_notes(state):
    plan = plan_race(state, "Count.", ["ar", "pld", "eagle2", "nope"], 10**6, 9.0, -3.0,
                     {"pld": {"num_tokens": 10**6}})
    notes = " | ".join(plan.notes)
    assert "max new tokens clamped to 512" in notes and "temperature clamped to 2.0" in notes
    assert "top-p clamped to 0.05" in notes and "pld num_tokens clamped to 64" in notes
    assert "eagle2 is unavailable" in notes and "nope: unknown method" in notes
    assert set(plan.drafters) == {"ar", "pld"} and plan.drafters["pld"].settings.num_tokens == 64
    for prompt, methods, match in [(" ", ["ar"], "prompt is empty"), ("hi", ["eagle2"], "at least one available")]:
        with pytest.raises(SettingsError, match=match):
            plan_race(state, prompt, methods, 8, 0, 1, None)


def test_slider_values_map_back_to_settings(state):
    specs = setting_specs(state)
    settings = slider_settings(specs, [s.default for s in specs])
    assert settings["pld"] == {k: v for k, v in state.defaults("pld").items() if k in settings["pld"]}


def test_compare_is_lossless_and_serialisable(handlers):
    out = handlers.compare("Say hello.", ["ar", "pld", "skip"], 12)
    assert out["notes"] == [] and set(out["methods"]) == {"ar", "pld", "skip"}
    for res in out["methods"].values():
        assert res["identical_to_ar"] and res["text"] == out["methods"]["ar"]["text"]
        assert len(res["tokens"]) == res["metrics"]["new_tokens"] == 12
    with pytest.raises(gr.Error, match="prompt is empty"):
        handlers.compare("", ["ar"], 8)


def test_race_streams_columns_then_plots_and_runs(handlers, state):
    specs = handlers.specs
    updates = list(handlers.race(SimpleNamespace(session_hash="s1"), "Hi there", ["ar", "pld"], 10, 0, 1, True, "auto",
                                 0, None, *[s.default for s in specs]))
    columns, runs = updates[-1][: len(METHODS)], updates[-1][-1]
    ar, pld = columns[list(METHODS).index("ar")], columns[list(METHODS).index("pld")]
    assert "10 tokens" in ar and 'data-done="1"' in pld and "✅ identical to AR" in pld
    assert set(runs) == {"ar", "pld"} and "s1" not in state.stops  # the session's stop flag is gone
    methods, _ = tree_choices(runs)
    assert set(methods["choices"]) <= {"pld"}
    figure, detail = handlers.step_view(runs, "ar", 1)  # the step-through view
    assert "ar · step 1" in detail and "No draft this step" in detail and "verify" in detail
    last = len(runs["ar"]["records"]) - 1
    assert next_step(runs, "ar", 1, -1) == 1 and next_step(runs, "ar", 1, 1) == 2
    assert next_step(runs, "ar", last, 1) == last and next_step({}, None, 3, 1) == 0
    assert "Run a race" in handlers.step_view({}, None, 1)[1]


def test_race_view_notes_methods_that_did_not_finish(state):
    plan = plan_race(state, "Hi", ["ar", "pld"], 8, 0, 1, None)
    view = RaceView(plan, state.target.text.decode, show_rejected=False)
    view.lanes = {"ar": SimpleNamespace(finished=False)}
    assert re.search(r"Stopped: ar did not finish", view.message())


def test_a_busy_machine_is_said_when_ar_runs_far_below_its_idle_speed(state):
    from specviz.apps.race import race

    plan = plan_race(state, "Count to twenty.", ["ar"], 24, 0, 1, None)
    view = RaceView(plan, state.target.text.decode, show_rejected=False)
    for lane in race(state.target, plan.drafters, plan.ids, 24):
        view.lanes[lane.label] = lane
    from specviz.core.metrics import summarize

    measured = summarize(view.lanes["ar"].records, view.lanes["ar"].clock).tokens_per_s
    plan.ar_tok_s = measured * 1.2  # as fast as idle, within noise: no note
    assert "busy" not in view.message()
    plan.ar_tok_s = measured * 3  # a third of its idle speed
    assert "This machine is busy: AR ran at" in view.message() and "τ (tokens per target pass) is not" in view.message()
    head = view.column("ar")
    assert head.index("τ 1.00") < head.index("24 / 24 tokens") < head.index("tok/s")  # τ leads


def test_the_badge_tells_identical_near_tie_and_clear_apart(state):
    from specviz.core.engine import StepRecord
    from specviz.core.tree import DraftTree

    plan = plan_race(state, "Count.", ["ar", "pld"], 8, 0.0, 1.0, None)
    view = RaceView(plan, state.target.text.decode, show_rejected=False, dtype="bfloat16")  # tolerance 2.0
    prefill = StepRecord(step=0, tree=DraftTree.empty(), path=[], tokens=[5], bonus=5, margins=[4.0])
    step = StepRecord(step=1, tree=DraftTree.empty(), path=[], tokens=[6, 7], bonus=7, margins=[0.5, 6.0])
    ar = SimpleNamespace(output_ids=[5, 6, 7], records=[prefill, step], finished=True)
    lane = lambda ids: SimpleNamespace(output_ids=ids, finished=True)  # noqa: E731
    assert "identical to AR" in view.badge(lane([5, 6, 7]), ar)
    assert "identical up to floating point" in view.badge(lane([5, 9, 7]), ar)  # AR's gap there: 0.5
    assert "differs from AR at token 3" in view.badge(lane([5, 6, 9]), ar)  # AR's gap there: 6.0
    assert "≈" not in RaceView(plan, state.target.text.decode, False).badge(lane([5, 9, 7]), ar)  # fp32: clear


@pytest.mark.parametrize("settings, note, num_tokens", [
    ({"pld": {"checkpoint": "/etc/passwd"}}, "pld checkpoint: not a setting this page takes", "default"),
    ({"pld": {"assistant": "some/hub-model"}}, "pld assistant: not a setting this page takes", "default"),
    ({"pld": {"num_tokens": "5"}}, "pld num_tokens: '5' is not a number", "default"),
    ({"pld": {"num_tokens": [1, 2]}}, "pld num_tokens: '[1, 2]' is not a number", "default"),
    ({"pld": {"num_tokens": float("inf")}}, "pld num_tokens clamped to 64", 64),  # +inf: the upper bound
    ({"pld": "fast"}, "pld settings must be a mapping", "default"),
])
def test_the_api_takes_numbers_only_in_settings(state, settings, note, num_tokens):
    """What is ignored or unreadable runs at the tuned default; only a number (here +inf) is clamped."""
    default = state.defaults("pld")["num_tokens"]
    assert default != 64  # the tuned budget is at most 16: the two outcomes differ
    plan = plan_race(state, "Count.", ["ar", "pld"], 8, 0.0, 1.0, settings)
    assert any(n.startswith(note) for n in plan.notes), plan.notes
    assert plan.drafters["pld"].settings.num_tokens == (default if num_tokens == "default" else num_tokens)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.7, rule="greedy"), "would ignore temperature"),
    (dict(rule="fastest"), "unknown acceptance rule"),
    (dict(prompt="caf\udce9"), "not valid UTF-8"),
    (dict(methods=["ar"] * 41), "at most 40 methods"),
    (dict(methods="ar; rm -rf /"), "unknown method"),
])
def test_requests_that_cannot_run_are_clear_errors(state, kwargs, match):
    request = dict(prompt="Count.", methods=["ar"], max_new_tokens=8, temperature=0.0, top_p=1.0, settings=None)
    with pytest.raises(SpecvizError, match=match):
        plan_race(state, **{**request, **kwargs})


def test_tiny_temperatures_and_lossy_rules_are_noted(state):
    plan = plan_race(state, "Count.", ["ar"], 8, 1e-42, 1.0, None)
    assert plan.sampling.greedy and any("below 0.001: used 0" in n for n in plan.notes)
    lossy = plan_race(state, "Count.", ["ar", "pld"], 8, 0.7, 1.0, None, rule="typical")
    assert any("lossy" in n for n in lossy.notes)
    view = RaceView(lossy, state.target.text.decode, False)
    assert "lossy (typical acceptance)" in view.badge(SimpleNamespace(output_ids=[1]), SimpleNamespace())


def test_a_malformed_card_makes_its_method_unavailable_not_the_app(state, tiny_checkpoint, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(tiny_checkpoint(state.target, "medusa", epochs=1, prompts=8), tmp_path / "medusa")
    card = json.loads((folder / "card.json").read_text())
    card["history"] = "not a list"  # a hand-edited card: medusa reads its rank accuracies from here
    (folder / "card.json").write_text(json.dumps(card))
    broken = AppState(state.target, configured={"medusa": {"checkpoint": str(folder)}}, engine=state.engine)
    broken.load_drafters()
    assert "medusa" not in broken.drafters and "could not be built" in broken.unavailable["medusa"]
    assert "ar" in broken.drafters


def test_the_benchmark_tab_shows_real_headers_and_runs_a_temperature_sweep(handlers):
    from specviz.apps.web.views import benchmark_table

    assert list(benchmark_table(None).columns) == ["method", "τ", "speedup", "tok/s", "identical to AR"]
    figure, table, status = list(handlers.sweep("mt-bench", "first N", 1, ["pld"], 4))[-1]
    assert len(table) == 12 and set(table["method"]) == {"ar", "pld"}  # 3 temperatures x 2 rules x 2 methods
    assert {t.name for t in figure.data} >= {"pld · lossless", "pld · lossy (typical)"}


def test_compare_stops_at_its_budget_with_a_note(handlers, monkeypatch):
    import specviz.apps.web.handlers as module

    monkeypatch.setattr(module, "COMPARE_BUDGET_S", 0.0)
    out = handlers.compare("Write a long story.", ["ar", "pld"], 200)
    assert any("stopped at this API's budget" in n for n in out["notes"])
    assert all(m["metrics"]["new_tokens"] < 200 for m in out["methods"].values())


def test_presets_set_the_sliders(handlers, state):
    specs = handlers.specs
    fastest, paper = handlers.preset("fastest"), handlers.preset("paper")
    at = {(s.method, s.name): i for i, s in enumerate(specs)}
    pld = at[("pld", "num_tokens")]
    assert fastest[pld] == state.defaults("pld")["num_tokens"]  # the tuned budget
    assert len(fastest) == len(paper) == len(specs)
    tree = [SettingSpec("eagle2", "depth", 1, 16, 2), SettingSpec("eagle2", "total_tokens", 1, 32, 8)]
    assert Handlers(state, tree).preset("paper") == [6, 32]  # EAGLE-2's 6-deep, 60-token tree, within the slider
    eagle2 = state.defaults("eagle2")  # "fastest" is the budget as tuned so far, within the slider
    assert Handlers(state, tree).preset("fastest") == [min(eagle2["depth"], 16), min(eagle2["total_tokens"], 32)]


def test_learn_tab_names_papers_not_internal_labels(state):
    text = learn_text(state)
    assert "seed" not in text.lower() and "HASS" in text and "Unavailable here" in text
    assert "near-tie" in text and "Budgets" in text
    assert text.index("What speculative decoding is") < text.index("Leviathan et al., 2023")  # it opens with them
    assert "arxiv.org/abs/2211.17192" in text and "arxiv.org/abs/2302.01318" in text
    assert set(METHODS) <= set(teaching.NOTES) and set(METHODS) <= set(teaching.DIAGRAMS)
    from specviz.apps.web.views import method_figure

    figure = method_figure("redrafter")  # inputs, drafter, proposal, target: four boxes and three arrows
    boxes = [a.text for a in figure.layout.annotations if a.text]
    assert len(figure.layout.shapes) == 5 and any("RNN" in b for b in boxes) and any("beams" in b for b in boxes)


def test_a_trained_method_note_says_what_its_checkpoint_saw():
    card = {"data": {"train_samples": 13655, "self_distilled": True},
            "training": {"answer_tokens_seen": 2774483, "epochs": 1, "steps": 1013, "wall_s": 4075.5,
                         "machine": "x86_64 2 threads"},
            "history": [{"epoch": 1, "val": {"acc1": 0.4663, "acc2": 0.4094, "acc3": 0.3956, "acc4": 0.3826}}]}
    text = teaching.note("hass", "HASS", 4_000_000, 3.0, card)
    assert ("**This checkpoint (its card):** 13,655 self-distilled ShareGPT prompts; 2.77M answer tokens seen in "
            "1 epoch, 1,013 steps; 68 min on x86_64 2 threads; held-out agreement with the target at depths 1–4: "
            "0.47 / 0.41 / 0.40 / 0.38") in text
    assert "This checkpoint" not in teaching.note("pld", "PLD", 0, 0.0)
    assert teaching.checkpoint_facts({"method": "x"}) == "no training facts on its card"


def test_the_page_builds_without_a_server(state, monkeypatch):
    demo = build_demo(state)
    ids = {c.get("props", {}).get("elem_id") for c in demo.config["components"]}
    assert {"run", "stop", "methods", "plot-alpha", "plot-tree", "col-ar"} <= ids
    sliders = [f for f in demo.fns.values() if any(event == "load" for _, event in f.targets)
               and all(getattr(o, "elem_id", "").startswith("set-") for o in f.outputs)]
    assert len(sliders) == 1  # a page opened after tuning starts at the budgets, not the layout's baked defaults
    at = [o.elem_id for o in sliders[0].outputs].index("set-pld-num_tokens")
    monkeypatch.setitem(state.configured, "pld", {"num_tokens": 7})
    assert sliders[0].fn()[at] == 7


def test_spaces_helpers_off_a_space():
    assert space.installed("torch") and not space.installed("no-such-package-here")
    assert space.GPU(len) is len or space.GPU(len)([1]) == 1


def test_background_tuning_runs_one_job_at_a_time_between_requests(state, monkeypatch):
    """``tuner.start`` chains its jobs on the engine thread: a request that arrives while one runs goes next,
    not after the whole tuning; the status line counts the jobs and ends saying the budgets are tuned."""
    import threading
    import time

    from specviz.apps.web import tuner

    order, first_started = [], threading.Event()

    def job(state_, name):
        order.append(name)
        first_started.set()
        time.sleep(0.05)

    monkeypatch.setattr(tuner, "_tune_one", job)
    tuner.start(state)
    first_started.wait(10)
    state.on_engine(lambda: order.append("request"))
    deadline = time.time() + 60
    while not state.tuning.finished and time.time() < deadline:
        time.sleep(0.01)
    assert state.tuning.finished and state.tuning.done == state.tuning.total == len(order) - 1
    assert order.index("request") <= 1, order  # after at most the job that was running
    assert order[0] == "verify cost" and set(order) - {"request", "verify cost"} == set(state.drafters)
    assert "tuned for this machine" in state.tuning.line()
    assert "untuned" in tuner.TuneProgress("off").line()
    assert "0 of 3 done" in tuner.TuneProgress("background", total=3).line()


def test_an_app_started_with_a_few_methods_builds_and_tunes_only_those(tiny_target_dir, monkeypatch):
    from specviz.apps.web import tuner

    measured = []
    monkeypatch.setattr(tuner, "_measure", lambda state, job: measured.append(job))
    few = load_state(str(tiny_target_dir), "float32", "cpu", tune="now", methods=["pld", "skip"])
    assert set(few.drafters) == {"ar", "pld", "skip"}  # ar always: every column's reference
    assert measured == ["verify cost", "ar", "pld", "skip"]
    assert set(few.unavailable) == set(METHODS) - {"ar", "pld", "skip"}
    assert all("left out when this app started (`--methods`)" == why for why in few.unavailable.values())
    assert few.cannot_run == {}  # not listed as unavailable on the page, and no column of their own
    assert [c for c in column_labels(few) if "(" not in c] == [m for m in METHODS if m in ("ar", "pld", "skip")]
    plan = plan_race(few, "Count.", ["pld", "eagle2"], 4, 0.0, 1.0, None)
    assert list(plan.drafters) == ["pld"] and "eagle2 is unavailable: left out" in " ".join(plan.notes)
    with pytest.raises(SpecvizError, match="unknown method 'nonsense'"):
        load_state(str(tiny_target_dir), methods=["pld", "nonsense"])


def test_the_seed_makes_a_sampled_race_repeat_and_another_seed_differ(handlers):
    def text(seed):
        out = handlers.compare("Tell me a story.", ["ar", "pld"], 24, 1.0, 1.0, None, "auto", seed)
        return [out["methods"][m]["text"] for m in ("ar", "pld")]

    assert text(7) == text(7) and text(7) != text(8)
    out = handlers.compare("Tell me a story.", ["ar"], 4, 1.0, 1.0, None, "auto", -5)
    assert "seed clamped to 0" in " ".join(out["notes"])


def test_a_finished_race_downloads_as_json_with_every_step(handlers, state):
    import json

    from specviz.apps.web import export
    from specviz.apps.web.views import race_download

    updates = list(handlers.race(SimpleNamespace(session_hash="s2"), "Tell me a story.", ["ar", "pld"], 24, 0.0, 1.0,
                                 True, "auto", 3, None, *[s.default for s in handlers.specs]))
    runs = updates[-1][-1]
    as_json, as_page = race_download(runs, state.target.text.decode)
    saved = json.loads(Path(as_json["value"]).read_text())
    assert saved["format"] == export.FORMAT and saved["sampling"]["seed"] == 3 and "Tell me a story." in saved["prompt"]
    for label, run in runs.items():
        method = saved["methods"][label]
        assert method["output"] == [t for step in method["steps"] for t in step["tokens"]]
        assert method["output"] == [t for r in run["records"] for t in r.tokens] and len(method["output"]) == 24
        assert method["text"] == state.target.text.decode(method["output"])
    drafted = [s for s in saved["methods"]["pld"]["steps"] if s["tree"]["tokens"]]
    assert drafted and all(len(s["decisions"]) >= 1 and len(s["node_target_p"]) == len(s["tree"]["tokens"])
                           for s in drafted)  # the numbers the step view shows, per node
    assert all(update["visible"] is False for update in race_download({}, state.target.text.decode))
    page = Path(as_page["value"]).read_text()  # the replay page carries the same race, its JSON unbroken
    embedded = page.split("<script type='application/json' id='race'>", 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded) == saved and "<script src" not in page  # nothing fetched



def test_each_method_keeps_one_colour_in_every_race_plot_and_header(state):
    from specviz.apps import render

    every = render.method_colours(METHODS)
    assert len(set(every.values())) == len(METHODS)  # no two methods share one
    assert render.method_colours(["pld", "eagle2"]) == {"pld": every["pld"], "eagle2": every["eagle2"]}
    assert render.method_colour("eagle2:depth=4") == every["eagle2"]
    plan = plan_race(state, "Hi", ["ar", "pld"], 8, 0, 1, None)
    assert f"border-left: 5px solid {every['pld']}" in RaceView(plan, state.target.text.decode, False).column("pld")
