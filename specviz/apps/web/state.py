"""The web app's state, built once in a function: the target, the drafters, why others are unavailable,
and the one engine thread every torch call runs on.

Torch on CPU ran at about half speed when Gradio's worker threads took turns (each thread its own
OpenMP team), so the engine is a single-thread executor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from drafters import METHODS, build_drafter
from drafters.captured import capture_drafters
from specviz.core.errors import SpecvizError
from specviz.core.load import load_target
from specviz.core.protocol import Drafter
from specviz.core.target import TargetModel, VerifyPadding

from ..tuning import Tuned
from . import tuner
from .built import BuiltDrafters, own_bytes
from .tuner import TuneProgress


@dataclass
class AppState:
    target: TargetModel
    drafters: dict[str, Drafter] = field(default_factory=dict)  # available methods at their defaults
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it cannot run here
    configured: dict[str, dict] = field(default_factory=dict)  # per-method settings given at start
    left_out: tuple[str, ...] = ()  # methods this app was started without (``--methods``): never built or tuned
    engine: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="engine"))
    stops: dict[str, threading.Event] = field(default_factory=dict)  # each session's running race
    built: BuiltDrafters = field(default_factory=BuiltDrafters)  # at non-default settings, bounded in bytes
    tuned: dict[str, Tuned] = field(default_factory=dict)  # each method's budget for this machine
    padding: VerifyPadding | None = None  # the verify sizes this machine pads (measured with the budgets)
    ar_tok_s: float | None = None  # AR's speed here as the tuner measured it on an idle engine
    cold_start_s: float = 0.0
    tuning: TuneProgress = field(default_factory=TuneProgress)  # the budgets' progress (``tuner``)
    joint: JointTarget | None = None  # a jointly trained target raced beside this one (``web.joint``)

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

    def defaults(self, name: str, tuned: Tuned | None = None) -> dict:
        """The settings ``name`` starts with here: its defaults for this target, the budget tuned for this
        machine (``tuned``, else the one recorded), then what was configured."""
        tuned = tuned or self.tuned.get(name)
        return {**METHODS[name][1].defaults(self.target), **(tuned.settings if tuned else {}),
                **self.configured.get(name, {})}

    def preset(self, name: str, tag: str | None = None) -> dict:
        """The settings a column of ``name`` starts from (``plan.split_label``): the paper's for the tag "paper",
        the settings class's own values (and what was configured) for "untuned", else ``defaults``."""
        if tag == "paper":
            return {**self.defaults(name), **METHODS[name][1].PAPER}
        if tag == "untuned":
            return {**METHODS[name][1].defaults(self.target), **self.configured.get(name, {})}
        return self.defaults(name)

    def limits(self, name: str) -> dict[str, tuple]:
        return METHODS[name][1].limits(self.target)

    @property
    def cannot_run(self) -> dict[str, str]:
        """The methods unavailable here for a reason the page explains: not those left out on purpose."""
        return {k: v for k, v in self.unavailable.items() if k not in self.left_out}

    def untuned(self, name: str) -> bool:
        """Whether ``name`` runs at its untuned defaults (tuning is off, still running, or failed for it)."""
        return name != "ar" and name not in self.tuned

    def load_drafters(self) -> None:
        """Every method at its defaults; a method that cannot be built is listed with its reason."""
        for name in METHODS:
            if name in self.left_out:
                self.unavailable[name] = "left out when this app started (`--methods`)"
                continue
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
        drafter = self.built.get(key)
        if drafter is None:
            drafter = self.on_engine(build_drafter, name, self.target, **full)
            shared = {p.untyped_storage().data_ptr() for p in self.target.model.parameters()}
            self.built.put(key, drafter, own_bytes(drafter, shared))
        return drafter


@dataclass
class JointTarget:
    """A joint checkpoint's adapted target beside the server's (``web.joint`` loads it)."""

    folder: Path  # the joint checkpoint
    method: str  # the method its drafter is for
    state: AppState  # the adapted target, its joint drafter and the training-free methods, untuned


