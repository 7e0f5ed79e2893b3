"""The CLI end to end on a tiny model saved as a folder (the `--target FOLDER` path real users take)."""

import json
import lzma
import re
from pathlib import Path

import pytest
import transformers

from conftest import make_llama
from drafters import checkpoint
from specviz.apps.cli import main
from specviz.core.errors import SettingsError
from specviz.core.load import embedded_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with the embedded target's tokenizer (and so its chat template)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_folder())
    folder = tmp_path_factory.mktemp("tiny-target")
    model = make_llama(vocab_size=len(tokenizer), num_layers=3, max_positions=512, eos=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_generate_prints_text_and_metrics(tiny_folder, capsys):
    code = main(["generate", "--target", tiny_folder, "--method", "skip:layers=2:num_tokens=2",
                 "--prompt", "Say hello twice.", "--max-new-tokens", "12", "--color", "always"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tau (tokens per target forward, bonus included)" in out and "\033[" in out
    assert "alpha depth 1: conditional" in out


def test_bench_writes_the_documented_fields(tiny_folder, tmp_path):
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"Repeat after me: {c} {c} {c}."]}
            for i, c in enumerate(["a", "b"])]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "results.json"
    code = main(["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar,pld,hf",
                 "--max-new-tokens", "10", "--out", str(out), "--dtype", "float32"])
    assert code == 0
    result = json.loads(out.read_text())
    for name in ("ar", "pld"):
        m = result["methods"][name]
        for key in ("tau", "tokens_per_s", "speedup", "alpha_conditional", "alpha_unconditional", "identical_to_ar",
                    "prompts"):
            assert key in m
        assert set(m["latency_ms"]) == {"draft", "verify", "accept", "other"}
        assert m["identical_to_ar"] == m["prompts"] == 2
        assert m["exactness"] == {"identical": 2, "near-tie": 0, "clear": 0}
    assert result["methods"]["hf"]["identical_to_ar"] == 2  # our AR equals transformers' generate
    budget = result["methods"]["pld"]["budget"]  # tuned: its expected split per token, next to the measured one
    assert budget["tuned"] and set(budget["expected_ms_per_token"]) == {"draft", "verify", "accept+other"}
    assert sum(budget["expected_ms_per_token"].values()) > 0
    assert result["methods"]["ar"]["tau"] == 1.0 and len(result["per_prompt"]) == 2


def test_bench_saves_each_finished_prompt_before_the_run_ends(tiny_folder, tmp_path, monkeypatch):
    """A run killed at prompt 3 of 3 leaves a results file holding prompts 1 and 2."""
    import specviz.apps.bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}."]}) for i in range(3)))
    out = tmp_path / "results.json"
    real_run, calls = specviz.apps.bench.run, []

    def dies_on_the_third_prompt(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2 * 2 + 2:  # warm-up (2 methods), then 2 prompts x 2 methods
            raise SystemExit("killed")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(specviz.apps.bench, "run", dies_on_the_third_prompt)
    with pytest.raises(SystemExit):
        main(["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "ar,pld",
              "--max-new-tokens", "6", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["interrupted"] and len(saved["per_prompt"]) == 2
    assert saved["methods"]["pld"]["prompts"] == 2 and saved["questions"] == str(questions)


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
        f.write(b"\x80\x05\x95half a prompt")  # the prompt being written when the run was killed
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
    import specviz.apps.bench

    out, command = _count_bench(tiny_folder, tmp_path, 2)
    monkeypatch.setattr(specviz.apps.bench, "machine_fingerprint", lambda: "CPU A (AVX2), 2 cores")
    _kill_bench_after(monkeypatch, 2 + 2)  # warm-up (2 methods), then prompt 1
    with pytest.raises(SystemExit):
        main(command)
    _kill_bench_after(monkeypatch, 10**6)
    monkeypatch.setattr(specviz.apps.bench, "machine_fingerprint", lambda: "CPU B (AVX512), 2 cores")
    assert main([*command, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "ran on CPU A (AVX2), 2 cores; packed linear weights, not on this machine (CPU B (AVX512), 2 cores" in err
    assert (tmp_path / "r.json.runs").exists()  # kept, not lost
    monkeypatch.setattr(specviz.apps.bench, "machine_fingerprint", lambda: "CPU A (AVX2), 2 cores")
    assert main([*command, "--resume", "--no-pack"]) == 2  # other kernels: other speeds, as on another machine
    assert "not on this machine (CPU A (AVX2), 2 cores)" in capsys.readouterr().err
    assert main([*command, "--resume", "--any-machine"]) == 0
    resumed = json.loads(out.read_text())
    assert not resumed["interrupted"] and resumed["methods"]["ar"]["prompts"] == 2


def test_a_resume_runs_at_the_budgets_its_log_recorded(tiny_folder, tmp_path, monkeypatch):
    """The tuner would choose otherwise now (a cache lost, say): the resumed prompts still run pld as the first did."""
    import pickle

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
    with log.open("rb") as f:
        settings, prompt_1 = pickle.load(f), f.read()
    settings["budgets"] = {"ar": {}, "pld": {"num_tokens": 3}}
    log.write_bytes(pickle.dumps(settings) + prompt_1)
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


def test_train_then_generate_with_the_checkpoint(tiny_folder, tmp_path, monkeypatch, capsys):
    """The shared pipeline end to end on real ShareGPT prompts: self-distil, features, train, save, use."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "eagle2"
    code = main(["train", "--drafter", "eagle2", "--target", tiny_folder, "--samples", "6", "--epochs", "1",
                 "--answer-tokens", "8", "--draft-vocab", "512", "--device", "cpu", "--out", str(ckpt)])
    assert code == 0, capsys.readouterr().err
    card = json.loads((ckpt / "card.json").read_text())
    assert card["method"] == "eagle2" and card["data"]["train_samples"] == 6 and card["data"]["self_distilled"]
    assert card["training"]["steps"] >= 1 and card["draft_vocab"]["size"] == 512
    assert list((tmp_path / "cache" / "train").glob("train-*.safetensors"))  # features cached for the next method
    code = main(["generate", "--target", tiny_folder, "--method", f"eagle2:checkpoint={ckpt}:depth=3",
                 "--prompt", "Say hello.", "--max-new-tokens", "8", "--color", "never"])
    assert code == 0 and "tau" in capsys.readouterr().out
    # `validate` measures a saved checkpoint on the recipe's held-out split as training did
    data = ["--target", tiny_folder, "--samples", "6", "--answer-tokens", "8", "--device", "cpu"]
    out = tmp_path / "val.json"
    assert main(["validate", "--drafter", "eagle2", *data, "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert measured["prompts"] == card["data"]["val_samples"]
    final = card["history"][-1]["val"]
    assert measured["validation"]["eagle2"] == pytest.approx(final, abs=2e-3)
    assert main(["validate", "--drafter", "hass", *data, "--checkpoint", str(ckpt)]) == 2
    assert "not 'hass'" in capsys.readouterr().err


def test_eagle3_alone_trains_without_a_feature_cache(tiny_folder, tmp_path, monkeypatch, capsys):
    """EAGLE-3 runs the target's body in training anyway: trained alone, it extracts and caches no features."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    code = main(["train", "--drafter", "eagle3", "--target", tiny_folder, "--samples", "4", "--epochs", "1",
                 "--answer-tokens", "8", "--draft-vocab", "512", "--device", "cpu", "--out", str(tmp_path / "e3")])
    assert code == 0, capsys.readouterr().err
    card = json.loads((tmp_path / "e3" / "card.json").read_text())
    assert card["data"]["features_on_the_fly"] and card["training"]["steps"] >= 1
    assert set(card["history"][-1]["val"]) >= {"acc1", "acc2"}
    assert not list((tmp_path / "cache" / "train").glob("train-*.safetensors"))


def test_train_several_at_one_budget_and_resume_skips_the_finished(tiny_folder, tmp_path, monkeypatch, capsys):
    """`--drafter a,b --resume` starts runs with no saved state; run again, it reuses the finished ones."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    command = ["train", "--drafter", "eagle2,semi-attn", "--target", tiny_folder, "--samples", "4", "--epochs", "1",
               "--answer-tokens", "6", "--draft-vocab", "256", "--device", "cpu", "--feature-dtype", "bfloat16"]
    assert main([*command, "--resume"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.count("no saved state") == 2 and out.count("wrote ") == 2
    runs = sorted((tmp_path / "cache" / "train" / "runs").iterdir())
    cards = [json.loads((r / "checkpoint" / "card.json").read_text()) for r in runs]
    assert sorted(c["method"] for c in cards) == ["eagle2", "semi-attn"]
    assert all(c["data"]["feature_dtype"] == "bfloat16" for c in cards)
    assert cards[0]["data"] == cards[1]["data"]  # the same sequences and features for both
    assert main([*command, "--resume"]) == 0
    again = capsys.readouterr().out
    assert again.count("finished before") == 2 and "wrote " not in again
    monkeypatch.setattr(checkpoint, "ASSETS", tmp_path / "assets")  # --ship: the finished runs, compressed
    assert main([*command, "--resume", "--ship"]) == 0
    assert capsys.readouterr().out.count("shipped ") == 2
    shipped = tmp_path / "assets" / "semi-attn"
    assert sorted(f.name for f in shipped.iterdir()) == ["card.json", "weights.safetensors.xz"]
    assert main(["generate", "--target", tiny_folder, "--method", f"semi-attn:checkpoint={shipped}",
                 "--prompt", "Say hello.", "--max-new-tokens", "6", "--color", "never"]) == 0
    assert "tau" in capsys.readouterr().out
    assert main([*command, "--out", str(tmp_path / "x")]) == 2
    assert "--out names one checkpoint folder" in capsys.readouterr().err


def test_train_rejects_untrained_methods_and_missing_checkpoints(tiny_folder, tmp_path, capsys):
    assert main(["train", "--drafter", "pld", "--target", tiny_folder]) == 2
    assert "not a trained drafter" in capsys.readouterr().err
    assert main(["generate", "--target", tiny_folder, "--method", f"hass:checkpoint={tmp_path / 'nothing'}",
                 "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert "no hass checkpoint" in capsys.readouterr().err


def test_profile_curve(tiny_folder, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--target", tiny_folder, "--context", "16", "--max-size", "8", "--repeats", "1",
                 "--out", str(out)]) == 0
    curve = json.loads(out.read_text())["curve"]
    assert [r["tokens"] for r in curve] == [1, 2, 4, 8] and all(r["ms"] > 0 for r in curve)
    assert main(["profile", "--target", tiny_folder, "--context", "16", "--max-size", "4", "--repeats", "1",
                 "--tree", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["shape"] == "tree"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["generate", "--prompt", "hi", "--method", "nope"], "unknown method"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "--prompt", "hi", "--method", "pld:num_tokens=0"], "num_tokens"),
        (["bench", "--questions", "/no/such/file.jsonl"], "no question file"),
        (["generate", "--prompt", "caf\udce9"], "not valid UTF-8"),  # a Latin-1 byte in a shell argument
        (["generate", "--prompt", "hi", "--temperature", "1e-42"], "temperature must be 0 (greedy) or in"),
        (["generate", "--prompt", "hi", "--temperature", "0.7", "--rule", "greedy"], "would ignore temperature"),
        (["generate", "--prompt", "hi", "--method", "pld:preset=fastest"], "preset must be one of"),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(tiny_folder, argv, message, capsys):
    assert main([*argv, "--target", tiny_folder]) == 2
    assert message in capsys.readouterr().err


def test_unloadable_target_is_a_message(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--prompt", "hi", "--target", "/no/such/model"]) == 2
    assert "could not load model" in capsys.readouterr().err


def test_report_renders_a_bench_file(tiny_folder, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Count: one two one two"]}))
    out = tmp_path / "results.json.xz"  # compressed by its name
    assert main(["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", "pld,lookahead",
                 "--max-new-tokens", "6", "--out", str(out)]) == 0
    assert json.loads(lzma.decompress(out.read_bytes()))["methods"]["pld"]["prompts"] == 1
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| `ar` | 1.00 |" in table and "| `pld` |" in table and "1 prompts" in table
    assert "expected against measured:" in table  # the tuned budget's figures next to the measured ones
    assert re.search(r"\| `pld` \| num_tokens \d+ \| [\d.]+ / [\d.]+ \| [\d.]+× / [\d.]+× \| [\d.]+ · ", table)
    assert re.search(r"orderings, at equal budgets:\n\n.*\n.*\n\| Lookahead \(2024\): `lookahead` over `pld` ", table)
    out.write_bytes(out.read_bytes()[:40])
    assert main(["report", str(out)]) == 2
    assert "is not a bench results file" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "none.json")]) == 2
    assert "no results file" in capsys.readouterr().err


def test_report_merges_runs_of_the_same_prompts_and_refuses_others(tiny_folder, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Count: one two one two"]}))
    files = {}
    for name, methods, tokens in (("a", "pld", 6), ("b", "lookahead", 6), ("c", "pld", 5)):
        files[name] = tmp_path / f"{name}.json"
        assert main(["bench", "--target", tiny_folder, "--questions", str(questions), "--methods", methods,
                     "--max-new-tokens", str(tokens), "--out", str(files[name])]) == 0
    capsys.readouterr()
    assert main(["report", str(files["a"]), str(files["b"])]) == 0
    table = capsys.readouterr().out
    assert table.startswith("merged from ") and table.count("| `ar` |") == 1  # the first run's AR only
    assert "| `pld` |" in table and "| `lookahead` |" in table
    row = re.search(r"\| Lookahead \(2024\): `lookahead` over `pld` .*", table).group(0)
    assert row.split(" | ")[6] == "–"  # two runs' speeds are not compared
    assert main(["report", str(files["a"]), str(files["c"])]) == 2
    assert "another max_new_tokens (5) than" in capsys.readouterr().err


def test_cards_name_results_files_without_machine_paths(tmp_path):
    from drafters.checkpoint import REPO, read_card
    from specviz.apps.bench import record_benchmark

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "card.json").write_text(json.dumps({"method": "eagle2", "target": {}}))
    label = f"eagle2:checkpoint={folder}"
    results = {"methods": {label: {"tau": 1.5, "prompts": 2}}, "questions": "mt-bench", "max_new_tokens": 8,
               "dtype": "float32", "machine": "cpu", "date": "2026-11-23"}
    for source, named in [(REPO / "assets" / "bench" / "run.json", "assets/bench/run.json"),
                          (tmp_path / "cache" / "run.json", "run.json")]:
        assert record_benchmark(results, str(source)) == [folder]
        entry = read_card(folder)["mtbench"][label]
        assert entry["results_file"] == named and entry["tau"] == 1.5
    record_benchmark({**results, "questions": "humaneval", "methods": {label: {"tau": 2.5, "prompts": 2}}}, "h.json")
    card = read_card(folder)  # another question set gets its own entry and leaves MT-bench's alone
    assert card["humaneval"][label]["tau"] == 2.5 and card["mtbench"][label]["tau"] == 1.5


def test_profile_uses_its_own_cache_and_times_each_size(tiny_target):
    from specviz.apps.profile import profile

    target = tiny_target(vocab_size=32, seed=0)
    result = profile(target, context=8, sizes=(1, 2, 4), repeats=2)
    assert [r["tokens"] for r in result["curve"]] == [1, 2, 4] and result["curve"][0]["relative_to_1"] == 1.0
    assert result["context"] == 8 and result["dtype"] == "float32"
    with pytest.raises(SettingsError, match="context must be in"):
        profile(target, context=0)
    calls, verify = [], target.verify  # the sizes take turns, in a rotated order, round after round
    target.padding = {"chain": {1: 4, 2: 4}}  # the profile times each size as it is, never padded
    target.verify = lambda root, tree, cache, pad: calls.append((len(tree) + 1, pad)) or verify(root, tree, cache, pad)
    profile(target, context=8, sizes=(1, 2, 4), repeats=2)
    assert calls == [(n, False) for n in (1, 2, 4, 2, 4, 1, 4, 1, 2)]


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
        f.write(b"\x80\x04torn")  # a prompt cut short by a kill
    runs = RunLog(path, {"methods": ["ar"], "max new tokens": 8}).resume()
    assert [r.output for r in runs["ar"]] == [[1, 2], [3]] and path.stat().st_size == size
    with pytest.raises(SettingsError, match="other max new tokens"):
        RunLog(path, {"methods": ["ar"], "max new tokens": 16}).resume()


def test_parts_started_together_share_the_first_log_written_whole(tmp_path, monkeypatch):
    """Two `bench --part` processes start at once: the log appears whole under its name (a part that finds it
    never reads it half-written, as one did on 2026-11-26), and the second keeps the first's settings."""
    import os
    import pickle

    from specviz.apps.runlog import RunLog

    path = tmp_path / "r.json.runs"
    seen = []
    real_link = os.link

    def link(src, dst):  # what a racing process would find at this instant
        seen.append(Path(dst).exists())
        assert pickle.loads(Path(src).read_bytes())["methods"] == ["ar"]  # whole before it is named
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    RunLog(path, {"methods": ["ar"], "budgets": {"a": 1}}).start(exclusive=True)
    RunLog(path, {"methods": ["ar"], "budgets": {"a": 2}}).start(exclusive=True)
    assert seen == [False, True] and list(tmp_path.iterdir()) == [path]
    assert pickle.loads(path.read_bytes())["budgets"] == {"a": 1}


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
