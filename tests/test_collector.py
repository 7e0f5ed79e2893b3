"""core.collector: the ecosystem's compile-aware context variables made thread-safe. An eager forward while another
thread compiles keeps to its own context and leaves the traced slot alone; traced code nests in the slot and leaves
it as it found it; and a target compiles on a thread while the caller's thread runs eager forwards beside it,
which, before, broke the compilation (the app's "compile while serving")."""

from __future__ import annotations

import importlib

import torch

from specviz.core.collector import VARIABLES, make_thread_safe
from specviz.core.load import prepare
from specviz.core.target import TargetModel


def variables() -> dict[str, object]:
    """The compile-aware context variables this environment has, thread-safe."""
    names = make_thread_safe()
    assert "transformers.utils.output_capturing._active_collector" in names  # the one every model's forward reads
    found = {}
    for module_name, attribute in VARIABLES:
        if f"{module_name}.{attribute}" in names:
            found[attribute] = getattr(importlib.import_module(module_name), attribute)
    return found


def test_an_eager_forward_while_another_thread_compiles_keeps_to_its_own_context(tiny_llama, monkeypatch):
    """While any thread compiles, torch says ``is_compiling()`` on every thread; an eager forward then still
    collects its own hidden states and never reads or writes the slot a trace is using."""
    model = tiny_llama(num_layers=3)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    expected = model(ids, output_hidden_states=True).hidden_states
    slots = variables()
    marks = {name: {"a trace's": name} for name in slots}
    for name, var in slots.items():
        var.global_var = marks[name]
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what another thread's compilation holds
    assert torch.compiler.is_compiling()
    try:
        got = model(ids, output_hidden_states=True).hidden_states
        assert all(var.global_var is marks[name] for name, var in slots.items())
    finally:
        for var in slots.values():
            var.global_var = None
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_traced_code_nests_in_the_slot_and_leaves_it_as_it_found_it():
    """``set`` under a trace returns what it replaced and ``reset`` puts it back, so nested scopes read their own
    values; the compiled function and the eager one compute the same, and neither leaves the slot changed."""
    var = variables()["_active_collector"]

    def scopes(x):
        outer = var.set({"k": 1})
        first = var.get()["k"]
        inner = var.set({"k": 2})
        second = var.get()["k"]
        var.reset(inner)
        back = var.get()["k"]
        var.reset(outer)
        return x + 100 * first + 10 * second + back

    x = torch.zeros(2)
    assert torch.equal(scopes(x), x + 121)
    assert torch.equal(torch.compile(scopes, backend="eager", fullgraph=True)(x), x + 121)
    assert var.global_var is None and var.get() is None


def test_a_target_compiles_on_a_thread_while_eager_forwards_run_beside_it(tiny_llama):
    """The app's case: ``use_engine(background=True)`` compiles while the caller's thread keeps running eager
    forwards that collect hidden states. The compilation ends ready, and every eager forward meanwhile is exact."""
    target = TargetModel(tiny_llama(seed=3))
    ids = torch.tensor([[4, 8, 15, 16, 23, 42 % 32]])
    expected = target.model(ids, output_hidden_states=True).hidden_states
    target.use_engine("compiled", background=True)
    forwards = 0
    while target.captured.thread_alive() or forwards == 0:
        got = target.model(ids, output_hidden_states=True).hidden_states
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
        forwards += 1
    assert target.captured.wait(600), target.captured.error
    assert target.engine.path == "compiled"


def test_a_prepared_target_computes_the_same_while_another_thread_compiles(tiny_llama, monkeypatch):
    """specviz's own kernel rules (packed layers, the refined bf16 head, the attention kernel) choose the traced
    form only in code dynamo traces, so an eager forward while another thread compiles computes exactly what it
    does at any other time."""
    model = prepare(tiny_llama(seed=5).to(torch.bfloat16), pack=True)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        expected = model(ids).logits
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what another thread's compilation holds
        got = model(ids).logits
    assert torch.equal(got, expected)
