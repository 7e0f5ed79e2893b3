"""Run a step generator on a worker thread at full speed while a UI takes what it made in batches.

Yielding to Gradio after every step cost the embedded model about 40 % of its speed on 2 cores
(each yield is a message through the queue). Here the engine never waits for the UI: the UI drains
what has arrived at most every ``every_s`` seconds, and a stop flag ends the run after the step in
progress.
"""

from __future__ import annotations

import queue
import threading
import time
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
    """
    made: queue.SimpleQueue = queue.SimpleQueue()
    closed = threading.Event()

    def pump() -> None:
        try:
            while not (stop.is_set() or closed.is_set()):
                try:
                    item = next(steps)
                except StopIteration:
                    break
                made.put(item)
        except BaseException as e:  # handed to the consumer's thread
            made.put(_Failed(e))
        finally:
            steps.close()
            made.put(_DONE)

    executor.submit(pump)
    batch: list[T] = []
    shown: float | None = None
    try:
        while True:
            wait = None if not batch else max(0.0, shown + every_s - time.perf_counter())
            try:
                item = made.get(timeout=wait)
            except queue.Empty:  # a batch is due and nothing more came
                yield batch
                batch, shown = [], time.perf_counter()
                continue
            if item is _DONE:
                break
            if isinstance(item, _Failed):
                if batch:
                    yield batch
                raise item.error
            batch.append(item)
            if shown is None or time.perf_counter() - shown >= every_s:
                yield batch
                batch, shown = [], time.perf_counter()
        if batch:
            yield batch
    finally:
        closed.set()
