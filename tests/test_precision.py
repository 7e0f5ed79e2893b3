"""The page's precision switch on a tiny target (the embedded tokenizer, hidden 64): exact fp32 by default, a
bf16 copy with its own drafters and budgets loaded the first time it is picked, and bad values refused."""

from __future__ import annotations

import pytest
import torch

from drafters import build_drafter
from specviz.apps.machine import machine_key
from specviz.apps.web import precision as precision_module
from specviz.apps.web.layout import build_demo
from specviz.core.engine import run
from specviz.core.load import fast_dtype


def test_the_switch_offers_exact_first_and_says_what_fast_trades(app_handlers):
    precisions = app_handlers.precisions
    assert precisions.choices() == [("exact (fp32)", "float32"), ("fast (bf16)", "bfloat16")]
    slower = "no bf16 matrix units" in precisions.trade()
    assert slower == (fast_dtype("cpu") == torch.float32) and "nearly tie" in precisions.trade()
    demo = build_demo(app_handlers.state)
    radio = next(c["props"] for c in demo.config["components"] if c.get("props", {}).get("elem_id") == "precision")
    assert radio["value"] == "float32" and [value for _, value in radio["choices"]] == ["float32", "bfloat16"]


def test_fast_is_a_bf16_copy_loaded_once_with_its_own_budgets(app_state, app_handlers, monkeypatch):
    started = []
    monkeypatch.setattr(app_state.tuning, "mode", "background")  # the server tunes: so does its copy, on its own
    monkeypatch.setattr(precision_module.tuner, "start", started.append)
    fast = app_handlers.at("bfloat16")
    assert fast is not app_state and app_handlers.at("bfloat16") is fast and app_handlers.at(None) is app_state
    assert fast.target.dtype == torch.bfloat16 and fast.engine is app_state.engine and started == [fast]
    assert set(fast.drafters) == set(app_state.drafters) and fast.drafters["pld"] is not app_state.drafters["pld"]
    assert machine_key(fast.target) != machine_key(app_state.target)  # budgets are cached per precision
    out = app_handlers.compare("Count to ten.", ["ar", "pld"], 12, precision="bfloat16")
    assert out["precision"] == "bfloat16" and out["methods"]["ar"]["metrics"]["new_tokens"] == 12
    assert any(note.startswith("precision bfloat16: a lossless method may part") for note in out["notes"])
    direct = run(fast.target, build_drafter("ar", fast.target), fast.target.text.encode_chat("Count to ten."), 12)
    assert [t["token"] for t in out["methods"]["ar"]["tokens"]] == direct.output_ids  # AR in bf16, as run alone
    exact = app_handlers.compare("Count to ten.", ["ar", "pld"], 12)
    assert exact["precision"] == "float32" and exact["methods"]["pld"]["identical_to_ar"] is True
    assert not [note for note in exact["notes"] if note.startswith("precision")]


def test_a_race_runs_in_the_precision_picked(app_handlers):
    race = app_handlers.race(None, "Count.", ["ar", "pld"], 6, 0.0, 1.0, False, "auto", 0, "bfloat16",
                         *app_handlers.preset("fastest", "bfloat16"))
    *_, last = race
    assert all(len(run["records"]) > 0 for run in last[-1].values())
    with pytest.raises(Exception, match="precision must be float32 or bfloat16, got 'float64'"):
        next(app_handlers.race(None, "Count.", ["ar"], 6, 0.0, 1.0, False, "auto", 0, "float64"))
    with pytest.raises(Exception, match="precision must be"):
        app_handlers.compare("Count.", ["ar"], 4, precision=["bfloat16"])
