"""A CUDA device emulated on the CPU, strict as a real one about mixing devices.

``FakeCuda`` is a torch function mode: tensors "on the device" are CPU tensors whose storage it has
registered, and ``.device`` reports ``cuda:0`` for them. Moving to ``cuda`` (``.to``, ``device=`` in a
factory) registers a copy, moving to the CPU makes an unregistered one, and every op whose inputs
mix the two raises ``DeviceMix``, as CUDA would: a CPU index into a device tensor and 0-dim CPU
scalars are allowed; a device index into a CPU tensor, a CPU operand of a device op and a CPU
generator drawing device samples are not. Everything computed from a device tensor is on the device.
It lets the CPU-only suite run the engine and the drafters with the target "on a GPU". It also counts the host's
reads of device tensors (``reads``: a copy to the CPU, ``item``, ``tolist``, a tensor taken as a Python bool or
number), each of which waits for the device's queue on a real GPU.
"""

from __future__ import annotations

from collections import deque

import torch
from torch.overrides import TorchFunctionMode

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}  # with a ``device=`` argument: what may move
SETITEM, GETITEM, COPY = torch.Tensor.__setitem__, torch.Tensor.__getitem__, torch.Tensor.copy_
DEVICE_GETTER = torch.Tensor.device.__get__
PIN = torch.Tensor.pin_memory  # pinned host memory is host memory: a copy (this torch may have no accelerator)
ALLOWED = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_, torch.Tensor.item,
           torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__getitem__}
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__}  # a device tensor's value read by the host
METADATA = {"_has_compatible_shallow_copy_type", "__set__"}  # module.to(): compare, then swap ``param.data``
NESTED = (tuple, list, deque, dict)  # what torch's pytree flattens in an op's arguments and results (subclasses too)


def _tensors(items, found: list) -> list:
    """The tensors in the container ``items``, however nested, appended to ``found``. A plain walk: pytree's
    ``tree_flatten``/``tree_map`` cost most of the mode's time, and registering results needs no rebuilt structure."""
    for item in items.values() if isinstance(items, dict) else items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, NESTED):
            _tensors(item, found)
    return found


class DeviceMix(RuntimeError):
    """An op mixed CPU and device tensors: it would fail on a real GPU."""


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.kept: dict[int, torch.Tensor] = {}  # storage pointer -> a tensor holding it (so it is never reused)
        self.empty: dict[int, torch.Tensor] = {}  # empty device tensors, by id (they have no storage)
        self.reads = 0  # the host's reads of device tensors so far

    # -- bookkeeping ------------------------------------------------------------------------------
    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return t.untyped_storage().data_ptr() in self.kept if t.numel() else id(t) in self.empty

    def put(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            if t.numel():
                self.kept[t.untyped_storage().data_ptr()] = t
            else:
                self.empty[id(t)] = t
        return t

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """Treat ``module``'s parameters and buffers as living on the device."""
        for t in [*module.parameters(), *module.buffers()]:
            self.put(t)
        return module

    # -- the mode ---------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every op of every decode comes through here (most of a test's time), so it is kept lean: no pytree, one
        # storage lookup per tensor, the checks only where something could mix, and an op with no device tensor
        # among its inputs goes straight through.
        if func == DEVICE_GETTER:  # a fresh method-wrapper each time: compared by ==
            return CUDA if self.on_device(args[0]) else CPU
        if func == PIN:
            if self.on_device(args[0]):
                raise DeviceMix("pin_memory of a device tensor")
            return args[0].clone()
        if func in READS and self.on_device(args[0]):
            self.reads += 1
        kwargs = kwargs or {}
        if func in MOVES or kwargs.get("device") is not None:
            target = self._target_device(func, args, kwargs)
            if target is not None:
                return self._move(func, args, kwargs, target)
        tensors = []
        for a in args:
            if isinstance(a, torch.Tensor):
                tensors.append(a)
            elif isinstance(a, NESTED):
                _tensors(a, tensors)
        if kwargs:
            _tensors(kwargs, tensors)
        kept, empty, device, host = self.kept, self.empty, False, []  # host: CPU tensors but 0-dim scalars
        for t in tensors:
            if (t.untyped_storage().data_ptr() in kept) if t.numel() else (id(t) in empty):  # on_device, inlined
                device = True
            elif t.dim():
                host.append(t)
        if not device:  # nothing on the device: nothing to check, nothing to register
            return func(*args, **kwargs)
        if (host or func is SETITEM or kwargs.get("generator") is not None) and func not in ALLOWED \
                and getattr(func, "__name__", "") not in METADATA:
            if func is SETITEM:  # into a device tensor the index may stay on the CPU
                value = args[2] if isinstance(args[2], torch.Tensor) and args[2].dim() > 0 else None
                host = [] if value is None or self.on_device(value) == self.on_device(args[0]) else [value]
                if not self.on_device(args[0]):
                    host += [t for t in _tensors((args[1],), []) if self.on_device(t)]
            if host:
                device = [tuple(t.shape) for t in tensors if self.on_device(t)]
                raise DeviceMix(f"{getattr(func, '__name__', func)} mixes cuda:0 and cpu tensors "
                                f"(shapes {device} and {[tuple(t.shape) for t in host]})")
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type != "cuda":
                raise DeviceMix(f"{getattr(func, '__name__', func)} draws device samples with a CPU generator")
        if func is GETITEM and not self.on_device(args[0]):
            raise DeviceMix("a CPU tensor indexed with device indices")
        out = func(*args, **kwargs)
        if func is not COPY:  # a copy stays where its destination is; everything else computed here is on the device
            for t in (out,) if isinstance(out, torch.Tensor) else _tensors((out,), []):  # put, inlined
                if t.numel():
                    kept[t.untyped_storage().data_ptr()] = t
                else:
                    empty[id(t)] = t
        return out

    def _target_device(self, func, args, kwargs):
        """'cuda' or 'cpu' when the call moves or creates a tensor on that device, else None."""
        device = kwargs.get("device")
        if getattr(func, "__name__", "") == "_parse_to":  # Module.to() reading its arguments: creates nothing
            return None
        if func is torch.Tensor.cpu:
            return "cpu"
        if func is torch.Tensor.cuda:
            return "cuda"
        if func is torch.Tensor.to:
            device = device or next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if other is not None:
                return "cuda" if self.on_device(other) else "cpu"
        if device is None:
            return None
        return "cuda" if _is_cuda(device) else "cpu"

    def _move(self, func, args, kwargs, target: str):
        if func in (torch.Tensor.cpu, torch.Tensor.cuda):
            args, kwargs = args[:1], {}
            func = torch.Tensor.to
        args = tuple("cpu" if isinstance(a, (str, torch.device)) and _is_cuda(a) else a for a in args)
        args = tuple(a.detach() if isinstance(a, torch.Tensor) and i > 0 else a for i, a in enumerate(args))
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*args, **kwargs)  # the mode is off inside its own handler
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target == "cpu" and source is not None and self.on_device(source):
            self.reads += 1
        if isinstance(out, torch.Tensor) and source is not None and out.numel() \
                and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() \
                and self.on_device(source) != (target == "cuda"):
            out = out.clone()  # a real move copies; keep the two sides apart
        return self.put(out) if target == "cuda" else out
