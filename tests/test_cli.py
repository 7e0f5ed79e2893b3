"""The CLI end to end on a tiny model saved as a folder (the `--target FOLDER` path real users take)."""

import json
import lzma
import re

import pytest
import torch
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
    from drafters import METHODS
    from specviz.apps.training import drafters_to_train

    assert drafters_to_train("all") == [n for n, (c, _) in METHODS.items() if c.trained]
    assert drafters_to_train(" eagle2, hass ") == ["eagle2", "hass"]
    everything = drafters_to_train("all")
    assert drafters_to_train("hass-passes5,all,eagle2") == ["hass-passes5", *everything]  # once each, in order
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
                 "--tree", "--ops", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == "tree" and [r["tokens"] for r in result["ops"]] == [1, 2, 4]
    assert "where one forward's time goes" in capsys.readouterr().out


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


def test_the_stream_colours_accepted_drafts_green_and_target_tokens_yellow():
    import io
    from types import SimpleNamespace

    from specviz.apps.generate import GREEN, RESET, YELLOW, stream_coloured
    from specviz.core.engine import StepRecord
    from specviz.core.tree import DraftTree

    target = SimpleNamespace(decode=lambda ids: "".join(f"<{t}>" for t in ids))  # one visible piece per token
    step = StepRecord(step=1, tree=DraftTree.chain([7, 8]), path=[0, 1], tokens=[7, 8, 9], bonus=9,
                      node_target_p=torch.zeros(2), bonus_target_p=1.0)
    out = io.StringIO()
    assert stream_coloured(target, [step], True, out) == [step]
    assert out.getvalue() == f"{GREEN}<7>{RESET}{GREEN}<8>{RESET}{YELLOW}<9>{RESET}\n"
    plain = io.StringIO()
    stream_coloured(target, [step], False, plain)
    assert plain.getvalue() == "<7><8><9>\n"


def test_report_needs_files_or_docs(capsys):
    assert main(["report"]) == 2
    assert "report takes one or more results files, or --docs" in capsys.readouterr().err


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
    from specviz.apps.cards import record_benchmark
    from specviz.apps.results import BenchResult, MethodSummary, RunSampling

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "card.json").write_text(json.dumps({"method": "eagle2", "target": {}}))
    label = f"eagle2:checkpoint={folder}"

    def summary(tau: float) -> MethodSummary:
        return MethodSummary(prompts=2, new_tokens=16, wall_s=1.0, tokens_per_s=16.0, speedup=1.2, identical_to_ar=2,
                             tau=tau)

    results = BenchResult("embedded", "cpu", "float32", 8, RunSampling(0.0, 1.0, "greedy"), "2026-11-23", "cpu",
                          {label: summary(1.5)}, [], questions="mt-bench")
    for source, named in [(REPO / "assets" / "bench" / "run.json", "assets/bench/run.json"),
                          (tmp_path / "cache" / "run.json", "run.json")]:
        assert record_benchmark(results, str(source)) == [folder]
        entry = read_card(folder)["mtbench"][label]
        assert entry["results_file"] == named and entry["tau"] == 1.5
    results.questions, results.methods = "humaneval", {label: summary(2.5)}
    record_benchmark(results, "h.json")
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
    target.verify = lambda root, tree, cache, padding=None: calls.append((len(tree) + 1, padding)) or verify(
        root, tree, cache, padding)
    profile(target, context=8, sizes=(1, 2, 4), repeats=2)
    assert calls == [(n, None) for n in (1, 2, 4, 2, 4, 1, 4, 1, 2)]  # the profile times each size as it is


def test_method_specs_name_drafters_and_transformers_baselines():
    from specviz.apps.methods import is_baseline, parse_method

    assert parse_method(" eagle2:depth=4 ") == ("eagle2", {"depth": 4})
    assert parse_method("hf-pld") == ("hf-pld", {}) and is_baseline("hf-pld") and not is_baseline("pld")
    with pytest.raises(SettingsError, match="unknown method"):
        parse_method("nope")
