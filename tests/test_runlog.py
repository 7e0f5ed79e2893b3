"""The bench's run log end to end: a killed run resumes, parts run apart and are taken in, and the log keeps
what the figures read, as JSON lines: data, never code."""

import json
from pathlib import Path

import pytest

from app_harness import tiny_target_folder
from specviz.apps.cli import main
from specviz.core.errors import SettingsError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def _count_bench(tiny_folder: str, tmp_path: Path, prompts: int) -> tuple[Path, list[str]]:
    """A bench of ar and pld over ``prompts`` short questions, writing to the returned path (``--out`` last)."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}."]}) for i in range(prompts)))
    out = tmp_path / "r.json"
    return out, ["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar,pld",
                 "--max-new-tokens", "6", "--out", str(out)]


def _kill_bench_after(monkeypatch, runs: int) -> list:
    """Make the bench's ``run`` raise SystemExit after ``runs`` calls; returns the list that counts them."""
    import specviz.apps.bench

    real_run, calls = getattr(specviz.apps.bench.run, "real", specviz.apps.bench.run), []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) > runs:
            raise SystemExit("killed")
        return real_run(*args, **kwargs)

    counted.real = real_run
    monkeypatch.setattr(specviz.apps.bench, "run", counted)
    return calls


def test_a_killed_bench_resumes_where_it_stopped(tiny_folder, tmp_path, monkeypatch):
    """Killed at prompt 3 of 3, then --resume: only prompt 3 runs, and the results equal an unbroken run's."""
    import specviz.apps.bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}."]}) for i in range(3)))
    command = ["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar,pld",
               "--max-new-tokens", "6"]
    real_run, calls = specviz.apps.bench.run, []

    def counted(*args, **kwargs):
        calls.append(1)
        if kill_after is not None and len(calls) > kill_after:
            raise SystemExit("killed")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(specviz.apps.bench, "run", counted)
    out, log = tmp_path / "results.json", tmp_path / "results.json.runs"
    kill_after = 2 * 2 + 2  # warm-up (2 methods), then 2 prompts x 2 methods
    with pytest.raises(SystemExit):
        main([*command, "--out", str(out)])
    with log.open("ab") as f:
        f.write(b'{"prompt": {"ar": {"output": [1, 2')  # the prompt being written when the run was killed
    calls.clear()
    kill_after = None
    assert main([*command, "--out", str(out), "--resume"]) == 0
    assert len(calls) == 2 + 2  # warm-up, then prompt 3 only
    assert not log.exists()  # a complete run removes its log
    assert main([*command, "--out", str(tmp_path / "unbroken.json")]) == 0
    resumed, unbroken = json.loads(out.read_text()), json.loads((tmp_path / "unbroken.json").read_text())
    assert not resumed["interrupted"]
    keep = ("id", "prompt_tokens")
    assert ([{k: r[k] for k in keep} for r in resumed["per_prompt"]]
            == [{k: r[k] for k in keep} for r in unbroken["per_prompt"]])
    for label in ("ar", "pld"):
        for field in ("prompts", "new_tokens", "identical_to_ar", "tau", "alpha_conditional"):
            assert resumed["methods"][label][field] == unbroken["methods"][label][field], (label, field)


