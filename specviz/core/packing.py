"""CPU linear layers on oneDNN with their weights packed once, for the small row counts decoding runs.

PyTorch's default CPU ``linear`` goes to MKL, whose kernels for a handful of rows re-lay out the weight
on every call, so a small tree verify costs well over one single forward. Packed once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) the same
matrices run faster at every small row count: a faster target and cheaper trees (docs/tuning.md).

The packed copy sits beside the dense weight (the embedding it may be tied to, and drafters that
read the head, keep using the dense one), so packing costs one more copy of the linear weights.
It is for inference: with autograd or autocast on, a layer falls back to the plain ``linear``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types

import torch
import torch.nn.functional as F

_ATTR = "_specviz_packed"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on ``packed`` (``pack(weight)``) where given, autograd and autocast are off and dtypes agree.
    Under ``torch.compile`` the plain op: inductor's freezing packs the weight itself (``core.capture``)."""
    if (packed is None or torch.compiler.is_compiling() or torch.is_grad_enabled()
            or torch.is_autocast_enabled(x.device.type) or x.dtype != packed.dtype):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, getattr(self, _ATTR))


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
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def pack_linears(model: torch.nn.Module) -> int:
    """Run every ``nn.Linear`` of a CPU ``model`` on packed oneDNN weights. Returns how many were packed (0 where
    the model is not on the CPU or this build cannot pack its dtypes). Pack after the last change to the weights."""
    count = 0
    for module in model.modules():
        packed = pack(module.weight) if type(module) is torch.nn.Linear else None
        if packed is not None:
            setattr(module, _ATTR, packed)
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count


def packed_count(model: torch.nn.Module) -> int:
    """How many of ``model``'s linear layers run on packed weights (``pack_linears``)."""
    return sum(1 for m in model.modules() if hasattr(m, _ATTR))


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
            module.forward = types.MethodType(_packed_forward, module)
