"""Where an experiment's arms come from: shipped checkpoints at the shared budget, several runs trained at once in
processes of their own, and finished runs carried from the machine that trained them to the one that benches them."""

from __future__ import annotations

import json
import lzma
import shutil
import tarfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from drafters import METHODS
from drafters.checkpoint import CARD, SHIPPED_WEIGHTS, weights_file
from drafters.training.state import Progress, Trainee
from drafters.variants import trained_class
from specviz.apps import experiment_train, training
from specviz.apps.cli import main
from specviz.apps.experiment_train import (
    budget_config,
    budget_recipe,
    finished_runs,
    shipped_bases,
    shipped_mismatch,
    train_arms,
)
from specviz.apps.experiments import BUDGETS, EXPERIMENTS, Arm, Budget, Experiment
from specviz.apps.runs_archive import export_runs, import_runs
from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.load import load_target

TINY = Budget("tiny", "6", "first", 64, 1, "float32", "a test's", answer_tokens=8)
SPEC = "eagle2:depth=2:top_k=2:total_tokens=4"


def _exp(*trains: str) -> Experiment:
    return Experiment("tiny-carry", "HASS", "Table 5", "Do carried runs bench?",
                      tuple(Arm(t, SPEC if not t.startswith("hass") else SPEC.replace("eagle2", "hass"), t)
                            for t in trains))


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir), "float32", "cpu")


@pytest.fixture(scope="module")
def in_processes(target, tiny_target_dir):
    """Two arms trained at once, each in a process of its own (``jobs=2``), then found by the parent."""
    exp = _exp("eagle2", "hass-beta0.5")
    return exp, train_arms(exp, TINY, target, "cpu", jobs=2, target_spec=str(tiny_target_dir))


def test_arms_trained_in_processes_are_the_runs_a_lone_run_names(in_processes, target, monkeypatch, capsys):
    exp, folders = in_processes
    recipe, cfg = budget_recipe(exp, TINY, "cpu"), budget_config(TINY, "cpu")
    expected = {(n, None): training.run_folder(n, trained_class(n), recipe.features_key(target), cfg) / "checkpoint"
                for n in exp.trains}
    assert folders == expected and all((f / CARD).exists() and weights_file(f) for f in folders.values())
    logs = list((experiment_train.cache_dir() / "experiments" / "logs").glob("*-tiny.log"))
    assert {p.name for p in logs} >= {"eagle2-tiny.log", "hass-beta0.5-tiny.log"}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run trained again")

    monkeypatch.setattr("drafters.training.loop.train", no_training)
    assert train_arms(exp, TINY, target, "cpu", jobs=2) == folders  # finished: nothing trains, no process starts
    assert "finished before" in capsys.readouterr().out