def left_out_methods(methods: list[str] | None) -> tuple[str, ...]:
    """The methods an app started with ``methods`` goes without; an unknown name is an error, said at once."""
    if not methods:
        return ()
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SpecvizError(f"--methods: unknown method {', '.join(map(repr, unknown))} "
                           f"(choose from {', '.join(METHODS)})")
    return tuple(m for m in METHODS if m not in methods and m != "ar")


def load_state(target: str | None = None, dtype: str = "float32", device: str | None = None,
               assistant: str | None = None, warm_up=None, tune: str = "background",
               drafters: str | None = None, stage=None, checkpoints: dict[str, str] | None = None,
               methods: list[str] | None = None, engine: str = "eager") -> AppState:
    """Load the target and every drafter on the engine thread and run ``warm_up(state)`` there; then tune
    each method's budget (``tuning``) as ``tune`` says (``tuner.MODES``): "background" returns at once and
    tunes between requests, "now" before returning, "off" never. ``drafters``: a folder with a checkpoint
    subfolder per trained method, used instead of the shipped ones (drafters trained for another target);
    ``checkpoints``: method -> a folder or model-hub id, specviz's own or published (``--drafter``), which wins.
    ``methods``: the methods to load (``--methods``; ar always, as every column's reference), else all of them;
    the others are listed as unavailable, and neither built nor tuned, so the app starts and tunes sooner.
    ``stage(text)`` is told each stage as it starts (the starting page shows them). ``dtype`` defaults to float32,
    as the page does: a teaching app shows lossless methods giving the target's own text on any host. ``engine``
    (``TargetModel.use_engine``): "compiled" or "auto" compile the target's forwards on a thread while the page
    serves eager; background tuning then starts when compilation ends, so that it measures the path that runs."""
    if tune not in tuner.MODES:
        raise SpecvizError(f"tune must be one of {', '.join(tuner.MODES)}, got {tune!r}")
    left_out = left_out_methods(methods)
    stage = stage or (lambda text: None)
    start = time.perf_counter()
    executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
    stage(f"loading the target ({target or 'embedded'})")
    model = executor.submit(load_target, target, dtype, device).result()
    configured = {"sps": {"assistant": assistant}} if assistant else {}
    if drafters:
        folder = Path(drafters)
        if not folder.is_dir():
            raise SpecvizError(f"--drafters {drafters}: no such folder")
        for name, (cls, _) in METHODS.items():
            if cls.trained and (folder / name).is_dir():
                configured[name] = {"checkpoint": str(folder / name)}
    for name, source in (checkpoints or {}).items():  # a published one that cannot load makes the method unavailable
        configured[name] = {"checkpoint": source}
    state = AppState(model, configured=configured, engine=executor, left_out=left_out)
    if tune == "now":  # before the drafters are built, so each is built once, at its tuned budget
        stage("measuring each method's budget on this machine (--tune now)")
        tuner.tune_now(state)
    stage("building the drafters")
    state.on_engine(state.load_drafters)
    if warm_up is not None:
        stage("warming up every method")
        state.on_engine(warm_up, state)
    state.cold_start_s = time.perf_counter() - start
    then = (lambda: tuner.start(state)) if tune == "background" else None
    if engine != "eager":
        model.use_engine(engine, background=True, then=lambda: _after_compile(state, then))
    if then is not None and model.captured is None:  # eager, or nothing to compile here: tune now
        then()
    return state


def _after_compile(state: AppState, then) -> None:
    """On the compile thread, once the target's forwards are compiled: the loaded drafters' own (each serves eager
    until its graphs are ready), then ``then`` (the background tuner)."""
    if capture_drafters(state.target):
        for drafter in list(state.drafters.values()):
            drafter.capture_forwards(state.target)
    if then is not None:
        then()
