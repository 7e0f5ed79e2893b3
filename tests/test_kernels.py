"""The measured kernel rule: which row counts of a packed layer run on the default kernels, cached per machine,
and lossless either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import train_tiny_drafter
from drafters import build_drafter
from drafters.ar import AutoregressiveDrafter
from specviz.core import kernels, rows
from specviz.core.cpu import cpu_flags, cpuinfo
from specviz.core.engine import run
from specviz.core.kernels import KernelChoice, choose, crossover, measure
from specviz.core.load import prepare
from specviz.core.packing import pack, pack_linears, packed_weight, plain_rows_of, set_plain_rows
from specviz.core.target import TargetModel

pytestmark = pytest.mark.skipif(pack(torch.ones(2, 2)) is None, reason="this torch build cannot pack for oneDNN")
VOCAB = 32
PROMPTS = [[3, 7, 1, 9, 3, 7, 1], [5, 5, 2, 8, 11, 2, 8], [30, 1, 4, 1, 5, 9, 2, 6]]


def test_the_cpu_facts_come_from_proc_cpuinfo():
    assert cpu_flags() == set(cpuinfo("flags").split())
    assert cpuinfo("no such field") == ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""  # then every field reads as ""
    assert cpuinfo("model name") in text and bool(cpuinfo("model name")) == ("model name" in text)


def test_crossover_is_the_longest_prefix_the_default_kernels_win_by_the_margin():
    sizes = (1, 2, 3, 4, 8)
    assert crossover(sizes, (7, 7, 8, 12, 14), (10, 10, 10, 10, 10)) == 3
    assert crossover(sizes, (12, 7, 7, 7, 7), (10, 10, 10, 10, 10)) == 0  # lost at one row: packed throughout
    assert crossover(sizes, (7, 12, 7, 7, 7), (10, 10, 10, 10, 10)) == 1  # a later win does not skip a loss
    assert crossover(sizes, (9.8, 9.8, 9.8, 9.8, 9.8), (10, 10, 10, 10, 10)) == 0  # within the margin: noise
    assert crossover(sizes, (5, 5, 5, 5, 5), (10, 10, 10, 10, 10)) == 8


def test_a_packed_layer_runs_its_small_calls_on_the_default_kernels():
    torch.manual_seed(0)
    layer = torch.nn.Linear(21, 40)  # no vector width divides 21: the plain calls are the default kernel's
    pack_linears(layer, plain_rows=3)
    assert plain_rows_of(layer) == 3
    with torch.inference_mode():
        for shape in ((1, 21), (3, 21), (1, 3, 21)):  # rows: every dimension but the last
            x = torch.randn(shape)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        for shape in ((4, 21), (2, 2, 21), (17, 21)):
            x = torch.randn(shape)
            want = torch.ops.mkldnn._linear_pointwise(x, packed_weight(layer), layer.bias, "none", [], "")
            assert torch.equal(layer(x), want)
    set_plain_rows(layer, 0)
    x = torch.randn(1, 21)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.ops.mkldnn._linear_pointwise(x, packed_weight(layer), layer.bias,
                                                                          "none", [], ""))
    with pytest.raises(ValueError, match="at least 0"):
        set_plain_rows(layer, -1)


def test_measure_times_every_size_both_ways(tiny_llama):
    model = prepare(tiny_llama(VOCAB, seed=0, num_layers=2), pack=True)
    choice = measure(model, sizes=(1, 2, 4), rounds=1)
    assert choice.sizes == (1, 2, 4) and len(choice.plain_ms) == len(choice.packed_ms) == 3
    assert all(ms > 0 for ms in choice.plain_ms + choice.packed_ms)
    assert choice.plain_up_to == crossover(choice.sizes, choice.plain_ms, choice.packed_ms)
    with pytest.raises(ValueError, match="no packed linear"):
        measure(tiny_llama(VOCAB, seed=0, num_layers=2))


def test_choose_measures_once_per_machine_and_applies_the_rule(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    model = prepare(tiny_llama(VOCAB, seed=0, num_layers=2), pack=True)
    calls = []

    def fake(m, rows):
        calls.append(rows)
        return KernelChoice((1, 2, 4), (1.0, 1.0, 3.0), (2.0, 2.0, 2.0), rows)

    monkeypatch.setattr(kernels, "measure", lambda m: fake(m, 2))
    assert choose(model).plain_up_to == 2 and plain_rows_of(model) == 2 and calls == [2]
    set_plain_rows(model, 0)
    assert choose(model).plain_up_to == 2 and plain_rows_of(model) == 2 and calls == [2]  # from the cache
    monkeypatch.setattr(kernels, "measure", lambda m: fake(m, 0))
    assert choose(model, refresh=True).plain_up_to == 0 and plain_rows_of(model) == 0 and calls == [2, 0]
    for path in (kernels.cache_dir() / "kernels").iterdir():
        path.write_text("{not json")
    monkeypatch.setattr(kernels, "measure", lambda m: fake(m, 1))
    assert choose(model).plain_up_to == 1 and calls == [2, 0, 1]  # an unreadable cache is measured again
    assert choose(tiny_llama(VOCAB, seed=0, num_layers=2)) is None  # nothing packed, nothing to choose


@pytest.mark.parametrize("method,settings", [("ar", {}), ("pld", {}), ("lookahead", dict(window=4, ngram=3, guesses=4)),
                                             ("skip", dict(layers=2, num_tokens=3))], ids=str)
def test_a_split_rule_stays_lossless(method, settings, tiny_llama):
    """One-token forwards on the plain kernel, verifies of three rows or more on packed ones: every method's
    greedy output is still the unpacked target's AR output (fp32)."""
    plain = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))
    model = prepare(tiny_llama(VOCAB, seed=0, num_layers=4), pack=True)
    set_plain_rows(model, 2)
    split = TargetModel(model)
    assert split.plain_rows == 2 and split.kernels.endswith(f"{rows.plain_name()} up to 2 rows)")
    drafter = build_drafter(method, split, **settings)
    for prompt in PROMPTS:
        want = run(plain, AutoregressiveDrafter(), prompt, 30, stop_on_eos=False).output_ids
        assert run(split, drafter, prompt, 30, stop_on_eos=False).output_ids == want


def test_a_trained_drafter_takes_its_targets_rule(tiny_llama, tmp_path):
    plain = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))
    model = prepare(tiny_llama(VOCAB, seed=0, num_layers=4), pack=True)
    set_plain_rows(model, 2)
    split = TargetModel(model)
    folder = train_tiny_drafter(split, "eagle2", tmp_path / "eagle2")
    drafter = build_drafter("eagle2", split, checkpoint=str(folder), depth=3, top_k=3, total_tokens=8)
    assert drafter.frozen.plain_rows == 2 and plain_rows_of(drafter.net) == 2
    for prompt in PROMPTS:
        want = run(plain, AutoregressiveDrafter(), prompt, 30, stop_on_eos=False).output_ids
        assert run(split, drafter, prompt, 30, stop_on_eos=False).output_ids == want