def test_a_bf16_budget_does_not_start_training_on_a_cpu_slow_at_bf16(target, monkeypatch):
    """Days of training with nothing said is the failure: the runs left are named, with the ways out."""
    import specviz.core.load as load

    bf16 = Budget("tiny-bf16", "6", "first", 64, 1, "bfloat16", "a test's", answer_tokens=8)
    exp, trained = _exp("hass-beta0.5"), []
    monkeypatch.setattr(experiment_train, "train_drafters",
                        lambda names, *args, **kwargs: trained.extend(names) or {n: Path(n) for n in names})
    monkeypatch.setattr(load, "cpu_flags", lambda: {"avx2", "fma"})
    refused = r"the tiny-bf16 budget .* no bf16 matrix unit .*\(hass-beta0.5-tiny-bf16\).*--allow-slow-bf16"
    with pytest.raises(SettingsError, match=refused):
        train_arms(exp, bf16, target, "cpu")
    assert trained == []
    train_arms(exp, bf16, target, "cpu", allow_slow_bf16=True)
    monkeypatch.setattr(load, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    train_arms(exp, bf16, target, "cpu")
    train_arms(exp, TINY, target, "cpu")  # fp32: nothing to refuse on any CPU
    assert trained == ["hass-beta0.5"] * 3
    monkeypatch.setattr(load, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(experiment_train, "finished_runs",
                        lambda names, joint, *args: {(n, None): Path(n) for n in names})
    train_arms(exp, bf16, target, "cpu")  # finished runs bench on any CPU


def test_a_failed_process_is_named_with_its_log(target, monkeypatch):
    exp = _exp("hass-beta0.25", "hass-passes2")
    monkeypatch.setattr(experiment_train.sys, "executable", "/bin/false")
    failed = r"hass-beta0.25-tiny, hass-passes2-tiny failed to train; see .*hass-beta0.25-tiny.log"
    with pytest.raises(SpecvizError, match=failed):
        train_arms(exp, TINY, target, "cpu", jobs=2)


def test_a_joint_run_trains_in_a_process_of_its_own_and_each_runs_peak_is_kept(target, tiny_target_dir):
    exp = Experiment("tiny-joint", "semi-AR", "Fig. 5", "Do joint runs train beside separate ones?",
                     (Arm("separate", "semi-attn:width=1:length=2", "semi-attn"),
                      Arm("joint", "semi-attn:width=1:length=2", "semi-attn", lam=0.5)), domain="code")
    budget = Budget("tiny-apart", "5", "first", 64, 1, "float32", "its own runs: no other test has trained them",
                    answer_tokens=8)
    folders = train_arms(exp, budget, target, "cpu", jobs=2, target_spec=str(tiny_target_dir))
    assert set(folders) == {("semi-attn", None), ("semi-attn", 0.5)} and folders["semi-attn", None] != folders[
        "semi-attn", 0.5] and all((f / CARD).exists() for f in folders.values())
    cache = experiment_train.cache_dir() / "experiments"
    logs = {p.name for p in (cache / "logs").iterdir()}
    assert {"semi-attn-joint0.5-tiny-apart.log", "semi-attn-tiny-apart.log"} <= logs
    peaks = json.loads((cache / "peaks.json").read_text())  # what the next scheduling of these runs starts from
    assert min(peaks["semi-attn-tiny-apart"], peaks["semi-attn-joint0.5-tiny-apart"]) > 2**20


def test_runs_travel_in_parts_and_import_as_the_same_runs(in_processes, target, tmp_path, monkeypatch):
    exp, folders = in_processes
    sizes = [len(lzma.compress(weights_file(f).read_bytes())) for f in folders.values()]
    parts = export_runs(list(folders.values()), tmp_path / "out", max(sizes) + 64 * 1024)
    assert len(parts) == 2 and all(p.stat().st_size <= max(sizes) + 64 * 1024 for p in parts)  # one run a part
    with pytest.raises(SpecvizError, match="will not fit a part of 1,000 bytes"):
        export_runs(list(folders.values()), tmp_path / "small", 1000)

    into = tmp_path / "runs"
    imported = import_runs(parts, into)
    assert [f.parent.name for f in imported] == [f.parent.name for f in folders.values()]
    for here, there in zip(folders.values(), imported):
        assert (there / CARD).read_bytes() == (here / CARD).read_bytes()
        assert lzma.decompress((there / SHIPPED_WEIGHTS).read_bytes()) == weights_file(here).read_bytes()
    assert import_runs(parts, into) == []  # finished here already: kept, not overwritten

    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        tar.add(parts[0], arcname="../escape")
    with pytest.raises(SpecvizError, match="unexpected member '../escape'"):
        import_runs([bad], into)
    with pytest.raises(SpecvizError, match="not a runs archive"):
        import_runs([tmp_path / "missing.tar"], into)


def test_runs_trained_on_another_device_are_benched_and_a_missing_one_is_an_error(in_processes, target, tmp_path):
    exp, folders = in_processes
    with pytest.raises(SpecvizError, match="eagle2, hass-beta0.5: no finished run trained on cuda"):
        train_arms(exp, TINY, target, "cpu", trained_on="cuda")
    recipe, cuda = budget_recipe(exp, TINY, "cpu"), budget_config(TINY, "cuda")
    for name in exp.trains:  # as an import of a GPU's runs would place them
        there = training.run_folder(name, trained_class(name), recipe.features_key(target), cuda) / "checkpoint"
        shutil.copytree(folders[name, None], there)
    found = train_arms(exp, TINY, target, "cpu", trained_on="cuda")
    assert set(found) == set(folders) and all("checkpoint" == f.name and f != folders[k] for k, f in found.items())
    assert finished_runs(exp.trains, {}, target, recipe, cuda) == found


def test_the_shared_budget_benches_a_shipped_checkpoint_only_where_its_card_says_it_was_trained_so(target):
    shared = BUDGETS["shared"]
    exp = _exp("hass")
    recipe, cfg = budget_recipe(exp, shared, "cpu"), budget_config(shared, "cpu")
    cls = trained_class("hass")
    card = {"data": recipe.card(target) | {"feature_dtype": "bfloat16", "train_samples": 13655},
            "training": asdict(cfg) | {"device": "cuda", "save_every": 200, "steps": 4052},
            "objective": asdict(cls.loss)}
    assert shipped_mismatch(card, cls, recipe.card(target), "bfloat16", cfg) == []
    card["training"]["epochs"] = 2
    card["objective"] = None
    card["network"] = {"blocks": 4}
    assert shipped_mismatch(card, cls, recipe.card(target), "bfloat16", cfg) == [
        "training epochs 2, not 4", "its objective not recorded", "another network"]
    assert not TINY.shipped_bases and shared.shipped_bases


def test_every_shipped_drafter_an_experiment_trains_is_its_shared_budget_base():
    """The cards of the shipped 4-epoch drafters say what the shared budget asks (their objective included), so
    a lease trains only the variants; a card that drifted from its method's recipe would train the base again."""
    shared, embedded = BUDGETS["shared"], SimpleNamespace(name="embedded")
    for name in ("hass-beta", "fspad-ablation", "semi-hq-sweep", "redrafter-rnn"):
        exp = EXPERIMENTS[name]
        found = shipped_bases(list(exp.trains), shared, embedded, budget_recipe(exp, shared, "cpu"),
                              budget_config(shared, "cpu"))
        assert set(found) == {t for t in exp.trains if t in METHODS}, name


def test_the_command_exports_and_imports_runs_and_refuses_to_bench_several(in_processes, tiny_target_dir, tmp_path,
                                                                          monkeypatch, capsys):
    exp, folders = in_processes
    from specviz.apps import experiment_cli

    monkeypatch.setattr(experiment_cli, "experiment", lambda name: exp)
    monkeypatch.setattr(experiment_cli, "budget", lambda name: TINY)
    base = ["experiment", "tiny-carry", "--target", str(tiny_target_dir), "--device", "cpu"]
    assert main(base + ["--export", str(tmp_path / "parts"), "--part-mb", "64"]) == 0
    parts = sorted((tmp_path / "parts").iterdir())
    assert len(parts) == 1 and "wrote 1 part" in capsys.readouterr().out
    for f in folders.values():
        shutil.rmtree(f.parent)
    assert main(base + ["--import", *map(str, parts), "--train-only"]) == 0
    out = capsys.readouterr().out
    assert out.count("imported ") == 2 and "finished before" in out  # carried, not trained again
    assert main(["experiment", "tiny-carry,tiny-carry", "--device", "cpu"]) == 2
    assert "bench one experiment at a time" in capsys.readouterr().err


def test_the_status_says_where_each_arm_stands(in_processes, target, monkeypatch):
    """Finished (the two trained in processes), stopped by a real signal at step 2, held by a trainer now, and not
    started: read from the cache, in the experiment's order."""
    import os
    import signal

    from drafters.training import loop
    from drafters.training.config import TrainConfig
    from drafters.training.lock import run_lock
    from drafters.training.stop import TrainingStopped
    from specviz.apps import experiment_status

    exp = _exp("eagle2", "hass-beta0.5", "hass-passes2", "hass-topk1")
    small_steps = lambda b, d: TrainConfig(epochs=1, batch_tokens=64, device=d, save_every=50)  # noqa: E731
    monkeypatch.setattr(experiment_train, "budget_config", small_steps)
    monkeypatch.setattr(experiment_status, "budget_config", small_steps)
    real_step = loop.train_step

    def step_then_ask(run, batch, progress):
        real_step(run, batch, progress)
        if progress.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    def not_at_once(signum, frame):
        raise AssertionError("the signal stopped the run mid-step")

    monkeypatch.setattr(loop, "train_step", step_then_ask)
    before = signal.signal(signal.SIGINT, not_at_once)
    try:
        with pytest.raises(TrainingStopped):
            train_arms(_exp("hass-passes2"), TINY, target, "cpu")
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(experiment_status, "budget_config", budget_config)  # the finished arms' own runs
    finished = experiment_status.arm_status(_exp("eagle2", "hass-beta0.5"), TINY, target, "cpu")
    assert [(s.arm, s.state) for s in finished] == [("eagle2", "finished"), ("hass-beta0.5", "finished")]
    assert [s.folder for s in finished] == list(in_processes[1].values())

    monkeypatch.setattr(experiment_status, "budget_config", small_steps)
    status = experiment_status.arm_status(exp, TINY, target, "cpu")
    assert [s.arm for s in status] == list(exp.trains)
    stopped, fresh = status[2], status[3]
    assert stopped.state == "stopped" and stopped.step == 2 and stopped.total > 2 and stopped.saved is not None
    assert "2 of" in stopped.line() and "resumes" in stopped.line()
    assert fresh.state == "not started" and fresh.step == 0
    with run_lock(stopped.folder):  # as a trainer holds it
        held = experiment_status.arm_status(exp, TINY, target, "cpu")[2]
    assert held.state == "training" and held.pid == os.getpid() and f"process {os.getpid()}" in held.line()
    assert experiment_status.arm_status(exp, TINY, target, "cpu")[2].state == "stopped"  # let go


def test_the_status_command_lists_the_arms_and_starts_nothing(tiny_target_dir, capsys):
    assert main(["experiment", "hass-beta,redrafter-rnn", "--budget", "mini", "--status", "--target",
                 str(tiny_target_dir), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    arms = EXPERIMENTS["hass-beta"].trains + EXPERIMENTS["redrafter-rnn"].trains
    assert [line.split()[0] for line in lines] == arms and all("not started" in line for line in lines)


def test_experiments_on_different_data_go_one_training_set_at_a_time(tiny_target_dir, capsys):
    """semi-joint trains on the code slice, the others on every prompt: one group each, in the order named."""
    from specviz.apps.experiment_cli import unions

    groups = unions(["hass-beta", "semi-joint", "redrafter-rnn"])
    assert [(g.name, g.domain) for g in groups] == [("hass-beta,redrafter-rnn", ""), ("semi-joint", "code")]
    assert [a.train for a in groups[0].arms] == EXPERIMENTS["hass-beta"].trains + EXPERIMENTS["redrafter-rnn"].trains
    assert main(["experiment", "semi-joint,hass-beta", "--budget", "mini", "--status", "--target",
                 str(tiny_target_dir), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["semi-attn", "semi-lstm", "semi-attn", "semi-lstm",
                                                   *EXPERIMENTS["hass-beta"].trains]
    assert "jointly (lambda 0.25)" in lines[2] and all("not started" in line for line in lines)
    assert main(["experiment", "semi-joint,hass-beta", "--budget", "mini"]) == 2  # a bench takes one experiment
    assert "bench one experiment at a time" in capsys.readouterr().err


def test_arms_that_share_a_prefix_wait_for_its_first_arm_to_write_it(target, tmp_path, monkeypatch):
    from drafters.training.state import save_state

    monkeypatch.setattr(training, "cache_dir", lambda: tmp_path)  # its stand-in prefix is no real run's

    names = ["hass-topk1", "hass-beta0.5", "hass-topk5", "hass-w2", "eagle2"]
    recipe, cfg = budget_recipe(_exp(*names), TINY, "cpu"), budget_config(TINY, "cpu")
    ready = experiment_train.after_prefixes(names, target, recipe, cfg)
    assert sorted(ready) == ["hass-topk5", "hass-w2"]  # topk1 writes it; beta 0.5 has its own; eagle2 has none
    assert not any(wait() for wait in ready.values())
    folder = training.run_prefix(trained_class("hass-topk5"), recipe.features_key(target), cfg)
    assert folder.is_relative_to(tmp_path)
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(net.parameters())
    trainee = Trainee(net, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    save_state(folder / "state", trainee, Progress(step=3), Accelerator(cpu=True))
    assert all(wait() for wait in ready.values())
    assert experiment_train.after_prefixes(names, target, recipe, cfg) == {}  # written: nobody waits
