"""Stopping a training run between two steps: a signal asks, the run saves its state and stops.

A stop at any point in a step (Python raises ``KeyboardInterrupt`` wherever it is; SIGTERM's default ends the
process at once) loses every step since the last save, up to ``save_every`` of them: minutes on a CPU. Asked
this way, the run ends the step it is in, saves, and raises ``TrainingStopped``; the same command resumes it with
nothing lost.

Rules:
- SIGINT (Ctrl-C, a time limit) and SIGTERM (a plain ``kill``, a parent stopping its runs) ask; SIGKILL cannot.
- The first signal of a kind only asks. A second of the same kind acts as it did before (Ctrl-C twice breaks out
  of a step that hangs).
- Signals reach only the main thread: elsewhere nothing is installed, and a stop acts as it did before. A signal
  this process ignores (SIGINT, for a job a shell started in the background) stays ignored.
- The handlers found on entry are back on exit, however the body ends.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ASKING = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(KeyboardInterrupt):
    """The run was asked to stop, saved its state and stopped (a ``KeyboardInterrupt``: callers that end on
    Ctrl-C end on it too)."""


@dataclass
class StopRequest:
    signum: int | None = None  # the signal that asked, once one has

    @property
    def asked(self) -> bool:
        return self.signum is not None


@contextmanager
def stop_between_steps() -> Iterator[StopRequest]:
    """While the body runs, SIGINT and SIGTERM set the yielded request instead of stopping at once."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in ASKING}
    previous = {s: h for s, h in previous.items() if h not in (None, signal.SIG_IGN)}  # ignored stays ignored

    def ask(signum, frame) -> None:
        request.signum = signum
        signal.signal(signum, previous[signum])  # the next one of this kind acts as before

    try:
        for s in previous:
            signal.signal(s, ask)
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
