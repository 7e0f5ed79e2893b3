"""The packed layers' C++ operators (``layers.cpp``, registered by ``core.packing.register``): each call follows the
layer's kernel rule as its eager forward does, a group's columns are its layers' own products bit for bit, the
kernel rule follows ``set_plain_rows``, a layer leaves the registry with its module, and the graph pass groups
these operators as it groups the Python ones; where the extension is missing, a compiled graph calls the Python
operators."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import PACKED_DTYPES
from drafters import build_drafter
from specviz.core import grouping, rows
from specviz.core.engine import run
from specviz.core.load import prepare
from specviz.core.packing import number, pack, pack_linears, register, set_plain_rows
from specviz.core.target import TargetModel

pytestmark = pytest.mark.skipif(pack(torch.ones(2, 2)) is None, reason="this torch build cannot pack for oneDNN")


def registered(shapes, dtype, bias, plain_rows, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=bias) for i, o in shapes).to(dtype).eval()
    pack_linears(model, plain_rows)
    assert rows.available(), rows.unavailable()  # CI's machine and ours build it (``test_rows``)
    assert register(model) == len(shapes)
    return model


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_each_call_and_each_group_is_the_layers_own_eager_product(dtype, bias):
    model = registered([(64, 40), (64, 24), (64, 32)], dtype, bias, plain_rows=4)
    numbers = [number(m) for m in model]
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for m in (1, 3, 4, 5, 9, 20):  # plain up to 4 rows (the rows kernel in fp32), packed above
            x = torch.randn(2, m, 64, generator=gen).to(dtype)
            apart = [layer(x) for layer in model]  # the eager forwards (``packing.linear``'s rule)
            for layer, n, want in zip(model, numbers, apart):
                assert torch.equal(torch.ops.specviz_rows.layer(x, n), want), (m, n)
            assert torch.equal(torch.ops.specviz_rows.group(x, numbers), torch.cat(apart, -1)), m


def test_the_rule_follows_set_plain_rows():
    model = registered([(64, 48)], torch.float32, bias=True, plain_rows=0)
    x, n = torch.randn(3, 64), number(model[0])
    with torch.inference_mode():
        plain = rows.linear(x, model[0].weight, model[0].bias)
        packed = model[0](x)
        assert torch.equal(torch.ops.specviz_rows.layer(x, n), packed)
        set_plain_rows(model, 8)
        assert torch.equal(torch.ops.specviz_rows.layer(x, n), plain)
    assert not torch.equal(plain, packed)  # the two kernels differ in the last bits here, so the rule was seen


def test_a_layer_leaves_the_registry_with_its_module():
    gc.collect()  # the earlier tests' models
    before = torch.ops.specviz_rows.registered()
    model = registered([(32, 16), (32, 16)], torch.float32, bias=False, plain_rows=0)
    n = number(model[0])
    assert torch.ops.specviz_rows.registered() == before + 2
    assert register(model) == 2 and torch.ops.specviz_rows.registered() == before + 2  # once each
    del model
    gc.collect()
    assert torch.ops.specviz_rows.registered() == before
    with pytest.raises(RuntimeError, match=f"packed layer {n} is not registered"):
        torch.ops.specviz_rows.layer(torch.randn(1, 32), n)


def test_the_graph_pass_groups_the_cpp_operators():
    model = registered([(24, 24), (24, 8), (24, 8), (24, 24)], torch.float32, bias=False, plain_rows=2)
    numbers = [number(m) for m in model]

    def forward(x):  # q, k and v read x; o reads q's output
        outs = [torch.ops.specviz_rows.layer(x, n) for n in numbers[:-1]]
        return (*outs, torch.ops.specviz_rows.layer(outs[0], numbers[-1]))

    for m in (1, 3):
        x = torch.randn(1, m, 24)
        graph_module = make_fx(forward, tracing_mode="fake")(x)
        with torch.inference_mode():
            apart = graph_module(x)
            assert grouping.group_packed_linears(graph_module.graph) == 1
            graph_module.recompile()
            together = graph_module(x)
        targets = [str(node.target) for node in graph_module.graph.nodes]
        assert targets.count("specviz_rows.group.default") == 1 and targets.count("specviz_rows.layer.default") == 1
        assert all(torch.equal(got, want) for got, want in zip(together, apart))


def test_a_copy_of_a_registered_layer_packed_again_is_registered_anew():
    """A deep copy carries the layer's attributes; packed again it has a number of its own, which the registry does
    not know until ``register`` gives it (a graph traced before that keeps the Python operator)."""
    from specviz.core.packing import plain_copy

    model = registered([(32, 16)], torch.float32, bias=True, plain_rows=0)
    twin = plain_copy(model)  # a deep copy without the packed weights (one to train, say)
    assert twin[0]._specviz_registered  # carried over with the module's attributes
    pack_linears(twin)
    assert number(twin[0]) != number(model[0]) and not twin[0]._specviz_registered
    assert register(twin) == 1
    x = torch.randn(3, 32)
    with torch.inference_mode():
        assert torch.equal(torch.ops.specviz_rows.layer(x, number(twin[0])), twin[0](x))


def test_without_the_rows_extension_the_graph_calls_the_python_layer_operators(tiny_llama, ref_greedy, monkeypatch):
    """Where the rows extension cannot load, the packed layers stay Python operators (``specviz::packed_linear`` /
    ``packed_group``) in the graph, which inductor's C++ wrapper calls through the dispatcher: still plain greedy."""
    from torch.profiler import profile

    monkeypatch.setattr(rows, "_width", 0)  # as where it did not build: ``rows.available()`` is False
    target = TargetModel(prepare(tiny_llama(vocab_size=64, seed=5, max_positions=320), pack=True))
    assert target.use_engine("compiled").path == "compiled"
    prompt = [2, 9, 4, 4, 1, 30, 17, 8, 8, 21, 5]
    with profile() as prof:
        output = run(target, build_drafter("pld", target, num_tokens=3), prompt + prompt, 24).output_ids
    assert output == ref_greedy(target.model, prompt + prompt, 24)
    names = {e.key for e in prof.key_averages()}
    assert {"specviz::packed_linear", "specviz::packed_group"} & names
    assert not any(name.startswith("specviz_rows::") for name in names)
