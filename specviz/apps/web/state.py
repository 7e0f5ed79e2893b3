"""The web app's state, built once in a function: the target, the drafters, why others are unavailable,
and the one engine thread every torch call runs on.

Torch on CPU ran at about half speed when Gradio's worker threads took turns (each thread its own
OpenMP team), so the engine is a single-thread executor.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from drafters import METHODS, build_drafter
from specviz.core.errors import SpecvizError
from specviz.core.load import load_target
from specviz.core.protocol import Drafter
from specviz.core.target import TargetModel, VerifyPadding

from ..tuning import Tuned, machine_costs, tune

MAX_BUILT = 32  # drafters kept at non-default settings (each setting is another network or tree: memory)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class AppState:
    target: TargetModel
    drafters: dict[str, Drafter] = field(default_factory=dict)  # available methods at their defaults
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it cannot run here
    configured: dict[str, dict] = field(default_factory=dict)  # per-method settings given at start
    engine: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="engine"))
    stops: dict[str, threading.Event] = field(default_factory=dict)  # each session's running race
    built: dict[tuple, Drafter] = field(default_factory=dict)
    tuned: dict[str, Tuned] = field(default_factory=dict)  # each method's budget for this machine
    padding: VerifyPadding | None = None  # the verify sizes this machine pads (measured with the budgets)
    cold_start_s: float = 0.0

    def on_engine(self, fn, *args, **kwargs):
        return self.engine.submit(fn, *args, **kwargs).result()

    def on_engine_thread(self, steps: Iterator) -> Iterator:
        """Advance a generator on the engine thread, one item at a time; closing it closes ``steps`` there."""
        done = object()
        try:
            while (item := self.on_engine(next, steps, done)) is not done:
                yield item
        finally:
            self.on_engine(steps.close)

    def defaults(self, name: str) -> dict:
        """The settings ``name`` starts with here: its defaults for this target, the budget tuned for this
        machine, then what was configured."""
        tuned = self.tuned[name].settings if name in self.tuned else {}
        return {**METHODS[name][1].defaults(self.target), **tuned, **self.configured.get(name, {})}

    def limits(self, name: str) -> dict[str, tuple]:
        return METHODS[name][1].limits(self.target)

    def tune_budgets(self) -> None:
        """Each method's budget for this machine (cached on disk after the first start, which says so)."""
        start = time.perf_counter()
        self.padding = machine_costs(self.target).padding
        if (took := time.perf_counter() - start) > 1:
            log(f"specviz: first start on this machine: measured the verify cost in {took:.0f} s; now each "
                "method's draft budget (about 10 s each, cached after this)")
        for name in METHODS:
            try:
                tuned = self.tuned[name] = tune(self.target, name, self.configured.get(name, {}))
            except Exception:  # noqa: BLE001 - load_drafters records why it cannot run
                continue
            if tuned.seconds:
                log(f"specviz: {name}: {tuned.settings or 'no budget'}, expected {tuned.expected_speedup:.2f}x AR "
                    f"(tuned in {tuned.seconds:.1f} s)")

    def load_drafters(self) -> None:
        """Every method at its defaults; a method that cannot be built is listed with its reason."""
        for name in METHODS:
            try:
                self.drafters[name] = build_drafter(name, self.target, **self.defaults(name))
            except SpecvizError as e:
                self.unavailable[name] = str(e)
            except Exception as e:  # noqa: BLE001 - a malformed checkpoint or card must not stop the app
                self.unavailable[name] = f"could not be built ({type(e).__name__}: {e})"

    def drafter(self, name: str, settings: dict) -> Drafter:
        """``name`` with ``settings``: the preloaded drafter at its defaults, else one built once and kept. One
        drafter serves every session's races at once (each decode has its own state), so the cache is keyed
        by the settings alone."""
        full = {**self.defaults(name), **settings}
        if full == self.defaults(name):
            return self.drafters[name]
        key = (name, tuple(sorted(full.items())))
        if key not in self.built:
            if len(self.built) >= MAX_BUILT:
                self.built.clear()
            self.built[key] = self.on_engine(build_drafter, name, self.target, **full)
        return self.built[key]


def load_state(target: str | None = None, dtype: str = "auto", device: str | None = None,
               assistant: str | None = None, warm_up=None, tune_budgets: bool = True,
               drafters: str | None = None) -> AppState:
    """Load the target, tune each method's budget (``tuning``) and load every drafter on the engine
    thread, then run ``warm_up(state)`` there. ``drafters``: a folder with a checkpoint subfolder per
    trained method, used instead of the shipped ones (drafters trained for another target)."""
    start = time.perf_counter()
    engine = ThreadPoolExecutor(1, thread_name_prefix="engine")
    model = engine.submit(load_target, target, dtype, device).result()
    configured = {"sps": {"assistant": assistant}} if assistant else {}
    if drafters:
        folder = Path(drafters)
        if not folder.is_dir():
            raise SpecvizError(f"--drafters {drafters}: no such folder")
        for name, (cls, _) in METHODS.items():
            if cls.trained and (folder / name).is_dir():
                configured[name] = {"checkpoint": str(folder / name)}
    state = AppState(model, configured=configured, engine=engine)
    if tune_budgets:
        state.on_engine(state.tune_budgets)
    state.on_engine(state.load_drafters)
    if warm_up is not None:
        state.on_engine(warm_up, state)
    state.cold_start_s = time.perf_counter() - start
    return state
