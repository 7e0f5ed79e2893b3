"""core.grouping: packed layers that read one input become one stacked product in a graph, with the same output
columns as their separate products, packed or (at most ``plain_rows`` rows) plain, each layer's dense weight then
held once, in the stack; layers that cannot stack (another input width, a bias on some only) stay apart."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import PACKED_DTYPES
from specviz.core import grouping
from specviz.core import rows as rows_kernel
from specviz.core.packing import number, pack, pack_linears, set_plain_rows

pytestmark = pytest.mark.skipif(pack(torch.ones(2, 2)) is None, reason="this torch build cannot pack for oneDNN")


def layers(shapes, dtype, bias=False, seed=0):
    """Packed linear layers of ``shapes`` [(in, out)], in one module so they share one ``plain_rows``."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=bias) for i, o in shapes).to(dtype).eval()
    assert pack_linears(model) == len(shapes)
    return model


def traced(model, x):
    """A graph calling each layer's ``specviz::packed_linear`` on ``x`` (the last layer on its output, as a
    down projection reads an activation), with the fake values a post-grad graph carries."""
    numbers = [number(m) for m in model]

    def forward(x):
        outs = [torch.ops.specviz.packed_linear(x, n) for n in numbers[:-1]]
        return (*outs, torch.ops.specviz.packed_linear(outs[0], numbers[-1]))

    return make_fx(forward, tracing_mode="fake")(x)


def ops(graph_module, name):
    return sum(str(node.target).startswith(name) for node in graph_module.graph.nodes)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_group_gives_each_layers_own_columns(dtype, rows):
    model = layers([(24, 24), (24, 8), (24, 8), (24, 24)], dtype)  # q, k, v; then o on q's output
    x = torch.randn(1, rows, 24).to(dtype)
    graph_module = traced(model, x)
    with torch.inference_mode():
        apart = graph_module(x)
        assert grouping.group_packed_linears(graph_module.graph) == 1  # o reads another input: alone
        graph_module.recompile()
        together = graph_module(x)
    assert ops(graph_module, "specviz.packed_group") == 1 and ops(graph_module, "specviz.packed_linear") == 1
    assert len(together) == len(apart)
    for got, want in zip(together, apart):
        assert torch.equal(got, want)  # bit for bit: the same dot products


@pytest.mark.parametrize("rows", [1, 2])
def test_at_plain_rows_a_group_runs_one_plain_product_on_weights_held_once(rows):
    model = layers([(16, 12), (16, 20)], torch.float32, bias=True, seed=1)
    set_plain_rows(model, 2)
    x, key = torch.randn(1, rows, 16), tuple(number(m) for m in model)
    before = [m.weight.detach().clone() for m in model]
    with torch.inference_mode():
        want = torch.cat([rows_kernel.linear(x, m.weight, m.bias) for m in model], -1)  # the plain kernel
        got = torch.ops.specviz.packed_group(x, list(key))
        again = torch.cat([m(x) for m in model], -1)  # each layer's own forward, on its rows of the stack
    assert torch.equal(got, want)  # bit for bit: the same dot products, in one call
    assert torch.equal(again, want)
    dense = grouping._GROUPS[key][0]
    for m, weight in zip(model, before):
        assert torch.equal(m.weight, weight)  # the same values, now held once: in the group's dense stack
        assert m.weight.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()
    x.requires_grad_(True)  # stacked during inference, the weights still serve autograd (training a copy, say)
    model[0](x).sum().backward()
    torch.testing.assert_close(x.grad, model[0].weight.sum(0).expand_as(x))


def test_layers_that_cannot_stack_stay_apart():
    wide = layers([(16, 8), (24, 8)], torch.float32)  # another input width: not one input (never grouped)
    assert not grouping.groupable(list(wide))
    some_bias = layers([(16, 8), (16, 8)], torch.float32)
    some_bias[1].bias = torch.nn.Parameter(torch.zeros(8))
    assert not grouping.groupable(list(some_bias))
    rows = layers([(16, 8), (16, 8)], torch.float32)
    set_plain_rows(rows[:1], 4)
    assert not grouping.groupable(list(rows))


def test_a_stacked_weight_goes_with_its_layers():
    model = layers([(16, 8), (16, 8)], torch.float32, seed=2)
    key = tuple(number(m) for m in model)
    with torch.inference_mode():
        torch.ops.specviz.packed_group(torch.randn(1, 5, 16), list(key))
    assert key in grouping._GROUPS
    del model
    gc.collect()  # a packed layer's bound forward refers to the layer: a cycle, freed by the collector
    assert key not in grouping._GROUPS
