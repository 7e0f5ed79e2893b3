"""CPU linear layers on oneDNN with their weights packed once, for the small row counts decoding runs.

PyTorch's default CPU ``linear`` goes to MKL, whose kernels for a handful of rows re-lay out the weight
on every call, so a small tree verify costs well over one single forward. Packed once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) the same
matrices run faster at every small row count: a faster target and cheaper trees (docs/tuning.md).

The packed copy sits beside the dense weight (the embedding it may be tied to, and drafters that
read the head, keep using the dense one), so packing costs one more copy of the linear weights.
It is for inference: with autograd or autocast on, a layer falls back to the plain ``linear``.

Inside a compiled graph (``core.capture``) a packed layer is one opaque operator, ``specviz::packed_linear``,
whose body is the eager layer itself (its packed weight, its ``plain_rows``): inductor compiles everything
around it and needs no freezing to reach packed kernels, so its cache keeps the graph between processes. The
operator names the layer by a number (``install`` gives every packed layer one), never by its weight: an
opaque oneDNN tensor cannot enter a graph. Where the rows extension loads, ``register`` hands a model's packed
layers to its C++ registry and the graphs traced afterwards call ``specviz_rows::layer`` instead (``layers.cpp``:
the same rule and products, without a Python call per layer, 120 to 200 a forward).

Packed is not faster at every row count on every CPU: a packed layer may run its smallest calls (up to
``plain_rows`` rows) on the plain kernels instead, where those measured faster on this machine
(``core.kernels`` measures where; nothing here assumes one host's answer). The plain kernel is the rows kernel
(``core.rows``) where it fits and is built here, else PyTorch's default.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import types
import weakref

import torch
import torch.nn.functional as F

from . import rows

_ATTR = "_specviz_packed"  # a module's packed weight
_FORWARD = "_specviz_forward"  # the function its forward runs on it (``install``)
_PLAIN_ROWS = "_specviz_plain_rows"
_REGISTERED = "_specviz_registered"  # whether the rows extension's C++ operators know the layer (``register``)
_HANDLE = "_specviz_handle"  # a packed module's number for ``specviz::packed_linear``
_MODULES: dict[int, weakref.ref] = {}  # number -> the packed module (weakly: a dropped model is not kept)
_NUMBERS = itertools.count()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, plain_rows: int = 0) -> torch.Tensor:
    """``F.linear``, on ``packed`` (``pack(weight)``) where given, autograd and autocast are off, dtypes agree and
    ``x`` has more than ``plain_rows`` rows (all its dimensions but the last), else on the plain kernel
    (``rows.linear``). Under ``torch.compile`` the plain op (a packed module runs ``specviz::packed_linear`` there
    instead, the module docstring)."""
    if (packed is None or torch.compiler.is_dynamo_compiling() or torch.is_grad_enabled()
            or torch.is_autocast_enabled(x.device.type)):
        return F.linear(x, weight, bias)
    if not _packs(x, packed, plain_rows):
        return rows.linear(x, weight, bias)
    return packed_linear(x, packed, bias)


def _packs(x: torch.Tensor, packed: torch.Tensor, plain_rows: int) -> bool:
    """The kernel rule for ``x``: the packed weight, unless ``x`` has at most ``plain_rows`` rows or another dtype."""
    return not (plain_rows and x.numel() <= plain_rows * x.shape[-1]) and x.dtype == packed.dtype


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's product of ``x`` with a ``pack``ed weight, with no check (``linear`` checks)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def layer(number: int) -> torch.nn.Linear:
    """Packed layer ``number`` (``install``; what a graph names a layer by)."""
    module = _MODULES[number]()
    if module is None:
        raise RuntimeError(f"packed layer {number} no longer exists: its graph outlived its model")
    return module


def _packed_linear_op(x: torch.Tensor, number: int) -> torch.Tensor:
    """Packed layer ``number``'s product, as its eager forward computes it (``linear``, whose autograd, autocast and
    compile checks do not apply here); what a compiled graph calls (the module docstring)."""
    module = layer(number)
    own = module.__dict__  # read directly: nn.Module's attribute lookup costs microseconds, 200 calls a forward
    packed = own[_ATTR]
    if _packs(x, packed, own.get(_PLAIN_ROWS, 0)):
        return packed_linear(x, packed, module.bias)
    return rows.linear(x, module.weight, module.bias)


def _packed_linear_fake(x: torch.Tensor, number: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], layer(number).out_features)


# a plain operator library: ``torch.library.custom_op``'s wrapper adds a few microseconds to each of a forward's
# two hundred calls
_LIBRARY = torch.library.Library("specviz", "DEF")
_LIBRARY.define("packed_linear(Tensor x, int number) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear_op, "CPU")
torch.library.register_fake("specviz::packed_linear", _packed_linear_fake, lib=_LIBRARY)


def packs(module: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether packed layer ``module`` runs ``x`` on its packed weight (its kernel rule, ``_packs``)."""
    own = module.__dict__
    return _packs(x, own[_ATTR], own.get(_PLAIN_ROWS, 0))


