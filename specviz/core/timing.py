"""Phase timers: time charged to named phases of a decoding step.

On the CPU a phase's time is its wall time. On a CUDA device the timer records an event at each phase boundary and
reads them once, when the step's timings are read: a phase's time is how long the device's queue took to get from
its start to its end, which is the host's time where the device waits for the host and the device's where the host
waits for it. Synchronising at every boundary instead (as ``now`` does for a one-off measurement) would stop the
host from queuing ahead eight times a step, a cost the step itself does not have.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

PHASES = ("draft", "verify", "accept", "other")


@dataclass
class Phases:
    """Seconds per named phase: a subclass names its phases, each a float field."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass
class Timings(Phases):
    """Seconds per phase of one step: drafter compute, target forward, acceptance + cache commit, the rest."""

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    other: float = 0.0


def now(device: torch.device | str = "cpu") -> float:
    """perf_counter after the GPU has finished its queued work, so time lands in the right phase."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


class PhaseTimer:
    """``with timer("verify"): ...`` adds the block's time to ``timer.timings.verify`` (see the module's notes).

    ``timings``: where the seconds go (a decoding step's ``Timings`` unless given; a training step has its own
    ``Phases``)."""

    def __init__(self, device: torch.device | str = "cpu", timings: Phases | None = None):
        self.device = str(device)
        self._timings = Timings() if timings is None else timings
        self._events = self.device.startswith("cuda") and torch.cuda.is_available()
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((phase, start, end))
            return
        start_s = now(self.device)
        try:
            yield
        finally:
            setattr(self._timings, phase, getattr(self._timings, phase) + now(self.device) - start_s)

    @property
    def timings(self) -> Phases:
        """The phases so far; on CUDA their events are read here, after one wait for the last to be reached."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for phase, start, end in self._pending:
                setattr(self._timings, phase, getattr(self._timings, phase) + start.elapsed_time(end) / 1000)
            self._pending.clear()
        return self._timings
