"""``profile --train``: the timed step trains exactly as the untimed one, every method steps on the same batches,
the whole-run projection counts the steps ``train`` plans, and the sample comes from the budget's own sequences."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_training_data
from drafters import METHODS
from drafters.training.batches import make_batch, training_batches
from drafters.training.config import TrainConfig
from drafters.training.loop import StepTimings, make_accelerator, set_up, train_step
from drafters.training.sequences import DataRecipe, save_sequences
from drafters.training.state import Progress
from specviz.apps import train_profile
from specviz.apps.cli import main
from specviz.apps.train_profile import PHASES, profile_steps, run_batches, sequence_pool, stratified
from specviz.apps.training import training_classes
from specviz.core.timing import PhaseTimer

CFG = TrainConfig(epochs=1, batch_tokens=96, lr=3e-3, draft_vocab=32)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(48, seed=5, num_layers=4)


@pytest.fixture(scope="module")
def data(target):
    return tiny_training_data(target, 30, 1, 12, 8)


def _steps(method: str, target, data, timed: bool, n: int = 3):
    run = set_up(METHODS[method][0], target, data, CFG, {}, make_accelerator(CFG))
    progress = Progress(running={}, history=[])
    loader = iter(run.accelerator.prepare_data_loader(torch.utils.data.DataLoader(
        range(len(data)), batch_sampler=run.plan[0], collate_fn=lambda ids: make_batch(data, ids, CFG.max_length))))
    timers = []
    for _ in range(n):
        timers.append(PhaseTimer("cpu", StepTimings()) if timed else None)
        train_step(run, next(loader), progress, timers[-1])
    return run.net, progress, timers


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])  # eagle3 taps layers besides the features: a fourth phase
def test_a_timed_step_trains_exactly_as_an_untimed_one(method, target, data):
    plain, p_plain, _ = _steps(method, target, data, timed=False)
    timed, p_timed, timers = _steps(method, target, data, timed=True)
    a, b = plain.state_dict(), timed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert p_plain.running == p_timed.running and p_plain.tokens == p_timed.tokens
    for timer in timers:
        t = timer.timings
        assert all(getattr(t, p) > 0 for p in PHASES)  # every phase ran inside its block
        assert t.total == pytest.approx(sum(getattr(t, p) for p in PHASES))


def test_every_method_steps_on_the_same_batches(target, data):
    batches = training_batches(data, CFG.batch_tokens, CFG.max_length, torch.Generator().manual_seed(1))[:4]
    answer = sum(int(make_batch(data, ids, CFG.max_length)[2].sum()) for ids in batches) / len(batches)
    padded = sum(make_batch(data, ids, CFG.max_length)[0].numel() for ids in batches) / len(batches)
    rows = profile_steps(target, training_classes(["eagle2", "medusa"]), data, {}, CFG, batches, warmup=2)
    assert [r.method for r in rows] == ["eagle2", "medusa"]
    for row in rows:
        assert (row.answer_tokens, row.padded_tokens) == (pytest.approx(answer), pytest.approx(padded))
        assert set(row.ms) == {*PHASES, "total"} and row.ms["total"] == pytest.approx(sum(row.ms[p] for p in PHASES))
        assert len(row.step_ms) == len(batches) and row.ms["total"] == pytest.approx(sum(row.step_ms) / len(batches))
        assert row.tokens_per_s == pytest.approx(answer / (row.ms["total"] / 1000))


def test_the_timed_steps_spread_over_the_runs_progress(target, data):
    """A late objective term (HASS's Top-K joins after 80 %) is in its share of the timed steps."""
    seen = []

    class Recording(METHODS["hass"][0]):
        @classmethod
        def training_loss(cls, *args, done: float = 1.0, **kwargs):
            seen.append(done)
            return super().training_loss(*args, done=done, **kwargs)

    batches = training_batches(data, CFG.batch_tokens, CFG.max_length, torch.Generator().manual_seed(1))[:5]
    profile_steps(target, {"hass": Recording}, data, {}, CFG, batches, warmup=1)
    assert seen[0] == 0.0 and len(seen) == 6
    total = len(training_batches(data, CFG.batch_tokens, CFG.max_length, torch.Generator()))  # one epoch's steps
    assert seen[1:] == [int((k + 0.5) * total / 5) / total for k in range(5)]
    assert sum(d >= 0.8 for d in seen[1:]) == 1  # one step in five with the Top-K term, as in a whole run


def test_the_profiled_batches_are_a_whole_runs_own(target, data):
    cfg = TrainConfig(epochs=3, batch_tokens=80, draft_vocab=32, max_length=14)  # some sequences are cut
    seqs = [(data.sequence(i)[0], data.sequence(i)[2]) for i in range(len(data))]
    run = set_up(METHODS["eagle2"][0], target, data, cfg, {}, make_accelerator(cfg))
    whole = run_batches(seqs, cfg)
    assert whole == run.plan[0] and cfg.epochs * len(whole) == run.total_steps


def test_stratified_batches_spread_from_the_shortest_to_the_longest(data):
    seqs = [(data.sequence(i)[0], data.sequence(i)[2]) for i in range(len(data))]
    batches = run_batches(seqs, CFG)
    width = {tuple(b): max(seqs[i][0].numel() for i in b) for b in batches}
    ordered = sorted(width.values())
    assert [width[tuple(b)] for b in stratified(batches, seqs, len(batches))] == ordered  # all, in order of width
    assert [width[tuple(b)] for b in stratified(batches, seqs, 1)] == [ordered[len(ordered) // 2]]  # the middle one
    picks = [width[tuple(b)] for b in stratified(batches, seqs, 3)]
    third = len(ordered) // 3
    assert picks == sorted(picks) and picks[0] <= ordered[third] and picks[-1] >= ordered[-third]


def test_the_pool_is_the_budgets_own_split_where_it_was_made(target, data, tmp_path, monkeypatch):
    monkeypatch.setattr(train_profile, "cache_dir", lambda: tmp_path)
    recipe = DataRecipe(30)
    seqs = [(data.sequence(i)[0], data.sequence(i)[2]) for i in range(len(data))]
    save_sequences(tmp_path / "train" / f"sequences-{recipe.key(target)}.safetensors",
                   {"train": seqs, "val": seqs[:2]}, recipe.card(target))
    pool, source, own = sequence_pool(target, recipe, enough=10)
    assert own and source.startswith("sequences-") and len(pool) == len(seqs)
    assert all(torch.equal(a, b) and i == j for (a, i), (b, j) in zip(pool, seqs))


def test_the_cli_profiles_a_users_target_on_sharegpts_own_answers(tmp_path, monkeypatch, capsys):
    """A folder target has no self-distilled sequences: the profile samples ShareGPT's answers instead."""
    import transformers

    from conftest import make_llama
    from specviz.core.load import embedded_folder

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_folder())
    folder = tmp_path / "target"
    make_llama(vocab_size=len(tokenizer), num_layers=2, max_positions=1024, eos=tokenizer.eos_token_id) \
        .save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "profile.json"
    code = main(["profile", "--train", "eagle2", "--target", str(folder), "--device", "cpu", "--steps", "2",
                 "--precision", "no", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["data"].startswith("ShareGPT's own answers") and result["run_steps"] is None
    assert result["steps"] == 2 and all(len(r["step_ms"]) == 2 for r in result["rows"])
    assert result["precision"] == "no" and [r["method"] for r in result["rows"]] == ["eagle2"]
    assert "eagle2" in capsys.readouterr().out


def test_the_cli_names_a_method_that_does_not_train(capsys):
    assert main(["profile", "--train", "pld,nosuch"]) == 2
    err = capsys.readouterr().err
    assert "'pld', 'nosuch' are not trained drafters" in err and "eagle2" in err  # it lists what can be profiled
    assert main(["profile", "--train", " , "]) == 2  # no method at all: an error, not the verify-cost profile
    assert "is not a trained drafter" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on a lent one)")
def test_the_profile_times_steps_on_a_real_gpu(data):
    """On CUDA the phases are read from events once a step; every phase lands and the rows add up."""
    from conftest import make_llama
    from specviz.core.load import prepare
    from specviz.core.target import TargetModel

    gpu = TargetModel(prepare(make_llama(48, seed=5, num_layers=4).to("cuda")))
    cfg = TrainConfig(epochs=1, batch_tokens=96, lr=3e-3, draft_vocab=32, device="cuda")
    batches = training_batches(data, cfg.batch_tokens, cfg.max_length, torch.Generator().manual_seed(1))[:3]
    rows = profile_steps(gpu, training_classes(["eagle2", "eagle3"]), data, {}, cfg, batches, warmup=1)
    for row in rows:
        assert all(row.ms[p] > 0 for p in PHASES) and len(row.step_ms) == len(batches)
        assert row.ms["total"] == pytest.approx(sum(row.ms[p] for p in PHASES))


def test_an_experiments_arms_profile_as_they_train_jointly_too(tiny_target_dir, tmp_path, monkeypatch):
    """``experiment NAME --profile``: the arms a budget trains, by run label (a joint arm trains through the target's
    LoRA), on the experiment's own data (semi-joint: the code slice's answers, so the whole run's steps are known)."""
    from specviz.apps.experiments import EXPERIMENTS, Budget
    from specviz.core.load import load_target

    monkeypatch.setattr(train_profile, "cache_dir", lambda: tmp_path)
    tiny = Budget("tiny", "6", "first", 64, 1, "float32", "a test's", answer_tokens=8)
    monkeypatch.setitem(train_profile.BUDGETS, "tiny", tiny)
    target = load_target(str(tiny_target_dir), "float32", "cpu")
    exp = EXPERIMENTS["semi-joint"]
    classes = train_profile.arm_classes(exp, tiny, target, "cpu")
    assert list(classes) == ["semi-attn", "semi-lstm", "semi-attn-joint0.25", "semi-lstm-joint0.25"]
    assert classes["semi-attn-joint0.25"].joint.lam == 0.25 and getattr(classes["semi-attn"], "joint", None) is None
    chosen = {k: classes[k] for k in ("semi-attn", "semi-attn-joint0.25")}
    result = train_profile.profile_training(target, chosen, steps=1, warmup=0, budget="tiny", exp=exp)
    assert "code slice" in result.data and result.run_steps  # the slice's own sequences: a whole run is known
    separate, joint = result.rows
    assert (separate.method, joint.method) == ("semi-attn", "semi-attn-joint0.25")
    assert joint.ms["forward"] > separate.ms["forward"]  # the joint step runs the target's body, the other reads


def test_the_time_left_counts_each_arms_own_steps():
    from specviz.apps.experiment_status import ArmStatus, time_left
    from specviz.apps.train_profile_results import StepProfile, TrainProfile

    def row(name, ms):
        return StepProfile(name, {"taps": 0, "forward": ms / 2, "backward": ms / 2, "optimizer": 0, "total": ms},
                           [ms], 100, 120)

    profile = TrainProfile("t", "cpu", "bf16", 2, "m", "d", "data", 5, 4096, 1, 1, 1000,
                           [row("b", 3600), row("c", 1800), row("d", 7200)])
    statuses = [ArmStatus("a", "shipped", None), ArmStatus("b", "finished", None, 1000, 1000),
                ArmStatus("c", "stopped", None, 400, 1000), ArmStatus("d", "not started", None)]
    lines = time_left(statuses, profile)
    assert "0 of 1,000 steps left:  0.00 h" in lines[0]
    assert "600 of 1,000 steps left:  0.30 h" in lines[1]  # 600 steps of 1.8 s
    assert "1,000 of 1,000 steps left:  2.00 h" in lines[2]  # a fresh run: the profile's whole run
    assert "in all" in lines[3] and " 2.30 h," in lines[3]
    unknown = time_left(statuses, TrainProfile(**{**profile.to_dict(), "run_steps": None,
                                                   "rows": profile.rows}))
    assert "steps unknown" in unknown[2] and "and the unknown" in unknown[3]


def test_arms_sharing_a_prefix_count_its_steps_once(tmp_path):
    """Of arms that share an unwritten prefix (HASS's Top-K arms until the branch), the first counts the steps before
    the branch and the others only those after; a written prefix counts for none of them."""
    from specviz.apps.experiment_status import ArmStatus, time_left
    from specviz.apps.train_profile_results import StepProfile, TrainProfile

    rows = [StepProfile(n, {"taps": 0, "forward": 1800, "backward": 1800, "optimizer": 0, "total": 3600}, [3600],
                        100, 120) for n in "abcd"]
    profile = TrainProfile("t", "cpu", "bf16", 2, "m", "d", "data", 5, 4096, 1, 1, 1000, rows)
    statuses = [ArmStatus(n, "not started", None) for n in "abcd"]
    p, q = tmp_path / "p", tmp_path / "q"
    lines = time_left(statuses, profile, [(p, 800, False), (p, 800, False), (q, 800, True), None])
    assert ["1,000 of", "200 of", "200 of", "1,000 of"] == [" ".join(line.split()[1:3]) for line in lines[:4]]
    assert "from the shared prefix at step 800" in lines[1] and "prefix" not in lines[0] + lines[3]
    assert " 2.40 h," in lines[4]  # 2,400 steps of 3.6 s


def test_the_experiment_command_profiles_each_arm_and_says_what_is_left(tiny_target_dir, tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "profile.json"
    assert main(["experiment", "redrafter-rnn", "--budget", "mini", "--profile", "--steps", "1", "--target",
                 str(tiny_target_dir), "--device", "cpu", "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    arms = ["redrafter", "redrafter-no-rnn", "redrafter-4blocks"]  # nothing is shipped at the mini budget
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == arms
    left = printed.split("(each row's")[1].splitlines()[1:]  # after the table: one line an arm, then the sum
    assert [line.split()[0] for line in left] == [*arms, "in", "wrote"]
    assert all("steps unknown" in line for line in left[:3])  # a user's target: no self-distilled sequences here
