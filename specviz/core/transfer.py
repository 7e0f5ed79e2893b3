"""Copies between the host and a device: to it without waiting, from it in one read.

A blocking copy (``tensor.to("cuda")``) of a host tensor waits until every kernel already queued on the device has
run, then copies: one host sync per small input (ids, positions, a mask, a commit's row index), several a step. A
copy from pinned host memory can be queued instead: the host goes on, and the device copies in queue order. So a
host tensor bound for a GPU is first copied into pinned memory (PyTorch's pinned-memory cache keeps that block
until the device has read it, so the host tensor may change at once). From ordinary memory a non-blocking copy
may still wait, by the driver's rules. Copies off the device are never non-blocking here: the host reads them,
and each read waits for the device's queue, so what a step needs from the device is read in one copy (``to_host``).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU without waiting for the device's queue."""
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# the integer type a float tensor's bits are read as (``to_host``): same width, so a value comes back bit for bit
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host, each as it was (dtype, shape, every bit); those on a device read in one copy, one
    wait for the device's queue rather than one each. Integers and bits of floats travel as int64."""
    on_device = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    out = list(tensors)
    if not on_device:
        return out
    flat = [tensors[i].reshape(-1) for i in on_device]
    flat = [t.view(_BITS[t.dtype]) if t.dtype in _BITS else t for t in flat]
    read = torch.cat([t.long() for t in flat]).cpu()
    start = 0
    for i in on_device:
        t = tensors[i]
        part = read[start: start + t.numel()].view(t.shape)
        start += t.numel()
        out[i] = part.to(_BITS[t.dtype]).view(t.dtype) if t.dtype in _BITS else part.to(t.dtype)
    return out
