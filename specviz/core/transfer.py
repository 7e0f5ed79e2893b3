"""Host-to-device copies that do not wait for the device.

A blocking copy (``tensor.to("cuda")``) of a host tensor waits until every kernel already queued on the device has
run, then copies: one host sync per small input (ids, positions, a mask, a commit's row index), several a step. A
copy from pinned host memory can be queued instead: the host goes on, and the device copies in queue order. So a
host tensor bound for a GPU is first copied into pinned memory (PyTorch's pinned-memory cache keeps that block
until the device has read it, so the host tensor may change at once). From ordinary memory a non-blocking copy
may still wait, by the driver's rules. Copies off the device are never non-blocking here: the host reads them.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU without waiting for the device's queue."""
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
