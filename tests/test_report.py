"""docs/results.md is generated from the committed results files, and stays current with them."""

from __future__ import annotations

import json
import shutil

from specviz.apps import report
from specviz.apps.cli import main
from specviz.apps.experiment_results import ArmResult, ExperimentResult, Training
from specviz.apps.train_profile_results import TrainProfile


def test_docs_results_md_is_current():
    assert report.RESULTS_DOC.read_text() == report.results_doc(), (
        f"docs/results.md is not what assets/bench holds now: run `{report.DOCS_COMMAND}` and commit the result")


def test_every_layout_gets_its_place_and_nothing_crashes(tmp_path, monkeypatch, capsys):
    bench = sorted(report.BENCH_DIR.glob("mtbench8_tuned_*.json.xz"))[0]
    shutil.copy(bench, tmp_path / "b.json.xz")
    shutil.copy(bench, tmp_path / "a.json.xz")  # a second file: sections in name order
    shutil.copy(report.BENCH_DIR / "profile_cuda_bf16_h100.json", tmp_path / "profile.json")
    shutil.copy(report.BENCH_DIR / "sweep_mtbench16_fp32_cpu.json", tmp_path / "sweep.json")
    shutil.copy(report.BENCH_DIR / "profile_train_bf16_zen4.json", tmp_path / "train.json")
    shutil.copy(report.BENCH_DIR / "app_vs_cli_avx2_fp32.json", tmp_path / "app.json")
    (tmp_path / "cut.json.xz").write_bytes(b"\xfd7zXZ\x00 cut short")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken_bench.json").write_text(json.dumps({"methods": {}, "per_prompt": [{}]}))
    (tmp_path / "notes.txt").write_text("not a results file")
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    arm = ArmResult("EAGLE-2", "eagle2:preset=paper", 0.0, 2.5, 1.1, 9.0, 2, 2, [0.8, 0.7], train="eagle2",
                    training=Training({"acc1": 0.6, "acc2": 0.4}, 1000, 12.0, 10, "x86_64 2 threads"))
    ExperimentResult("hass-beta", "HASS", "Table 5", "Does beta help?", {"name": "small", "samples": "1000",
                     "epochs": 2}, "mt-bench, 2 prompts", 64, "a CPU", "2026-11-27", [arm], True).save(
        experiments / "hass-beta-small.json")
    doc = report.results_doc(tmp_path, experiments)
    assert doc == report.results_doc(tmp_path, experiments)  # the same files, the same page
    sections = [line for line in doc.splitlines() if line.startswith("#")]
    assert sections == ["# Results", "## Benchmarks", "### `a.json.xz`", "### `b.json.xz`", "## Verify-cost curves",
                        "## Training steps", "### `train.json`",
                        "## Temperature sweeps", "### `sweep.json`", "## The app against the CLI", "### `app.json`",
                        "## The papers' experiments", "### `hass-beta-small.json`", "## Other files"]
    train = json.loads((tmp_path / "train.json").read_text())  # a method's row, as the file holds it
    hass = next(r for r in train["rows"] if r["method"] == "hass")
    hours = train["run_steps"] * hass["ms"]["total"] / 3.6e6
    assert f"| `hass` | {hass['ms']['taps']:.0f} | {hass['ms']['forward']:.0f} | " in doc
    tok_s = hass["answer_tokens"] / hass["ms"]["total"] * 1000
    assert f"| {hass['ms']['total']:.0f} | {tok_s:,.0f} | {hours:.2f} h |" in doc
    assert "| EAGLE-2 | 0.600 | 0.400 | 2.50 | 1.10× | – | 0.80 0.70 | 2/2 |" in doc
    app = json.loads((tmp_path / "app.json").read_text())  # its row and range, as the file holds them
    row, (low, high) = app["summary"]["ar browser"], app["first_token_on_screen_s"]
    assert f"| ar | browser | {row['tok_s']:.1f} | {row['x_cli']:.2f} |" in doc
    assert f"first token on screen: {low:.2f}–{high:.2f} s" in doc
    assert "| `profile.json` | NVIDIA H100 80GB HBM3 | bfloat16 | chain | 256 | 2026-11-26 | 1: " in doc
    assert doc.count("| `ar` | 1.00 |") == 2 and "| `hf` | – | – | – |" in doc
    assert "- `broken_bench.json`\n- `cut.json.xz`\n- `list.json`" in doc and "notes.txt" not in doc
    monkeypatch.setattr(report, "RESULTS_DOC", tmp_path / "docs" / "results.md")
    monkeypatch.setattr(report, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(report, "EXPERIMENTS_DIR", experiments)
    assert main(["report", "--docs"]) == 0
    assert (tmp_path / "docs" / "results.md").read_text() == doc
    assert "wrote " in capsys.readouterr().out


def test_a_training_profile_reads_back_as_written_and_is_told_from_a_sweep():
    written = json.loads((report.BENCH_DIR / "profile_train_bf16_zen4.json").read_text())
    profile = TrainProfile.from_dict(written)
    assert profile.to_dict() == written and TrainProfile.is_one(written)
    assert not TrainProfile.is_one(json.loads((report.BENCH_DIR / "sweep_mtbench16_fp32_cpu.json").read_text()))
    text = profile.text()  # the terminal's table: one line a method, the projection in hours
    for row in profile.rows:
        assert f"{row.ms['total']:9.1f}" in text and f"{profile.run_steps * row.ms['total'] / 3.6e6:8.2f} h" in text
