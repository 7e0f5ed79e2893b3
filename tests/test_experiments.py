"""The papers' experiments: a registry whose every arm runs, results as typed data with their table and
figure, and one experiment end to end on a tiny target (train the arms at a budget, bench, write)."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import pytest

from drafters import METHODS, parse_spec
from drafters.variants import trained_class
from specviz.apps import experiment_cli
from specviz.apps.cli import build_parser, main
from specviz.apps.domain_eval import domain_questions, rouge_l
from specviz.apps.experiment_plot import experiment_figure
from specviz.apps.experiment_results import ExperimentResult
from specviz.apps.experiment_run import run_experiment
from specviz.apps.experiments import BUDGETS, EXPERIMENTS, TRAINED_SHIPPED, Arm, Budget, Experiment
from specviz.apps.questions import Question
from specviz.core.files import cache_dir


def test_every_arm_is_a_method_spec_and_every_trained_arm_trains():
    for exp in EXPERIMENTS.values():
        assert len(exp.arms) >= 2 and len({a.label for a in exp.arms}) == len(exp.arms), exp.name
        for arm in exp.arms:
            name, _ = parse_spec(arm.spec)
            if arm.train:
                assert trained_class(arm.train).name == name, (exp.name, arm.label)
    assert set(TRAINED_SHIPPED) == {n for n, (c, _) in METHODS.items() if getattr(c, "trained", False)}
    assert {"small", "shared"} <= set(BUDGETS)


def test_experiment_list_and_a_wrong_name(capsys):
    assert main(["experiment", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPERIMENTS) and "semi-attn jointly (lambda 0.25)" in out
    assert main(["experiment", "semi-jointly"]) == 2
    assert "no experiment 'semi-jointly'" in capsys.readouterr().err
    args = build_parser().parse_args(["experiment", "hass-beta"])
    assert (args.budget, args.per_category, args.max_new_tokens) == ("small", 1, 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "hass-beta", "--budget", "huge"])
    capsys.readouterr()
    experiment_cli.cmd_experiment(argparse.Namespace(name="list"))
    assert "fspad-ablation" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_run(tiny_target_dir, tmp_path_factory):
    """An experiment of two trained arms at a tiny budget, end to end, on the app tests' tiny target."""
    exp = Experiment("tiny-ablation", "FSPAD", "Table 3", "Does the test run?",
                     (Arm("FSPAD", "fspad:depth=2:top_k=2:total_tokens=4", "fspad"),
                      Arm("without PAD", "fspad:depth=2:top_k=2:total_tokens=4", "fspad-no-pad")),
                     temperatures=(0.0, 1.0))
    budget = Budget("tiny", "6", "first", 64, 1, "float32", "a test's", answer_tokens=8)
    questions = [Question("q1", "writing", "Say hello."), Question("q2", "coding", "Count to three.")]
    out = tmp_path_factory.mktemp("experiment") / "tiny.json"
    result = run_experiment(exp, budget, questions, "two questions", 6, out, str(tiny_target_dir), "cpu")
    return result, out


def test_an_experiment_trains_its_arms_benches_them_and_writes_its_results(tiny_run):
    result, out = tiny_run
    assert result.complete and ExperimentResult.load(out) == result
    assert [a.label for a in result.arms] == ["FSPAD", "without PAD"] * 2
    assert [a.temperature for a in result.arms] == [0.0, 0.0, 1.0, 1.0]
    greedy = [a for a in result.arms if a.temperature == 0]
    assert all(a.identical_to_ar == a.prompts == 2 for a in greedy)  # lossless at T = 0
    assert all(a.training and a.training.val.get("acc1") is not None for a in result.arms)
    assert greedy[0].spec != greedy[1].spec and "checkpoint=" in greedy[1].spec  # each arm its own checkpoint
    assert all("checkpoint=$SPECVIZ_CACHE/train/runs/" in a.spec and str(cache_dir()) not in a.spec
               for a in greedy[1:])  # a results file names no machine's folders
    assert result.budget["name"] == "tiny" and result.budget["epochs"] == 1


def test_the_table_and_the_figure_show_every_arm(tiny_run):
    result, _ = tiny_run
    table = result.markdown()
    assert "| FSPAD | 0 |" in table and "| without PAD | 1 |" in table and "val acc1" in table
    assert "Budget `tiny` (6 prompts, 1 epoch)" in table
    fig = experiment_figure(result)
    names = {t.name for t in fig.data}
    assert {"T = 0", "T = 1", "FSPAD", "without PAD"} <= names
    assert experiment_figure(None).layout.title.text == "no experiment results"


def test_the_table_says_where_the_arms_trained_only_where_their_machines_differ(tiny_run):
    """A shipped base trained on a GPU beside variants trained here: the table names both machines."""
    result, _ = tiny_run
    assert "Trained on" not in result.markdown()  # every arm trained on this machine
    gpu = replace(result.arms[0].training, machine="NVIDIA H100")
    mixed = replace(result, arms=[replace(a, training=gpu) if a.label == "FSPAD" else a for a in result.arms])
    line = mixed.markdown().splitlines()[-1]
    here = result.arms[1].training.machine
    assert line == f"Trained on: NVIDIA H100 (FSPAD); {here} (without PAD)."


