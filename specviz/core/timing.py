"""Phase timers: wall time charged to named phases, synchronising CUDA before each clock reading."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PHASES = ("draft", "verify", "accept", "other")


@dataclass
class Timings:
    """Seconds per phase of one step: drafter compute, target forward, acceptance + cache commit, the rest."""

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.accept + self.other


def now(device: torch.device | str = "cpu") -> float:
    """perf_counter after the GPU has finished its queued work, so time lands in the right phase."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


class PhaseTimer:
    """``with timer("verify"): ...`` adds the block's wall time to ``timer.timings.verify``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = str(device)
        self.timings = Timings()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = now(self.device)
        try:
            yield
        finally:
            setattr(self.timings, phase, getattr(self.timings, phase) + now(self.device) - start)
