"""The page first, tuning after: each method's budget measured on the engine thread between requests.

A first start on a fresh machine (a Space restarts on a fresh disk) would otherwise measure the verify-cost
curve and every method's budget before the page answers: minutes. Here the page serves at once with every
method at its untuned defaults, and the tuning runs as a chain of small jobs on the one engine thread: the
verify cost first, then one method at a time. Each job submits the next when it ends, so a request that
arrived meanwhile is already queued ahead of it and waits for at most one job (a method's tuning, about
ten seconds on a 2-core CPU; a budget cached on disk takes milliseconds). When a method is tuned its default
drafter is rebuilt at the new budget; races already running keep the drafter they started with.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from drafters import METHODS, build_drafter

from ..tuning import Tuned, machine_costs, tune

MODES = ("background", "now", "off")  # tune while serving, before serving, or never (untuned defaults)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class TuneProgress:
    """What the status line shows: which of ``total`` jobs are done and which one runs."""

    mode: str = "off"
    total: int = 0
    done: int = 0
    current: str = ""
    started: float = field(default_factory=time.perf_counter)
    finished_s: float | None = None  # seconds the whole tuning took, once it ended
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.mode != "background" or self.finished_s is not None

    def line(self) -> str:
        if self.mode == "off":
            return "Budgets: **untuned** defaults (tuning is off: `--tune off`)."
        if self.finished_s is not None:
            took = f" in {self.finished_s:.0f} s" if self.finished_s >= 1 else " (read from the cache)"
            failed = (f" Not tuned, so at **untuned** defaults: {', '.join(self.failed)}." if self.failed else "")
            return f"Budgets: tuned for this machine{took}.{failed}"
        doing = f", now {self.current}" if self.current else ""
        return (f"Budgets: measuring this machine in the background ({self.done} of {self.total} done{doing}, "
                f"{time.perf_counter() - self.started:.0f} s so far). Methods not yet tuned run at "
                "**untuned** defaults, and say so.")


def _jobs(state) -> list[str]:  # state: the app's ``AppState`` (which imports this module)
    return ["verify cost"] + [m for m in METHODS if m in state.drafters]


def _measure(state, job: str) -> Tuned | None:
    """Run one job: the verify cost (sets the state's padding; returns None) or one method's budget."""
    if job == "verify cost":
        costs = machine_costs(state.target)
        state.padding, state.ar_tok_s = costs.padding, 1000 / (costs.chain(1) + costs.ar_other_ms)
        return None
    tuned = tune(state.target, job, state.configured.get(job, {}))
    if tuned.seconds:
        log(f"specviz: {job}: {tuned.settings or 'no budget'}, expected {tuned.expected_speedup:.2f}x AR "
            f"(tuned in {tuned.seconds:.1f} s)")
    return tuned


def _tune_one(state, job: str) -> None:
    """One job while the page serves: a tuned method's default drafter is rebuilt at its budget, and becomes
    the default only once built."""
    tuned = _measure(state, job)
    if tuned is None:
        return
    if tuned.settings:
        state.drafters[job] = build_drafter(job, state.target, **state.defaults(job, tuned))
    state.tuned[job] = tuned


def start(state) -> None:
    """Tune every available method on the engine thread, one job at a time, while the page serves."""
    jobs = _jobs(state)
    progress = state.tuning = TuneProgress("background", total=len(jobs))

    def run(index: int) -> None:
        if index == len(jobs):
            progress.current, progress.finished_s = "", time.perf_counter() - progress.started
            log(f"specviz: budgets tuned in {progress.finished_s:.0f} s")
            return
        progress.current = jobs[index]
        try:
            _tune_one(state, jobs[index])
        except Exception as e:  # noqa: BLE001 - a method that cannot tune keeps its defaults; the chain goes on
            progress.failed[jobs[index]] = f"{type(e).__name__}: {e}"
            log(f"specviz: {jobs[index]}: not tuned ({type(e).__name__}: {e})")
        progress.done = index + 1
        state.engine.submit(run, index + 1)  # behind whatever request arrived meanwhile

    state.engine.submit(run, 0)


def tune_now(state) -> None:
    """Tune every method before the drafters are built (``--tune now``: each is then built once, at its budget).
    A method that cannot run here fails to tune too; building it then records why."""
    start_time = time.perf_counter()
    for job in ["verify cost", *(m for m in METHODS if m not in state.left_out)]:
        try:
            tuned = state.on_engine(_measure, state, job)
        except Exception:  # noqa: BLE001 - load_drafters records why a method cannot run
            continue
        if tuned is not None:
            state.tuned[job] = tuned
    state.tuning = TuneProgress("now", finished_s=time.perf_counter() - start_time)