def test_a_joint_experiment_benches_each_arm_on_its_own_target(tiny_target_dir, tmp_path):
    """semi-joint's shape: a domain slice's answers, separate and joint arms, each exact against its own target's
    AR, with that target's Rouge-L against the held-out references."""
    exp = Experiment("tiny-joint", "semi-AR", "Fig. 5", "Does joint training run?",
                     (Arm("separate", "semi-attn:width=1:length=2", "semi-attn"),
                      Arm("joint", "semi-attn:width=1:length=2", "semi-attn", lam=0.5)), domain="code")
    budget = Budget("tiny", "6", "first", 64, 1, "float32", "a test's", answer_tokens=8)
    questions, references = domain_questions("code", 2)
    out = tmp_path / "joint.json"
    result = run_experiment(exp, budget, questions, "code slice", 6, out, str(tiny_target_dir), "cpu",
                            references=references)
    separate, joint = result.arms
    assert joint.lam == 0.5 and joint.training.lora_parameters > 0 and separate.training.lora_parameters is None
    assert all(a.identical_to_ar == a.prompts == 2 for a in result.arms)  # each exact on its own target
    assert all(0 <= a.target_rouge_l <= 1 for a in result.arms)
    assert "/target" not in separate.spec and joint.spec != separate.spec
    assert result.budget["domain"] == "code" and "target Rouge-L" in result.markdown()
    assert ExperimentResult.load(out) == result


def test_rouge_l_is_the_lcs_f_measure():
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert rouge_l("a b", "a b") == 1.0 and rouge_l("", "a") == 0.0 and rouge_l("x y", "a b") == 0.0
    assert rouge_l("b a", "a b") == pytest.approx(0.5)  # a subsequence, not a bag of words


def test_the_benchmark_tab_lists_shipped_experiments(tiny_run, tmp_path, monkeypatch):
    from specviz.apps import experiment_results
    from specviz.apps.web import views

    monkeypatch.setattr(experiment_results, "SHIPPED", tmp_path)
    assert views.experiment_choices() == [] and views.experiment_view(None)[0] == views.NO_EXPERIMENTS
    result, _ = tiny_run
    result.save(tmp_path / "tiny-ablation-tiny.json")
    (tmp_path / "broken.json").write_text("{not json")
    assert views.experiment_choices() == ["tiny-ablation-tiny"]
    text, figure = views.experiment_view("tiny-ablation-tiny")
    assert text == result.markdown() and {t.name for t in figure.data} >= {"FSPAD", "without PAD"}


def test_train_only_finds_the_arms_trained_at_the_budget_and_benches_nothing(tiny_run, tiny_target_dir, capsys,
                                                                             monkeypatch, tmp_path):
    """--train-only resumes the arms' runs (here all finished, so none trains again) and writes no results."""
    result, _ = tiny_run
    exp = Experiment("tiny-ablation", "FSPAD", "Table 3", "Does the test run?",
                     tuple(Arm(a.label, a.spec.split(":checkpoint=")[0], a.train) for a in result.arms[:2]))
    monkeypatch.setattr(experiment_cli, "experiment", lambda name: exp)
    monkeypatch.setattr(experiment_cli, "budget",
                        lambda name: Budget("tiny", "6", "first", 64, 1, "float32", "a test's", answer_tokens=8))
    args = build_parser().parse_args(["experiment", "tiny-ablation", "--train-only", "--target", str(tiny_target_dir),
                                      "--device", "cpu", "--out", str(tmp_path / "r.json")])
    runs = [os.path.expandvars(a.spec.split(":checkpoint=")[1]) for a in result.arms[:2]]  # $SPECVIZ_CACHE/...
    folders = [Path(run) for run in runs]
    stamps = [sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir()) for folder in folders]
    experiment_cli.cmd_experiment(args)
    assert [sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir()) for folder in folders] == stamps
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert printed == {a.train: run for a, run in zip(result.arms[:2], runs)}
    assert not (tmp_path / "r.json").exists()
    monkeypatch.setattr(experiment_cli, "experiment", lambda name: EXPERIMENTS["redrafter-beams"])
    experiment_cli.cmd_experiment(args)  # shipped drafters only: said, and nothing loaded
    assert capsys.readouterr().out == "redrafter-beams trains no arms: bench it without --train-only\n"


def test_the_table_shows_merged_beams_compression_only_where_beams_merged():
    from specviz.apps.experiment_results import ArmResult

    def arm(label, compression):
        return ArmResult(label, "redrafter", 0.0, 1.5, 1.1, 10.0, 2, 2, [0.4], compression)

    def table(*arms):
        result = ExperimentResult("beams", "ReDrafter", "Fig. 5", "?", {}, "q", 8, "m", "d")
        result.arms.extend(arms)
        return result.markdown()

    assert "beam tokens per tree token" not in table(arm("eagle", None))
    merged = table(arm("width 1", 1.0), arm("width 4", 1.29))
    assert "beam tokens per tree token" in merged and "| width 4 | 1.50 | 1.29 | 1.10× |" in merged