def number(module: torch.nn.Linear) -> int:
    """A packed layer's number (``install``)."""
    return getattr(module, _HANDLE)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # "in what dynamo traces", not ``is_compiling``: torch says that to every thread while any one compiles, and an
    # eager forward beside a compilation must compute what it always does (``core.collector``)
    if (torch.compiler.is_dynamo_compiling() and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type)):
        number = getattr(self, _HANDLE)
        if getattr(self, _REGISTERED, False):  # the C++ operator (``register``); an attribute, which graphs do not
            return torch.ops.specviz_rows.layer(x, number)  # guard on, where a global set's contents would be
        return torch.ops.specviz.packed_linear(x, number)
    return linear(x, self.weight, self.bias, getattr(self, _ATTR), getattr(self, _PLAIN_ROWS, 0))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # a hint of 1 row is slow from 4 rows up


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] packed for ``linear``, or None where this build or device cannot."""
    ok = weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and _packs_correctly(weight.dtype)
    return _pack(weight) if ok else None


@functools.cache
def _packs_correctly(dtype: torch.dtype) -> bool:
    """Whether this build packs ``dtype`` and the packed product matches the plain one."""
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=gen).to(dtype), torch.randn(3, 16, generator=gen).to(dtype)
        got = packed_linear(x, _pack(w))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def install(module: torch.nn.Module, packed: torch.Tensor, forward) -> None:
    """Run ``module`` as ``forward(module, x)`` on its ``packed`` weight (``unpacked`` and ``plain_copy`` lift it)."""
    setattr(module, _ATTR, packed)
    setattr(module, _FORWARD, forward)
    number = next(_NUMBERS)
    _MODULES[number] = weakref.ref(module, lambda _ref, n=number: _MODULES.pop(n, None))
    setattr(module, _HANDLE, number)
    setattr(module, _REGISTERED, False)  # a new number (a copy of a registered layer, packed again): not yet known
    module.forward = types.MethodType(forward, module)


def installed(module: torch.nn.Module):
    """The function ``module`` runs on its packed weight (``install``), or None where it has none."""
    return getattr(module, _FORWARD, None) if hasattr(module, _ATTR) else None


def pack_linears(model: torch.nn.Module, plain_rows: int = 0) -> int:
    """Run every ``nn.Linear`` of a CPU ``model`` on packed oneDNN weights, but calls of up to ``plain_rows`` rows
    (``set_plain_rows``). Returns how many were packed (0 where the model is not on the CPU or this build cannot
    pack its dtypes). Pack after the last change to the weights."""
    count = 0
    for module in model.modules():
        packed = pack(module.weight) if type(module) is torch.nn.Linear else None
        if packed is not None:
            install(module, packed, _packed_forward)
            count += 1
    set_plain_rows(model, plain_rows)
    return count


def set_plain_rows(model: torch.nn.Module, rows: int) -> None:
    """Let every packed layer of ``model`` run calls of up to ``rows`` rows on the default kernels (0: none)."""
    if rows < 0:
        raise ValueError(f"plain_rows must be at least 0, got {rows}")
    for module in packed_linears(model):
        setattr(module, _PLAIN_ROWS, rows)
        if getattr(module, _REGISTERED, False):
            torch.ops.specviz_rows.set_plain_rows(getattr(module, _HANDLE), rows)


def register(model: torch.nn.Module) -> int:
    """Give ``model``'s packed layers to the rows extension's C++ operators (``layers.cpp``), which compiled graphs
    traced afterwards call instead of ``specviz::packed_linear``: the same kernel rule and products without a
    Python call per layer. Each layer leaves the registry with its module. Returns how many are registered (0
    where the extension is not available here: the graphs keep the Python operator)."""
    if not rows.available():
        return 0
    _register_fakes()
    count = 0
    for module in packed_linears(model):
        number = getattr(module, _HANDLE)
        if not getattr(module, _REGISTERED, False):
            bias = None if module.bias is None else module.bias.detach()
            torch.ops.specviz_rows.register_layer(module.weight.detach(), getattr(module, _ATTR), bias, number,
                                                  getattr(module, _PLAIN_ROWS, 0))
            setattr(module, _REGISTERED, True)
            weakref.finalize(module, torch.ops.specviz_rows.drop_layer, number)
        count += 1
    return count


@functools.cache
def _register_fakes() -> None:
    """The C++ operators' shapes for tracing (once a process, after the extension loads)."""
    torch.library.register_fake("specviz_rows::layer", _packed_linear_fake)
    torch.library.register_fake("specviz_rows::group", layers_fake)


def layers_fake(x: torch.Tensor, numbers: list[int]) -> torch.Tensor:
    """The shape of packed layers ``numbers``' products side by side (a group's, ``core.grouping``): both group
    operators' fake implementation."""
    return x.new_empty(*x.shape[:-1], sum(layer(n).out_features for n in numbers))


def plain_rows_of(model: torch.nn.Module) -> int:
    """Up to how many rows ``model``'s packed layers run on the default kernels (0: packed at every row count)."""
    return max((getattr(m, _PLAIN_ROWS, 0) for m in packed_linears(model)), default=0)


def packed_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """``model``'s linear layers that run on packed weights as plain products (``pack_linears``; not a head
    ``core.head`` runs its own way)."""
    return [m for m in model.modules() if installed(m) is _packed_forward]


def packed_weight(module: torch.nn.Linear) -> torch.Tensor:
    """A packed layer's oneDNN weight (``pack``)."""
    return getattr(module, _ATTR)


def packed_count(model: torch.nn.Module) -> int:
    """How many of ``model``'s linear layers run on packed weights (``pack_linears``)."""
    return len(packed_linears(model))


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` on the default kernels, without its packed weights (one to train)."""
    packed = {m: getattr(m, _ATTR) for m in model.modules() if hasattr(m, _ATTR)}
    with unpacked(model):
        for module in packed:
            delattr(module, _ATTR)
        try:
            return copy.deepcopy(model)
        finally:
            for module, weight in packed.items():
                setattr(module, _ATTR, weight)


@contextlib.contextmanager
def unpacked(model: torch.nn.Module):
    """Run ``model`` on the default kernels inside the block (transformers' ``generate`` as users get it)."""
    packed = [m for m in model.modules() if hasattr(m, _ATTR)]
    for module in packed:
        del module.forward
    try:
        yield
    finally:
        for module in packed:
            module.forward = types.MethodType(getattr(module, _FORWARD), module)
