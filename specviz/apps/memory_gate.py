"""Memory shared by commands run side by side: which may start beside the running ones, and which stops when the
machine runs short.

Two training runs that each fit the machine may not fit it together: a joint arm holds the target's activations
for its backward pass, and two of them outgrew a 24 GiB machine, whose kernel killed one before its first save.

Rules:
- A command's *need* is the most resident memory it (with its children) has held, polled while it runs; before it
  has run here, what an earlier run of it held (``expected``, kept across runs by the caller); failing both, the
  largest need among the commands that have run (arms of one experiment are alike). With none of these, it is not
  known.
- A command starts beside others only when their needs and its own fit ``limit``. One whose need is not its own
  figure starts beside others only once each of them has *settled* (its peak unchanged for ``settle_s``), so the
  figure it borrows is a real peak, not a start-up's. With nothing running, the next command always starts.
- When several run and the machine's available memory falls below ``reserve``, the one started last is stopped (a
  training run ends its step and saves) and goes back to the head of the queue, its need now its own peak or the
  borrowed one, whichever is larger: it starts again when that fits, or alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psutil


def available_bytes() -> int:
    """Memory the machine can give without swapping (Linux's MemAvailable)."""
    return psutil.virtual_memory().available


def resident_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its children; 0 once it has gone."""
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


@dataclass
class MemoryGate:
    limit: int  # bytes the commands may need together
    reserve: int  # with several running, available memory below this stops the newest
    expected: dict[str, int] = field(default_factory=dict)  # a command's need from earlier runs
    settle_s: float = 120.0
    available: Callable[[], int] = available_bytes
    resident: Callable[[int], int] = resident_bytes
    peaks: dict[str, int] = field(default_factory=dict)  # what each command has held in this run
    _grew: dict[str, float] = field(default_factory=dict)  # when each running command's peak last grew

    @classmethod
    def for_machine(cls, expected: dict[str, int] | None = None, reserve_fraction: float = 0.08) -> MemoryGate:
        """A gate over the memory this machine has available now, keeping ``reserve_fraction`` of it all free."""
        reserve = int(psutil.virtual_memory().total * reserve_fraction)
        return cls(limit=max(0, available_bytes() - reserve), reserve=reserve, expected=dict(expected or {}))

    def own(self, name: str) -> int | None:
        """``name``'s own figure: the larger of its peak here and an earlier run's; None if it has neither."""
        figures = [v for v in (self.peaks.get(name), self.expected.get(name)) if v]
        return max(figures) if figures else None

    def need(self, name: str) -> int | None:
        own = self.own(name)
        if own is not None:
            return own
        return max(self.peaks.values(), default=None) or None

    def started(self, name: str, now: float) -> None:
        self._grew[name] = now
        self.peaks.setdefault(name, 0)

    def observe(self, running: dict[str, int], now: float) -> None:
        """Poll the resident memory of the running commands (name -> pid)."""
        for name, pid in running.items():
            held = self.resident(pid)
            if held > self.peaks.get(name, 0):
                self.peaks[name] = held
                self._grew[name] = now

    def settled(self, name: str, now: float) -> bool:
        return now - self._grew.get(name, now) >= self.settle_s

    def admits(self, name: str, running: list[str], now: float) -> bool:
        if not running:
            return True
        if self.own(name) is None and not all(self.settled(r, now) for r in running):
            return False
        return sum(self.need(r) or 0 for r in running) + (self.need(name) or 0) <= self.limit

    def short(self) -> bool:
        return self.available() < self.reserve

    def stopped(self, name: str) -> None:
        """``name`` was stopped for memory: from now on it needs at least what any command has held."""
        self.expected[name] = max(self.own(name) or 0, max(self.peaks.values(), default=0))


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
