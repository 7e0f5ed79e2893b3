"""The engine runs steps at full speed on its own thread; the UI takes them in batches and can stop it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specviz.apps.background import in_batches


class Steps:
    """A step generator that logs which steps started and on which thread it was closed."""

    def __init__(self, n: int, on_step=None):
        self.n, self.on_step = n, on_step
        self.started: list[int] = []
        self.closed_on: str | None = None

    def __iter__(self):
        try:
            for i in range(self.n):
                self.started.append(i)
                if self.on_step:
                    self.on_step(i)
                yield i
        finally:
            self.closed_on = threading.current_thread().name


def run(steps, stop=None, every_s=0.0):
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as engine:
        batches = list(in_batches(iter(steps), engine, stop or threading.Event(), every_s))
    return batches


def test_every_item_arrives_in_order_and_the_first_at_once():
    gate = threading.Event()
    steps = Steps(10, on_step=lambda i: gate.wait(10) if i == 1 else None)
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as engine:
        batches = in_batches(iter(steps), engine, threading.Event(), 60.0)
        assert next(batches) == [0]  # shown at once, while step 1 is still running
        gate.set()
        assert list(batches) == [list(range(1, 10))]  # the rest when the run ends, not a minute later
    assert steps.closed_on.startswith("engine")


def test_a_batch_is_shown_when_due_and_a_slow_step_is_waited_for():
    gates = [threading.Event() for _ in range(3)]
    steps = Steps(4, on_step=lambda i: gates[i - 1].wait(10) if i else None)
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as engine:
        batches = in_batches(iter(steps), engine, threading.Event(), 0.0)
        for i in range(3):
            assert next(batches) == [i]  # due at once: each item as soon as it exists
            gates[i].set()
        assert list(batches) == [[3]]


def test_stop_ends_the_run_after_the_step_in_progress():
    stop = threading.Event()
    steps = Steps(100, on_step=lambda i: stop.set() if i == 3 else None)  # Stop pressed during step 3
    batches = run(steps, stop)
    assert [i for b in batches for i in b] == [0, 1, 2, 3]  # step 3 finishes and is shown
    assert steps.started == [0, 1, 2, 3]  # no step starts after Stop
    assert steps.closed_on.startswith("engine")


def test_closing_the_consumer_stops_the_engine_within_a_step():
    gate = threading.Event()
    steps = Steps(100, on_step=lambda i: gate.wait(10) if i == 1 else None)
    engine = ThreadPoolExecutor(1, thread_name_prefix="engine")
    batches = in_batches(iter(steps), engine, threading.Event(), 0.0)
    assert next(batches) == [0]
    batches.close()  # Gradio closes the generator when a client cancels
    gate.set()
    engine.shutdown(wait=True)
    assert steps.started == [0, 1]
    assert steps.closed_on.startswith("engine")


def test_an_error_in_a_step_arrives_after_the_items_before_it():
    def failing():
        yield 1
        yield 2
        raise ValueError("step 3 broke")

    got = []
    with ThreadPoolExecutor(1) as engine, pytest.raises(ValueError, match="step 3 broke"):
        for batch in in_batches(failing(), engine, threading.Event(), 0.0):
            got += batch
    assert got == [1, 2]
