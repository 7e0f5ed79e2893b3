"""Packed linear layers that read one input, run as one product in a compiled graph: a decoder layer's q, k and v
projections, its MLP's gate and up projections.

A decode forward is a few rows against each weight, so each product is bound by reading the weight and by the
kernel's fixed cost per call; one product over the stacked weights pays that fixed cost (oneDNN's per-call
setup, the operator's dispatch) once instead of three or two times, for the same bytes read. The eager path keeps
transformers' separate calls: grouping is a rewrite of inductor's graph (``GroupPass``, a post-grad pass), not
of the modeling code.

- ``specviz::packed_group(x, layers)`` is the product of ``x`` with the packed layers ``layers``
  (``core.packing``'s numbers) stacked along their outputs; the graph takes each layer's columns back as a slice.
- The stacked weights are made the first time a group runs and live as long as the group's first layer: the dense
  stack, of which each layer's own weight becomes a view (its rows, the same values: no second dense copy), and
  the stack packed, one more copy of those layers' weights (the separate packed ones serve the eager path).
- Rule: a group's call follows its layers' kernel rule (``packing.packs``, with the plain_rows every layer
  of a group shares): at most ``plain_rows`` rows, the plain product (``rows.linear``) over the dense stack, also
  one call.

Exactness: each output column is the same dot product over the same input as in its own layer's call, so the
stacked product's columns equal the separate ones wherever the kernel reduces each column alike; the tests check
compiled greedy output against the eager path's and AR's.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import packing, rows

_GROUPS: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
# layers -> (their weights stacked dense, that stack packed, their biases stacked)


def _layers(layers: list[int]) -> list[torch.nn.Linear]:
    return [packing.layer(number) for number in layers]


def _stacked(key: tuple[int, ...], modules: list[torch.nn.Linear]):
    """The group's dense and packed weights and stacked bias, made on its first call and dropped with its first
    layer. Each layer's weight becomes a view of its rows of the dense stack, so the dense weights are held once."""
    with torch.inference_mode(False):  # a decode's first call: the layers' weights must stay usable with autograd
        dense = torch.cat([m.weight.detach() for m in modules])
        bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
    start = 0
    for m in modules:
        m.weight.data = dense[start:start + m.out_features]  # contiguous rows: every product on it is unchanged
        start += m.out_features
    stacked = _GROUPS[key] = dense, packing.pack(dense), bias
    weakref.finalize(modules[0], _GROUPS.pop, key, None)
    return stacked


def _packed_group_op(x: torch.Tensor, layers: list[int]) -> torch.Tensor:
    # sixty calls a forward: the other layers are looked up only to stack them, once
    key = tuple(layers)
    dense, packed, bias = _GROUPS.get(key) or _stacked(key, _layers(layers))
    if packing.packs(packing.layer(layers[0]), x):
        return packing.packed_linear(x, packed, bias)
    return rows.linear(x, dense, bias)


_LIBRARY = torch.library.Library("specviz", "FRAGMENT")
_LIBRARY.define("packed_group(Tensor x, int[] layers) -> Tensor")
_LIBRARY.impl("packed_group", _packed_group_op, "CPU")
torch.library.register_fake("specviz::packed_group", packing.layers_fake, lib=_LIBRARY)


def groupable(modules: list[torch.nn.Linear]) -> bool:
    """Whether these packed layers can run as one product: one dtype, input width and ``plain_rows``, and all or
    none with a bias."""
    first = modules[0]
    return all(m.weight.dtype == first.weight.dtype and m.in_features == first.in_features
               and (m.bias is None) == (first.bias is None)
               and packing.plain_rows_of(m) == packing.plain_rows_of(first)
               for m in modules)


def _operators() -> dict:
    """A layer's operator -> its group's: the Python ones, and the C++ ones where the rows extension is loaded
    (``packing.register``)."""
    ops = {torch.ops.specviz.packed_linear.default: torch.ops.specviz.packed_group.default}
    if hasattr(torch.ops.specviz_rows, "layer"):
        ops[torch.ops.specviz_rows.layer.default] = torch.ops.specviz_rows.group.default
    return ops


def group_packed_linears(graph: torch.fx.Graph) -> int:
    """Replace the packed layers' calls of ``graph`` (``specviz::packed_linear`` or ``specviz_rows::layer``) that
    share their input by one call of the group's operator and a slice per layer. Returns how many groups it made."""
    operators = _operators()
    by_input: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in operators:
            by_input[node.args[0], node.target].append(node)
    made = 0
    for (x, single), nodes in by_input.items():
        layers = [node.args[1] for node in nodes]
        if len(nodes) < 2 or not groupable(_layers(layers)):
            continue
        fake = x.meta["val"]
        with graph.inserting_before(nodes[0]):  # x is defined before its first reader
            group = graph.call_function(operators[single], (x, layers))
            with fake.fake_mode:
                group.meta["val"] = packing.layers_fake(fake, layers)
            start, pieces = 0, []
            for node in nodes:
                width = node.meta["val"].shape[-1]
                pieces.append(graph.call_function(torch.ops.aten.slice.Tensor, (group, -1, start, start + width)))
                with fake.fake_mode:
                    pieces[-1].meta["val"] = group.meta["val"][..., start:start + width]
                start += width
        for node, piece in zip(nodes, pieces):  # after inserting: an erased node is no place to insert before
            node.replace_all_uses_with(piece)
            graph.erase_node(node)
        made += 1
    return made


class GroupPass(CustomGraphPass):
    """``group_packed_linears`` as inductor's post-grad pass; its uuid (this file's hash) keys inductor's cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_packed_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
