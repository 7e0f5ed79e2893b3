"""Run a step generator on a worker thread at full speed while a UI takes what it made in batches.

Yielding to Gradio after every step cost the embedded model about 40 % of its speed on 2 cores
(each yield is a message through the queue). Here the engine never waits for the UI: the UI drains
what has arrived at most every ``every_s`` seconds, and a stop flag ends the run after the step in
progress.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


@dataclass
class _Failed:
    error: BaseException


def in_batches(steps: Iterator[T], executor: Executor, stop: threading.Event, every_s: float) -> Iterator[list[T]]:
    """The items of ``steps``, run on ``executor``, in lists: the first at once, later ones at most every ``every_s``.

    Setting ``stop``, or closing this generator, ends ``steps`` after the step in progress (no further
    step starts). An error raised inside ``steps`` is raised here, after the items made before it.
    The consumer wakes for the first item, when a batch is due and when the run ends, never per item.
    """
    made: deque = deque()
    wake, hungry, closed = threading.Event(), threading.Event(), threading.Event()
    hungry.set()  # set while the consumer waits for the next item rather than for a batch to fall due

    def pump() -> None:
        try:
            while not (stop.is_set() or closed.is_set()):
                try:
                    item = next(steps)
                except StopIteration:
                    break
                made.append(item)
                if hungry.is_set():
                    hungry.clear()
                    wake.set()
        except BaseException as e:  # handed to the consumer's thread
            made.append(_Failed(e))
        finally:
            steps.close()
            made.append(_DONE)
            wake.set()

    executor.submit(pump)
    due: float | None = None  # None: waiting for the next item
    try:
        while True:
            wake.wait(None if due is None else max(0.0, due - time.perf_counter()))
            wake.clear()
            batch: list[T] = []
            while made:
                item = made.popleft()
                if item is _DONE:
                    if batch:
                        yield batch
                    return
                if isinstance(item, _Failed):
                    if batch:
                        yield batch
                    raise item.error
                batch.append(item)
            if batch:
                hungry.clear()
                yield batch
                due = time.perf_counter() + every_s
            else:  # due, and nothing came: wait for the next item (one made meanwhile is drained at once)
                due = None
                hungry.set()
                if made:
                    wake.set()
    finally:
        closed.set()
