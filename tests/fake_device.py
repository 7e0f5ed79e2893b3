"""A CUDA device emulated on the CPU, strict as a real one about mixing devices.

``FakeCuda`` is a torch function mode: tensors "on the device" are CPU tensors whose storage it has
registered, and ``.device`` reports ``cuda:0`` for them. Moving to ``cuda`` (``.to``, ``device=`` in a
factory) registers a copy, moving to the CPU makes an unregistered one, and every op whose inputs
mix the two raises ``DeviceMix``, as CUDA would: a CPU index into a device tensor and 0-dim CPU
scalars are allowed; a device index into a CPU tensor, a CPU operand of a device op and a CPU
generator drawing device samples are not. Everything computed from a device tensor is on the device.
It lets the CPU-only suite run the engine and the drafters with the target "on a GPU".
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
DEVICE_GETTER = torch.Tensor.device.__get__
ALLOWED = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_, torch.Tensor.item,
           torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__getitem__}
METADATA = {"_has_compatible_shallow_copy_type", "__set__"}  # module.to(): compare, then swap ``param.data``


class DeviceMix(RuntimeError):
    """An op mixed CPU and device tensors: it would fail on a real GPU."""


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.kept: dict[int, torch.Tensor] = {}  # storage pointer -> a tensor holding it (so it is never reused)
        self.empty: dict[int, torch.Tensor] = {}  # empty device tensors, by id (they have no storage)

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
        kwargs = kwargs or {}
        if func == DEVICE_GETTER:  # a fresh method-wrapper each time: compared by ==
            return CUDA if self.on_device(args[0]) else torch.device("cpu")
        target = self._target_device(func, args, kwargs)
        if target is not None:
            return self._move(func, args, kwargs, target)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = [t for t in tensors if self.on_device(t)]
        if device and func not in ALLOWED and getattr(func, "__name__", "") not in METADATA:
            host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
            if func is torch.Tensor.__setitem__:  # into a device tensor the index may stay on the CPU
                value = args[2] if isinstance(args[2], torch.Tensor) and args[2].dim() > 0 else None
                host = [] if value is None or self.on_device(value) == self.on_device(args[0]) else [value]
                if not self.on_device(args[0]):
                    host += [t for t in tree_flatten(args[1])[0] if self.on_device(t)]
            if host:
                raise DeviceMix(f"{getattr(func, '__name__', func)} mixes cuda:0 and cpu tensors "
                                f"(shapes {[tuple(t.shape) for t in device]} and {[tuple(t.shape) for t in host]})")
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type != "cuda":
                raise DeviceMix(f"{getattr(func, '__name__', func)} draws device samples with a CPU generator")
        if func is torch.Tensor.__getitem__ and not self.on_device(args[0]) and device:
            raise DeviceMix("a CPU tensor indexed with device indices")
        out = func(*args, **kwargs)
        if device and func is not torch.Tensor.copy_:  # a copy stays where its destination is
            tree_map(lambda t: self.put(t) if isinstance(t, torch.Tensor) else t, out)
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
        if isinstance(out, torch.Tensor) and source is not None and out.numel() \
                and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() \
                and self.on_device(source) != (target == "cuda"):
            out = out.clone()  # a real move copies; keep the two sides apart
        return self.put(out) if target == "cuda" else out
