"""apps.opsplit: profiler rows sorted into matrix kernels, attention, other operators and what lies outside them."""

from __future__ import annotations

import pytest
import torch

from specviz.apps.opsplit import kind, split, split_text
from specviz.apps.profile import profile
from specviz.core.packing import pack_linears


@pytest.mark.parametrize("name,expected", [
    ("aten::mm", "matrix"), ("aten::addmm", "matrix"), ("mkldnn::_linear_pointwise", "matrix"),
    ("specviz_rows::linear", "matrix"),
    ("specviz_rows::group", "matrix"),
    ("specviz_rows::attend", "attention"),
    ("specviz_rows::refine", "other"),
    ("mkl::_mkl_linear", "matrix"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "matrix"), ("ampere_bf16_s16816gemm", "matrix"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("flash_fwd_kernel", "attention"),
    ("aten::rsqrt", "other"), ("## Call CompiledFxGraph abc ##", "other"), ("aten::copy_", "other"),
    ("TorchDynamo Cache Lookup", "outside"), ("Pregraph bytecode", "outside"),
    ("Torch-Compiled Region: 0/3", "outside"),
])
def test_operator_kinds(name, expected):
    assert kind(name) == expected


@pytest.mark.parametrize("pack", [False, True])
def test_a_tiny_targets_forward_splits_into_its_parts(tiny_target, pack):
    """Both kernel paths (PyTorch's default and packed oneDNN) are seen as matrix work; the parts add up to the
    curve's wall time, with the remainder outside the operators."""
    target = tiny_target()
    if pack and not pack_linears(target.model):
        pytest.skip("this torch cannot pack linear weights here")
    result = profile(target, context=8, sizes=(1, 4), repeats=2, ops=True)
    assert [r["tokens"] for r in result["ops"]] == [1, 4]
    for row, curve in zip(result["ops"], result["curve"]):
        assert row["wall_ms"] == curve["ms"]
        assert row["matrix_ms"] > 0 and row["attention_ms"] > 0 and row["other_ms"] > 0 and row["outside_ms"] >= 0
        parts = row["matrix_ms"] + row["attention_ms"] + row["other_ms"] + row["outside_ms"]
        assert parts >= row["wall_ms"] - 1e-9 and row["x_matrix"] == pytest.approx(row["wall_ms"] / row["matrix_ms"])


def test_attention_hidden_in_a_compiled_graph_is_not_reported_as_zero():
    """A graph whose C++ wrapper calls attention directly shows no attention operator: the split says it did not see
    it (None, printed as –) rather than reporting 0 ms, and its time stays in the graph's own (other)."""
    a = torch.randn(64, 64)

    def graph():
        with torch.profiler.record_function("## Call CompiledFxGraph abc ##"):
            torch.tanh(a @ a)

    row = split(graph, tokens=1, wall_ms=1.0, device=torch.device("cpu"), repeats=2)
    assert row.attention_ms is None and row.matrix_ms > 0 and row.other_ms > 0
    assert "attention     –" in split_text([row]) and "counted in other operators" in split_text([row])

    def eager():
        q = torch.randn(1, 2, 4, 8)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)

    assert split(eager, tokens=1, wall_ms=1.0, device=torch.device("cpu"), repeats=2).attention_ms > 0
