"""One trainer per run folder: a second process training the same run would save over the first one's state.

Two trainers on one run happen easily: a command started twice, or a parent killed while the children it started
go on training (a SIGKILL runs no handler). Each saves its own weights into the one ``state`` folder in turn, so
the run resumes from whichever wrote last, and neither run is the one its key names.

Rules:
- The lock is an advisory ``flock`` on ``<run>/lock``, held for as long as the trainer runs. The kernel lets go of
  it when the process ends, however it ends, so a killed run never leaves a stale lock behind.
- A second trainer stops before it sets up anything, with an error naming the process that holds the run.
- The file holds the holder's process id, for that message only; the lock, not the file, is what counts.
- Where ``fcntl`` is missing (Windows), nothing is locked, and no run has a holder.
- ``holder`` asks without waiting: it takes a shared lock for an instant, so a trainer starting in that instant
  is refused (and says so); start it again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specviz.core.errors import SpecvizError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

LOCK = "lock"


class RunBusy(SpecvizError):
    """Another process is training this run now."""


@contextmanager
def run_lock(work: Path) -> Iterator[None]:
    """Hold ``work``'s lock while the body trains; raise ``RunBusy`` at once if another process holds it."""
    if fcntl is None:
        yield
        return
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _written_id(fd)
            who = f"process {pid}" if pid > 0 else "a process that is starting"
            raise RunBusy(f"{work} is being trained now by {who}: stop that one first (or wait for it); two "
                          "trainers on one run would each save over the other's state") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor lets go of the lock


def holder(work: Path) -> int | None:
    """The process training in ``work`` now, or None when none is."""
    path = Path(work) / LOCK
    if fcntl is None or not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _written_id(fd)
        return None
    finally:
        os.close(fd)


def _written_id(fd: int) -> int:
    """The holder's process id as it wrote it; -1 while it has not yet."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else -1