def test_resume_needs_the_log_of_the_same_command(tiny_folder, tmp_path, monkeypatch, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"turns": ["Count to 3."]}))
    command = ["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar,pld",
               "--out", str(tmp_path / "r.json")]
    assert main([*command, "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    import specviz.apps.bench

    monkeypatch.setattr(specviz.apps.bench, "run", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        main([*command, "--max-new-tokens", "6"])
    monkeypatch.undo()
    assert main([*command, "--max-new-tokens", "7", "--resume"]) == 2
    assert "other max new tokens" in capsys.readouterr().err


def test_a_resume_on_another_machine_is_refused_unless_tau_only(tiny_folder, tmp_path, monkeypatch, capsys):
    """Speed figures from two machines must not mix: the log names its machine; --any-machine lets a τ run go on."""
    import specviz.apps.machine

    out, command = _count_bench(tiny_folder, tmp_path, 2)
    monkeypatch.setattr(specviz.apps.machine, "machine_fingerprint", lambda: "CPU A (AVX2), 2 cores")
    _kill_bench_after(monkeypatch, 2 + 2)  # warm-up (2 methods), then prompt 1
    with pytest.raises(SystemExit):
        main(command)
    _kill_bench_after(monkeypatch, 10**6)
    monkeypatch.setattr(specviz.apps.machine, "machine_fingerprint", lambda: "CPU B (AVX512), 2 cores")
    assert main([*command, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "ran on CPU A (AVX2), 2 cores; packed linear weights, not on this machine (CPU B (AVX512), 2 cores" in err
    assert (tmp_path / "r.json.runs").exists()  # kept, not lost
    monkeypatch.setattr(specviz.apps.machine, "machine_fingerprint", lambda: "CPU A (AVX2), 2 cores")
    assert main([*command, "--resume", "--no-pack"]) == 2  # other kernels: other speeds, as on another machine
    assert "not on this machine (CPU A (AVX2), 2 cores)" in capsys.readouterr().err
    assert main([*command, "--resume", "--any-machine"]) == 0
    resumed = json.loads(out.read_text())
    assert not resumed["interrupted"] and resumed["methods"]["ar"]["prompts"] == 2


def test_a_resume_runs_at_the_budgets_its_log_recorded(tiny_folder, tmp_path, monkeypatch):
    """The tuner would choose otherwise now (a cache lost, say): the resumed prompts still run pld as the first did."""
    import specviz.apps.bench
    import specviz.apps.tuning

    out, command = _count_bench(tiny_folder, tmp_path, 2)
    real_run, real_resolve, ran = specviz.apps.bench.run, specviz.apps.tuning.resolve, []

    def killed_at_prompt_2(target, drafter, *args, **kwargs):
        ran.append(drafter)
        if len(ran) > 2 + 2:  # warm-up (2 methods), then prompt 1
            raise SystemExit("killed")
        return real_run(target, drafter, *args, **kwargs)

    monkeypatch.setattr(specviz.apps.bench, "run", killed_at_prompt_2)
    with pytest.raises(SystemExit):
        main(command)
    first = json.loads(out.read_text())["methods"]["pld"]["budget"]
    assert first["tuned"] and first["settings"]["num_tokens"] != 9
    monkeypatch.setattr(specviz.apps.tuning, "resolve", lambda target, name, settings: (
        ({"num_tokens": 9}, None) if name == "pld" else real_resolve(target, name, settings)))
    monkeypatch.setattr(specviz.apps.bench, "run", real_run)
    assert main([*command, "--resume"]) == 0
    resumed = json.loads(out.read_text())
    assert not resumed["interrupted"] and resumed["methods"]["pld"]["budget"] == first

    ran.clear()  # a log from before the budgets' records were kept holds each budget's settings alone
    monkeypatch.setattr(specviz.apps.bench, "run", killed_at_prompt_2)
    old = tmp_path / "old.json"
    with pytest.raises(SystemExit):
        main([*command[:-1], str(old)])
    log = old.with_name(old.name + ".runs")
    first_line, prompt_1 = log.read_bytes().split(b"\n", 1)
    settings = json.loads(first_line)
    settings["settings"]["budgets"] = {"ar": {}, "pld": {"num_tokens": 3}}
    log.write_bytes(json.dumps(settings).encode() + b"\n" + prompt_1)
    ran.clear()
    monkeypatch.setattr(specviz.apps.bench, "run", lambda target, drafter, *a, **k: (
        ran.append(drafter), real_run(target, drafter, *a, **k))[1])
    assert main([*command[:-1], str(old), "--resume"]) == 0
    assert {d.settings.num_tokens for d in ran if type(d).__name__ == "PromptLookupDrafter"} == {3}
    assert json.loads(old.read_text())["methods"]["pld"]["budget"] == {"settings": {"num_tokens": 3}}


def test_a_bench_in_parts_equals_one_run(tiny_folder, tmp_path, monkeypatch, capsys):
    """A run killed after prompt 1, its other 4 prompts as --part 1/2 and 2/2 (the second killed and resumed),
    then the full command with --resume: it takes both parts in, runs nothing more, and equals an unbroken run."""
    out, command = _count_bench(tiny_folder, tmp_path, 5)
    _kill_bench_after(monkeypatch, 2 + 2)  # warm-up, then prompt 1
    with pytest.raises(SystemExit):
        main(command)
    _kill_bench_after(monkeypatch, 10**6)
    assert main([*command, "--part", "1/2"]) == 0
    _kill_bench_after(monkeypatch, 2 + 2)  # part 2 of 2 (prompts 4-5), killed after prompt 4
    with pytest.raises(SystemExit):
        main([*command, "--part", "2/2"])
    part2 = tmp_path / "r.json.part2-of-2.runs"
    assert json.loads((tmp_path / "r.json.part2-of-2").read_text())["per_prompt"][0]["id"] == "3"
    calls = _kill_bench_after(monkeypatch, 10**6)
    assert main([*command, "--part", "2/2", "--resume"]) == 0
    assert len(calls) == 2 + 2  # warm-up, then prompt 5 only
    assert main([*command, "--part", "3/2"]) == 2 and "--part takes K/N" in capsys.readouterr().err

    calls = _kill_bench_after(monkeypatch, 10**6)
    assert main([*command, "--resume"]) == 0
    assert not calls  # every prompt came from the log and its parts: not even a warm-up runs
    assert "took in r.json.part1-of-2.runs" in capsys.readouterr().out
    assert not part2.exists() and not (tmp_path / "r.json.runs").exists() and not list(tmp_path.glob("*part*"))
    assert main([*command[:-1], str(tmp_path / "unbroken.json")]) == 0
    parted, unbroken = json.loads(out.read_text()), json.loads((tmp_path / "unbroken.json").read_text())
    assert not parted["interrupted"] and [r["id"] for r in parted["per_prompt"]] == ["0", "1", "2", "3", "4"]
    for label in ("ar", "pld"):
        for field in ("prompts", "new_tokens", "identical_to_ar", "tau", "alpha_conditional", "budget"):
            assert parted["methods"][label][field] == unbroken["methods"][label][field], (label, field)


def test_a_part_of_other_settings_is_refused(tiny_folder, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}."]}) for i in range(2)))
    command = ["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar",
               "--out", str(tmp_path / "r.json")]
    assert main([*command, "--max-new-tokens", "5", "--part", "1/1"]) == 0
    assert main([*command, "--max-new-tokens", "6", "--resume"]) == 2
    assert "other max new tokens" in capsys.readouterr().err
    assert (tmp_path / "r.json.part1-of-1.runs").exists()  # kept, not lost
    assert main([*command, "--max-new-tokens", "5", "--resume"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["methods"]["ar"]["prompts"] == 2


def test_run_log_keeps_finished_prompts_and_drops_a_torn_one(tmp_path):
    from specviz.apps.bench import PromptRun
    from specviz.apps.runlog import RunLog

    path = tmp_path / "results.json.runs"
    log = RunLog(path, {"methods": ["ar"], "max new tokens": 8})
    log.start()
    log.append({"ar": PromptRun([1, 2], 0.5)})
    log.append({"ar": PromptRun([3], 0.25)})
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(b'{"prompt": {"ar": {"outp')  # a prompt cut short by a kill
    runs = RunLog(path, {"methods": ["ar"], "max new tokens": 8}).resume()
    assert [r.output for r in runs["ar"]] == [[1, 2], [3]] and path.stat().st_size == size
    with pytest.raises(SettingsError, match="other max new tokens"):
        RunLog(path, {"methods": ["ar"], "max new tokens": 16}).resume()


def test_parts_started_together_share_the_first_log_written_whole(tmp_path, monkeypatch):
    """Two `bench --part` processes start at once: the log appears whole under its name (a part that finds it
    never reads it half-written, as one did on 2026-11-26), and the second keeps the first's settings."""
    import os

    from specviz.apps.runlog import RunLog

    path = tmp_path / "r.json.runs"
    seen = []
    real_link = os.link

    def link(src, dst):  # what a racing process would find at this instant
        seen.append(Path(dst).exists())
        assert json.loads(Path(src).read_bytes())["settings"]["methods"] == ["ar"]  # whole before it is named
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    RunLog(path, {"methods": ["ar"], "budgets": {"a": 1}}).start(exclusive=True)
    RunLog(path, {"methods": ["ar"], "budgets": {"a": 2}}).start(exclusive=True)
    assert seen == [False, True] and list(tmp_path.iterdir()) == [path]
    assert json.loads(path.read_bytes())["settings"]["budgets"] == {"a": 1}


def test_the_run_log_keeps_what_the_figures_read_and_drops_the_rest(tmp_path, tiny_target):
    import torch

    from drafters import build_drafter
    from specviz.apps.bench import PromptRun
    from specviz.apps.runlog import RunLog
    from specviz.core.engine import run
    from specviz.core.metrics import compare

    target = tiny_target(vocab_size=32, seed=0)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5]]
    runs = {name: [PromptRun(r.output_ids, 0.1, r.records) for r in
                   (run(target, build_drafter(name, target), p, 12, stop_on_eos=False) for p in prompts)]
            for name in ("ar", "lookahead")}
    for r in runs["lookahead"][0].records[1:]:  # the extras a tree can carry: logprobs, distributions, beams
        n = len(r.tree)
        r.tree.logprobs, r.tree.child_dists = torch.zeros(n), torch.full((n + 1, 32), 1 / 32)
        r.tree.info.update(beams=torch.zeros(4, 3, dtype=torch.long), compression=1.5)
    log = RunLog(tmp_path / "r.runs", {"methods": ["ar", "lookahead"]})
    log.start()
    for i in range(len(prompts)):
        log.append({name: runs[name][i] for name in runs})
    back = RunLog(tmp_path / "r.runs", {"methods": ["ar", "lookahead"]}).resume()
    steps = [r for prompt in back["lookahead"] for r in prompt.records[1:]]
    assert all(r.tree.logprobs is None and r.tree.child_dists is None and r.node_target_p.numel() == 0 for r in steps)
    assert any(r.tree.info == {"compression": 1.5} for r in steps) and any(len(r.tree) > 1 for r in steps)
    assert compare(back["lookahead"], back["ar"], ["a", "b"]) == compare(runs["lookahead"], runs["ar"], ["a", "b"])


def test_the_log_is_json_lines_and_anything_else_is_refused(tmp_path):
    """Settings first, then one JSON object per finished prompt: a reader needs json alone."""
    from specviz.apps.bench import PromptRun
    from specviz.apps.runlog import RunLog

    path = tmp_path / "r.json.runs"
    log = RunLog(path, {"methods": ["ar"], "budgets": {"ar": {"settings": {}}}})
    log.start()
    log.sync({"ar": [PromptRun([4, 5], 0.5), PromptRun([6], 0.25)]})
    log.sync({"ar": [PromptRun([4, 5], 0.5), PromptRun([6], 0.25)]})  # nothing new: nothing appended
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"settings": {"methods": ["ar"], "budgets": {"ar": {"settings": {}}}}}
    assert [line["prompt"]["ar"]["output"] for line in lines[1:]] == [[4, 5], [6]]
    assert RunLog(path, log.settings).budgets()["ar"].settings == {}
    path.write_bytes(b"\x80\x05\x95 binary")  # the format logs had before: refused with a message
    with pytest.raises(SettingsError, match="is not a bench run log"):
        RunLog(path, {}).resume()
