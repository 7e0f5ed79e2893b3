"""The temperature sweep: the quality measure is the target's own log-likelihood, and each cell's rows."""

from __future__ import annotations

import json

import torch

from conftest import reference_logits
from specviz.apps.sweep import log_likelihood


def test_log_likelihood_is_the_targets_own(tiny_target):
    target = tiny_target(32, seed=5)
    prompt, output = [3, 1, 4, 1, 5], [9, 2, 6]
    total, n = log_likelihood(target, prompt, output)
    logits = reference_logits(target.model, prompt + output)[len(prompt) - 1: -1]
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(output)].sum()
    assert n == 3 and abs(total - float(expected)) < 1e-4
    assert log_likelihood(target, prompt, []) == (0.0, 0)


def test_the_sweep_command_writes_a_row_per_method_rule_and_temperature(tmp_path, capsys):
    from app_harness import tiny_target_folder
    from specviz.apps.cli import main

    folder = tiny_target_folder(tmp_path / "target")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Count to five."]}))
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--target", str(folder), "--questions", str(questions), "--methods", "pld",
                 "--temperatures", "0,0.8", "--max-new-tokens", "8", "--dtype", "float32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["temperature"], r["rule"]) for r in rows}
    assert cells == {(0.0, "greedy"), (0.0, "typical"), (0.8, "rejection"), (0.8, "typical")}
    assert {r["method"] for r in rows} == {"ar", "pld"} and len(rows) == 8
    assert all(r["lossless"] == (r["rule"] != "typical") for r in rows)
    greedy = {r["method"]: r for r in rows if r["rule"] == "greedy"}
    assert greedy["pld"]["log_likelihood"] == greedy["ar"]["log_likelihood"]  # lossless at T=0: the same text
    assert all(r["log_likelihood"] < 0 and r["tokens"] > 0 for r in rows)
    assert main(["sweep", "--target", str(folder), "--temperatures", "hot"]) == 2
    assert "--temperatures must be numbers" in capsys.readouterr().err
