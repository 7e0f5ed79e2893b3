"""The training pipeline on accelerate: a killed run resumes to the weights of an unbroken one, bf16
autocast trains, and the card records the budget every method shares."""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_training_data
from drafters import METHODS
from drafters.training.config import TrainConfig
from drafters.training.lock import RunBusy, run_lock
from drafters.training.loop import train
from drafters.training.state import Progress, saved_state
from drafters.training.stop import TrainingStopped
from specviz.core.errors import SettingsError


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(48, seed=4, num_layers=2)


@pytest.fixture(scope="module")
def data(target):
    return tiny_training_data(target, 40, 0, 16, 8)


class Killed(Exception):
    pass


def kill_at(step: int):
    def after_step(done: int) -> None:
        if done == step:
            raise Killed

    return after_step


@pytest.mark.parametrize("method", ["eagle2", "redrafter"])
def test_a_killed_run_resumes_to_the_unbroken_weights(method, target, data, tmp_path):
    cfg = TrainConfig(epochs=2, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    cls = METHODS[method][0]
    whole = train(cls, target, data, data, cfg, {}, tmp_path / "whole", tmp_path / "run-a")
    for kill in (5, cfg.save_every * 2):  # between two saves, and right on one
        work = tmp_path / f"run-{kill}"
        with pytest.raises(Killed):
            train(cls, target, data, data, cfg, {}, tmp_path / "never", work, after_step=kill_at(kill))
        assert not (tmp_path / "never").exists()
        again = train(cls, target, data, data, cfg, {}, tmp_path / f"resumed-{kill}", work, resume=True)
        a, b = load_file(str(tmp_path / "whole" / "weights.safetensors")), load_file(
            str(tmp_path / f"resumed-{kill}" / "weights.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert again["history"] == whole["history"] and again["training"]["steps"] == whole["training"]["steps"]
        assert again["training"]["answer_tokens_seen"] == whole["training"]["answer_tokens_seen"]


class Before(Exception):
    """What SIGINT and SIGTERM did before training started: the test fails with it wherever they still do that."""


def before(signum, frame):
    raise Before(signum)


@pytest.fixture
def signals_before():
    previous = {s: signal.signal(s, before) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def signal_at(step: int, signum: int, times: int = 1):
    def after_step(done: int) -> None:
        if done == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)

    return after_step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run_at_the_end_of_its_step_with_the_state_saved(signum, target, data, tmp_path,
                                                                            signals_before):
    cfg = TrainConfig(epochs=2, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    cls = METHODS["eagle2"][0]
    train(cls, target, data, data, cfg, {}, tmp_path / "whole", tmp_path / "run-a")
    with pytest.raises(TrainingStopped):  # asked at step 5, between the saves at 3 and 6
        train(cls, target, data, data, cfg, {}, tmp_path / "never", tmp_path / "run", after_step=signal_at(5, signum))
    assert Progress.load(saved_state(tmp_path / "run")).step == 5 and not (tmp_path / "never").exists()
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is before
    train(cls, target, data, data, cfg, {}, tmp_path / "resumed", tmp_path / "run", resume=True)
    a, b = (load_file(str(tmp_path / f / "weights.safetensors")) for f in ("whole", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_signal_acts_as_before_at_once(target, data, tmp_path, signals_before):
    cfg = TrainConfig(epochs=1, batch_tokens=128, draft_vocab=32, save_every=100)
    with pytest.raises(Before):
        train(METHODS["eagle2"][0], target, data, data, cfg, {}, None, tmp_path / "run",
              after_step=signal_at(2, signal.SIGINT, times=2))
    assert saved_state(tmp_path / "run") is None  # it did not wait for the step's end to save


def one_flat_buffer(net: torch.nn.Module) -> torch.nn.Module:
    """Every LSTM weight made a view of one buffer, as cuDNN lays them out on a GPU."""
    for lstm in (m for m in net.modules() if isinstance(m, torch.nn.LSTM)):
        flat = torch.cat([p.detach().flatten() for p in lstm.parameters()])
        start = 0
        for p in lstm.parameters():
            p.data, start = flat[start:start + p.numel()].view_as(p), start + p.numel()
    return net


def test_a_recurrent_drafter_with_weights_in_one_buffer_resumes(target, data, tmp_path, monkeypatch):
    """A training state must hold weights that share storage (safetensors refuses them or drops some):
    semi-lstm's first run on a GPU could not resume from its saved state."""
    cls = METHODS["semi-lstm"][0]
    plain = cls.new_network.__func__
    monkeypatch.setattr(cls, "new_network", classmethod(lambda c, t: one_flat_buffer(plain(c, t))))
    assert len({p.untyped_storage().data_ptr() for p in cls.new_network(target).lstm.parameters()}) == 1
    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    train(cls, target, data, data, cfg, {}, tmp_path / "whole", tmp_path / "unbroken")
    with pytest.raises(Killed):
        train(cls, target, data, data, cfg, {}, None, tmp_path / "killed", after_step=kill_at(4))
    train(cls, target, data, data, cfg, {}, tmp_path / "resumed", tmp_path / "killed", resume=True)
    a, b = (load_file(str(tmp_path / f / "weights.safetensors")) for f in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_kill_while_saving_leaves_the_last_state_whole(target, data, tmp_path, monkeypatch):
    from drafters.training.state import Progress

    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    cls = METHODS["eagle2"][0]
    train(cls, target, data, data, cfg, {}, tmp_path / "whole", tmp_path / "unbroken")
    plain_save, calls = Progress.save, []

    def dies_on_the_second_save(self, folder):
        calls.append(self.step)
        if len(calls) == 2:  # the weights of step 6 are written; its progress is not
            raise Killed
        plain_save(self, folder)

    work = tmp_path / "killed"
    with monkeypatch.context() as patch:
        patch.setattr(Progress, "save", dies_on_the_second_save)
        with pytest.raises(Killed):
            train(cls, target, data, data, cfg, {}, None, work)
    assert calls == [3, 6] and Progress.load(work / "state").step == 3
    (work / "state").rename(work / "state.old")  # and a kill between the swap's two renames
    train(cls, target, data, data, cfg, {}, tmp_path / "resumed", work, resume=True)
    a, b = (load_file(str(tmp_path / f / "weights.safetensors")) for f in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_drafters_trained_one_after_another_on_one_accelerator_each_resume(target, data, tmp_path):
    """`specviz train --drafter a,b` shares one accelerator; b's saved state must hold b alone."""
    from drafters.training.loop import make_accelerator

    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    eagle2, redrafter = METHODS["eagle2"][0], METHODS["redrafter"][0]
    shared = make_accelerator(cfg)
    train(eagle2, target, data, data, cfg, {}, None, tmp_path / "first", accelerator=shared)
    with pytest.raises(Killed):
        train(redrafter, target, data, data, cfg, {}, None, tmp_path / "second", accelerator=shared,
              after_step=kill_at(4))
    train(redrafter, target, data, data, cfg, {}, tmp_path / "resumed", tmp_path / "second", resume=True)
    train(redrafter, target, data, data, cfg, {}, tmp_path / "whole", tmp_path / "unbroken")
    a, b = (load_file(str(tmp_path / f / "weights.safetensors")) for f in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_validation_within_an_epoch_is_recorded_and_changes_no_weight(target, data, tmp_path):
    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32)
    plain = train(METHODS["hass"][0], target, data, data, cfg, {}, tmp_path / "plain")
    checked = train(METHODS["hass"][0], target, data, data, replace(cfg, validate_every=4), {}, tmp_path / "checked")
    steps = checked["training"]["steps"]
    assert [c["step"] for c in checked["validation_checks"]] == list(range(4, steps + 1, 4)) and steps >= 8
    assert set(checked["validation_checks"][-1]["val"]) >= {"acc1", "acc2", "acc3", "acc4"}
    if steps % 4 == 0:  # the last check is the end-of-epoch validation
        assert checked["validation_checks"][-1]["val"] == checked["history"][-1]["val"]
    a, b = (load_file(str(tmp_path / f / "weights.safetensors")) for f in ("plain", "checked"))
    assert all(torch.equal(a[k], b[k]) for k in a) and plain["validation_checks"] == []


def test_a_run_being_trained_by_another_process_is_refused_before_any_step(target, data, tmp_path):
    cfg = TrainConfig(epochs=1, batch_tokens=128, draft_vocab=32, save_every=1)
    with run_lock(tmp_path / "run"):  # as another trainer holds it
        with pytest.raises(RunBusy, match="being trained now"):
            train(METHODS["eagle2"][0], target, data, data, cfg, {}, tmp_path / "out", tmp_path / "run")
    assert saved_state(tmp_path / "run") is None and not (tmp_path / "out").exists()


def test_resume_needs_a_saved_state(target, data, tmp_path):
    with pytest.raises(SettingsError, match="nothing to resume"):
        train(METHODS["eagle2"][0], target, data, data, TrainConfig(epochs=1), {}, None, tmp_path, resume=True)


def test_bf16_autocast_trains_and_says_so(target, data):
    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32, precision="bf16")
    card = train(METHODS["eagle2"][0], target, data, data, cfg, {})
    assert card["training"]["mixed_precision"] == "bf16"
    assert 0.0 <= card["history"][-1]["val"]["acc1"] <= 1.0 and card["training"]["answer_tokens_seen"] > 0


def test_config_rejects_nonsense():
    with pytest.raises(SettingsError):
        TrainConfig(precision="fp8")
    with pytest.raises(SettingsError):
        TrainConfig(save_every=0)


@pytest.mark.parametrize("flags, expected", [({"avx2", "avx512_bf16"}, torch.bfloat16), ({"amx_bf16"}, torch.bfloat16),
                                             ({"avx2", "fma"}, torch.float32), (set(), torch.float32)])
def test_fast_dtype_reads_the_cpu(flags, expected, monkeypatch):
    import specviz.core.load as load

    monkeypatch.setattr(load, "cpu_flags", lambda: flags)
    assert load.fast_dtype("cpu") == expected and load.fast_dtype("cuda") == torch.bfloat16
    assert load.resolve_dtype_or_auto("auto", "cpu") == expected
    assert load.resolve_dtype_or_auto("float32", "cpu") == torch.float32
    precision = TrainConfig(precision="auto").mixed_precision
    assert precision == ("bf16" if expected == torch.bfloat16 else "no")
    assert load.slow_bf16("cpu") == (expected == torch.float32) and not load.slow_bf16("cuda")


def test_bf16_asked_for_on_a_cpu_slow_at_it_is_warned_of(monkeypatch, capsys):
    import specviz.core.load as load
    from specviz.apps.training_cli import _warn_slow_bf16

    monkeypatch.setattr(load, "cpu_flags", lambda: {"avx2", "fma"})
    _warn_slow_bf16("cpu", features=True, training=False)
    assert "warning: features in bf16 on a CPU without AMX or AVX-512 BF16" in capsys.readouterr().err
    _warn_slow_bf16("cpu", features=False)
    _warn_slow_bf16("cuda", features=True)
    monkeypatch.setattr(load, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    _warn_slow_bf16("cpu", features=True)
    assert capsys.readouterr().err == ""


def test_cuda_and_cuda0_are_one_device_for_training():
    """accelerate names its device ``cuda``, a model's parameters say ``cuda:0``: the first real GPU run
    stopped on this comparison before a single step."""
    from drafters.training.loop import same_device

    assert same_device("cuda", "cuda:0") and same_device(torch.device("cuda", 0), "cuda") and same_device("cpu", "cpu")
    assert not same_device("cuda:1", "cuda") and not same_device("cpu", "cuda:0")


def test_training_states_are_safetensors_and_json_and_restore_the_optimizer(target, data, tmp_path):
    """Data formats only (reading a state runs no code from it); the optimizer's moments, steps and groups return."""
    from drafters.training.state import optimizer_parts, optimizer_state

    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=3)
    train(METHODS["semi-lstm"][0], target, data, data, cfg, {}, None, tmp_path / "run")
    names = sorted(p.name for p in (tmp_path / "run" / "state").iterdir())
    assert names == ["network.safetensors", "optimizer.json", "optimizer.safetensors", "progress.json",
                     "random-0.safetensors", "schedule.json"]
    net = torch.nn.LSTM(4, 3, num_layers=2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95))
    net(torch.randn(2, 5, 4))[0].sum().backward()
    opt.step()
    tensors, meta = optimizer_parts(opt.state_dict())
    again = torch.optim.AdamW(net.parameters(), lr=0.5)
    again.load_state_dict(optimizer_state(tensors, meta))
    before, after = opt.state_dict(), again.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-3 and list(after["param_groups"][0]["betas"]) == [0.9, 0.95]
    assert before["state"].keys() == after["state"].keys()
    for index, values in before["state"].items():
        assert all(torch.equal(values[k], after["state"][index][k]) for k in values)


def test_the_run_key_is_the_one_runs_were_saved_under():
    """A run's work folder keeps its name: the key hashes the JSON the hand-written key hashed."""
    import hashlib
    import json
    from dataclasses import asdict

    from drafters.training.config import OUTSIDE_RUN_KEY, run_key

    cfg = TrainConfig(epochs=3, lr=1e-3, device="cpu")
    for name in ("hass", "medusa"):
        method = METHODS[name][0]
        config = {k: v for k, v in asdict(cfg).items() if k not in OUTSIDE_RUN_KEY}
        old = json.dumps([name, "dfbc9cda6fd2-bfloat16", config, getattr(method, "loss", None)], sort_keys=True,
                         default=str)
        assert run_key(method, "dfbc9cda6fd2-bfloat16", cfg) == hashlib.sha1(old.encode()).hexdigest()[:12]
    assert run_key(METHODS["hass"][0], "k", cfg) != run_key(METHODS["eagle2"][0], "k", cfg)  # the objective counts
    assert run_key(METHODS["hass"][0], "k", cfg) == run_key(METHODS["hass"][0], "k", replace(cfg, save_every=7))


def test_the_card_records_objective_budget_size_and_machine(target):
    from drafters.training.card import RunFacts, training_card
    from drafters.training.state import Progress
    from drafters.vocab_head import FrozenTarget

    frozen, net = FrozenTarget(target, torch.arange(32)), torch.nn.Linear(4, 5)
    facts = RunFacts(12.34, 1, torch.device("cpu"), (1,), 0.9876543)
    progress = Progress(step=7, tokens=99, history=[{"epoch": 1}])
    cfg = TrainConfig(epochs=1)
    hass = training_card(METHODS["hass"][0], target, cfg, {"source": "x"}, progress, net, frozen, facts)
    assert hass["method"] == "hass" and hass["data"] == {"source": "x"} and hass["history"] == [{"epoch": 1}]
    assert hass["objective"]["passes"] == 3 and hass["objective"]["topk"] == 10
    run = hass["training"]
    assert (run["steps"], run["answer_tokens_seen"], run["wall_s"]) == (7, 99, 12.3)
    assert run["epochs"] == 1 and "threads" in run["machine"]
    assert hass["parameters"]["trained"] == 25 and hass["parameters"]["extra_total"] == 25 + frozen.head.numel()
    assert hass["draft_vocab"] == {"size": 32, "train_token_coverage": 0.9877}
    assert hass["features"]["tapped_layer_inputs"] == [1] and hass["validation_checks"] == []
    medusa = training_card(METHODS["medusa"][0], target, cfg, {}, progress, net, frozen, facts)
    assert medusa["objective"] is None  # the heads' chain loss has no options


def test_length_batches_bound_padding_and_rows():
    from drafters.training.batches import length_batches

    lengths = [5, 1, 9, 3, 9, 2, 7, 4, 6, 8]
    by_tokens = length_batches(lengths, 20)
    assert sorted(i for b in by_tokens for i in b) == list(range(10))
    assert all(len(b) * max(lengths[i] for i in b) <= 20 or len(b) == 1 for b in by_tokens)
    assert [lengths[i] for b in by_tokens for i in b] == sorted(lengths)  # shortest first
    by_rows = length_batches(lengths, rows=3, longest_first=True)
    assert [len(b) for b in by_rows] == [3, 3, 3, 1]
    assert [lengths[i] for b in by_rows for i in b] == sorted(lengths, reverse=True)
    assert by_rows[0] == [2, 4, 9]  # equal lengths keep their order
    shuffled = length_batches(lengths, 20, torch.Generator().manual_seed(0))
    assert shuffled == length_batches(lengths, 20, torch.Generator().manual_seed(0))

    def profile(batches: list[list[int]]) -> list[list[int]]:
        return sorted(sorted(lengths[i] for i in b) for b in batches)

    assert profile(shuffled) == profile(by_tokens)  # batches alike, in another order
