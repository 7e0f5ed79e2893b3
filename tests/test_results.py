"""Typed bench results: every committed results file loads and saves back to the same JSON, and merging,
Markdown and bad files behave as the report needs."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from specviz.apps.results import (
    BenchResult,
    MethodBudget,
    MethodRow,
    MethodSummary,
    PromptRow,
    RunSampling,
    budget_table,
    markdown_table,
    merge,
)
from specviz.core import files
from specviz.core.errors import SettingsError

BENCH = Path(__file__).resolve().parents[1] / "assets" / "bench"
BENCH_FILES = sorted(p for p in BENCH.iterdir() if p.name.endswith((".json", ".json.xz"))
                     and {"methods", "per_prompt"} <= json.loads(files.read_bytes(p)).keys())


def without_nulls(value):
    """The data with null-valued keys dropped: a missing optional key and an explicit null mean the same."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def test_every_committed_bench_file_is_found():
    assert len(BENCH_FILES) >= 25 and any(p.suffix == ".xz" for p in BENCH_FILES)


@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.name)
def test_a_committed_file_loads_and_saves_as_the_same_json(path, tmp_path):
    raw = json.loads(files.read_bytes(path))
    result = BenchResult.load(path)
    assert set(result.methods) == set(raw["methods"]) and len(result.per_prompt) == len(raw["per_prompt"])
    assert "ar" in result.methods and all(isinstance(m, MethodSummary) for m in result.methods.values())
    out = tmp_path / path.name
    result.save(out)
    assert without_nulls(json.loads(files.read_bytes(out))) == without_nulls({"interrupted": False, **raw})
    assert BenchResult.load(out) == result


def small_result(tau: float = 1.5, tokens: int = 8, ids=("1", "2")) -> BenchResult:
    budget = MethodBudget({"num_tokens": 3}, True, 1.6, 1.2, {"draft": 1.0, "verify": 8.0, "accept+other": 0.5})
    methods = {
        "ar": MethodSummary(2, 16, 2.0, 8.0, 1.0, 2, tau=1.0, latency_ms={"draft": 0.0, "verify": 100.0,
                                                                           "accept": 1.0, "other": 2.0}),
        "pld": MethodSummary(2, 16, 1.0, 16.0, 2.0, 1, exactness={"identical": 1, "near-tie": 1, "clear": 0},
                             tau=tau, latency_ms={"draft": 1.0, "verify": 40.0, "accept": 1.0, "other": 1.0},
                             alpha_conditional=[0.9, 0.5], alpha_unconditional=[0.9, 0.45], budget=budget),
    }
    rows = [PromptRow(i, "writing", 20, {"ar": MethodRow(8, 1.0, True, steps=8, accepted_per_step=[0] * 8),
                                         "pld": MethodRow(8, 0.5, True, steps=4, accepted_per_step=[1] * 4)})
            for i in ids]
    return BenchResult("embedded", "cpu", "float32", tokens, RunSampling(0.0, 1.0, "greedy", True), "2026-11-23",
                       "x86_64 CPU", methods, rows, questions="mt-bench")


def test_a_result_saves_compressed_by_its_name_and_reads_back(tmp_path):
    result = small_result()
    result.save(tmp_path / "r.json.xz")
    assert json.loads(lzma.decompress((tmp_path / "r.json.xz").read_bytes()))["methods"]["pld"]["tau"] == 1.5
    assert BenchResult.load(tmp_path / "r.json.xz") == result
    assert list(tmp_path.iterdir()) == [tmp_path / "r.json.xz"]  # no partial file left beside it


def test_a_result_says_which_kernels_engine_and_attention_ran(tmp_path):
    from specviz.core.attention import NAME

    result = small_result()
    assert result.kernels_note == ""  # an older file: default kernels, eager, SDPA
    result.linear_kernels, result.engine, result.attention = "oneDNN packed (3 layers)", "compiled", NAME
    note = result.kernels_note
    assert "oneDNN packed" in note and "compiled" in note and "grouped-query attention" in note
    result.save(tmp_path / "r.json")
    assert BenchResult.load(tmp_path / "r.json").attention == NAME


def test_bad_files_are_messages(tmp_path):
    with pytest.raises(SettingsError, match="no results file"):
        BenchResult.load(tmp_path / "none.json")
    (tmp_path / "cut.json.xz").write_bytes(lzma.compress(b"{}")[:10])
    with pytest.raises(SettingsError, match="is not a bench results file"):
        BenchResult.load(tmp_path / "cut.json.xz")
    (tmp_path / "profile.json").write_text(json.dumps({"curve": []}))
    with pytest.raises(SettingsError, match="is not a bench results file"):
        BenchResult.load(tmp_path / "profile.json")


def test_merged_runs_keep_the_first_figures_and_each_methods_run():
    first, second = small_result(), small_result(tau=2.5)
    second.methods["lookahead"] = second.methods.pop("pld")
    for row in second.per_prompt:
        row.methods["lookahead"] = row.methods.pop("pld")
    second.machine, second.date = "another CPU", "2026-11-24"
    merged = merge([first, second], ["a.json", "b.json"])
    assert list(merged.methods) == ["ar", "pld", "lookahead"]
    assert (merged.methods["ar"].run, merged.methods["pld"].run, merged.methods["lookahead"].run) == (0, 0, 1)
    assert merged.methods["lookahead"].tau == 2.5 and set(merged.per_prompt[0].methods) == set(merged.methods)
    assert merged.machine == "x86_64 CPU + another CPU" and merged.merged_from == ["a.json", "b.json"]
    assert first.methods["ar"].run is None and "lookahead" not in first.per_prompt[0].methods  # inputs untouched
    with pytest.raises(SettingsError, match="another max_new_tokens"):
        merge([first, small_result(tokens=9)], ["a", "c"])
    with pytest.raises(SettingsError, match="ran other prompts"):
        merge([first, small_result(ids=("1", "3"))], ["a", "c"])


def test_the_markdown_tables_show_the_figures():
    result = small_result()
    table = markdown_table(result).splitlines()
    assert table[0].startswith("| method | τ | α_1..4 conditional |") and len(table) == 4
    assert table[3] == ("| `pld` | 1.50 | 0.90 / 0.50 | 0.90 / 0.45 | 16.0 | 2.00× | 1/2 (+1 near-tie, 0 clear) "
                        "| 1.0 · 40.0 · 1.0 · 1.0 |")
    budgets = budget_table(result).splitlines()
    assert len(budgets) == 3
    assert budgets[2] == "| `pld` | num_tokens 3 | 1.60 / 1.50 | 1.20× / 2.00× | 1.0 · 8.0 · 0.5 / 1.0 · 40.0 · 2.0 |"
    result.methods["pld"].budget = MethodBudget({"num_tokens": 3})
    assert budget_table(result) == ""


def test_a_budget_recorded_as_its_settings_alone_reads_as_settings():
    assert MethodBudget.from_dict({"num_tokens": 3}) == MethodBudget({"num_tokens": 3})
    assert MethodBudget.from_dict({"settings": {}}).to_dict() == {"settings": {}}
