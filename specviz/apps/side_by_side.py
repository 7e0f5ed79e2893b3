"""Several commands run side by side, each with its own log, and stopped together.

Rules:
- At most ``jobs`` run at once; the rest wait in the given order and start as others end. A command may also
  wait to be ready (``ready``: a training run for the shared prefix another one is writing): the first ready
  one starts, and when none is ready and nothing runs, the first starts anyway.
- On a CPU each gets its share of the cores (``OMP_NUM_THREADS``), unless the user set that already: torch would
  give every process all of them, and the processes would fight over each core.
- With a ``gate`` (``memory_gate``), a command also waits until its memory fits beside the running ones, and
  the newest is stopped and queued again when the machine runs short; a command stopped so has not failed.
- However this process is stopped (an exception, Ctrl-C, a time limit's SIGINT, a plain ``kill``'s SIGTERM), the
  commands still running are stopped too (SIGTERM: a training run ends its step and saves), and waited for. Only
  a SIGKILL of this process leaves them running; a training run's lock (``drafters.training.lock``) then keeps a
  second trainer off its folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from specviz.core.cpu import usable_cores

from .memory_gate import MemoryGate, gib


def child_env(device: str, at_once: int) -> dict[str, str]:
    """The environment of one of ``at_once`` processes sharing this machine for work on ``device``."""
    env = dict(os.environ)
    if torch.device(device).type == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // at_once))
    return env


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # an exit runs ``finally`` blocks; Python's default SIGTERM runs none


@contextmanager
def sigterm_as_exit():
    """Within the body, SIGTERM exits through ``finally`` blocks (in the main thread; elsewhere, as before)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_side_by_side(commands: dict[str, list[str]], logs: dict[str, Path], jobs: int, device: str,
                     poll_s: float = 1.0, ready: dict[str, Callable[[], bool]] | None = None,
                     gate: MemoryGate | None = None) -> list[str]:
    """Run each named command, its output appended to its log, at most ``jobs`` at once (each once ``ready``
    says so, and once ``gate`` lets it in); returns the names of those that failed, in the order they ended."""
    queue, running, failed = list(commands), {}, []
    ready = ready or {}

    def next_up() -> str | None:
        waiting = [n for n in queue if n not in ready or ready[n]()]
        if gate is not None:
            waiting = [n for n in waiting if gate.admits(n, list(running), time.monotonic())]
        return waiting[0] if waiting else (queue[0] if queue and not running else None)

    def stop_newest() -> None:  # the machine is short of memory: the last one started waits for room
        name = max(running, key=lambda n: running[n][1])
        proc, _ = running.pop(name)
        proc.terminate()
        proc.wait()
        gate.stopped(name)
        queue.insert(0, name)
        print(f"{name}: stopped to free memory ({gib(gate.available())} left); it starts again when its "
              f"{gib(gate.expected[name])} fit", flush=True)
    env = child_env(device, min(jobs, len(commands)))
    with sigterm_as_exit():
        try:
            while queue or running:
                while queue and len(running) < jobs and (name := next_up()) is not None:
                    queue.remove(name)
                    with Path(logs[name]).open("a") as log:
                        proc = subprocess.Popen(commands[name], stdout=log, stderr=subprocess.STDOUT, env=env)
                    running[name] = (proc, time.monotonic())
                    if gate is not None:
                        gate.started(name, time.monotonic())
                time.sleep(poll_s)
                if gate is not None:
                    gate.observe({n: proc.pid for n, (proc, _) in running.items()}, time.monotonic())
                for name, (proc, start) in list(running.items()):
                    if proc.poll() is not None:
                        del running[name]
                        print(f"{name}: {'finished' if proc.returncode == 0 else f'failed ({proc.returncode})'} "
                              f"after {time.monotonic() - start:.0f} s", flush=True)
                        if proc.returncode:
                            failed.append(name)
                if gate is not None and len(running) > 1 and gate.short():  # only among those still running: an
                    stop_newest()  # ended one is not stopped and queued again, nor its failure lost
        finally:  # stopped: stop the commands too (a training run resumes from its last save)
            if running:
                print(f"stopping {', '.join(running)}", flush=True)
            for proc, _ in running.values():
                proc.terminate()
            for proc, _ in running.values():
                proc.wait()
    return failed
