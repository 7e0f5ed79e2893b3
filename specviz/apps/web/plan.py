"""Checking and clamping a request before it runs: every out-of-range value is clamped and noted,
and a request that cannot run at all is a ``SettingsError`` with the reason."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field, fields

from drafters import METHODS
from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.protocol import Drafter
from specviz.core.target import TargetModel
from specviz.core.verify import MIN_TEMPERATURE, RULES, Sampling

from ..methods import split_label
from .joint import TAG as JOINT
from .joint import joint_settings
from .state import AppState

MAX_NEW_TOKENS = 512
MAX_METHODS = 40  # every column the page has (each method, copies at the paper setting and on a joint target)
SLIDER_MAX = 64  # the highest value a settings slider offers
MAX_SEED = 2**31 - 1
CHARS_PER_TOKEN = 8  # a prompt longer than this many characters per context token cannot fit (English is ~4)


def column_id(label: str) -> str:
    """The page element of ``label``'s column: ``col-eagle2``, ``col-eagle2-paper``."""
    return "col-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def column_labels(state: AppState) -> list[str]:
    """The Race tab's columns: every method, then each available method with a paper setting once more at it,
    then each method on the joint target (``--joint``)."""
    joint = [f"{m} ({JOINT})" for m in state.joint.state.drafters] if state.joint else []
    methods = [m for m in METHODS if m not in state.left_out]  # a method left out at start has no column
    return methods + [f"{m} (paper)" for m in state.drafters if METHODS[m][1].PAPER] + joint


def clamp(label: str, value, low, high, default, notes: list[str], cast=int):
    """``value`` within [low, high]; a missing or unreadable value (a string, a list, NaN) is the default.
    Notes every change."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN != NaN
        notes.append(f"{label}: {str(value)[:40]!r} is not a number; used {default}")
        return default
    if isinstance(value, int) and abs(value) > sys.float_info.max:  # too large for a float: clamped to its bound
        value = math.inf if value > 0 else -math.inf
    number = cast(value) if math.isfinite(value) else value  # ±inf is clamped to a bound
    kept = cast(min(max(number, low), high))
    if kept != number:
        notes.append(f"{label} clamped to {kept} (allowed {low} to {high})")
    return kept


@dataclass
class Plan:
    ids: list[int]
    drafters: dict[str, Drafter]
    sampling: Sampling
    max_new_tokens: int
    notes: list[str]
    expected: dict[str, float] = field(default_factory=dict)  # expected speedup, for methods at their tuned budget
    untuned: set[str] = field(default_factory=set)  # methods at defaults whose budget is not yet tuned here
    ar_tok_s: float | None = None  # AR's speed here when the machine was idle (the tuner's), if measured
    targets: dict[str, TargetModel] = field(default_factory=dict)  # labels on another target: the joint one

    def reference(self, label: str) -> str:
        """The AR column ``label`` is compared with: its own target's."""
        return f"ar ({JOINT})" if label in self.targets else "ar"


def plan_race(state: AppState, prompt: str, methods, max_new_tokens, temperature, top_p,
              settings: dict | None, rule: str = "auto", seed=0) -> Plan:
    """Check and clamp a request; raise SettingsError when nothing can run, else note what changed."""
    notes: list[str] = []
    if not isinstance(prompt, str) or not prompt.strip():
        raise SettingsError("The prompt is empty: type a question or pick an example.")
    if len(prompt) > (limit := CHARS_PER_TOKEN * state.target.max_length):  # before tokenising it: that is the cost
        raise SettingsError(f"The prompt has {len(prompt):,} characters; this target's context of "
                            f"{state.target.max_length:,} tokens takes at most {limit:,}.")
    if settings is not None and not isinstance(settings, dict):
        notes.append(f"settings must be a mapping of method to its settings; ignored {str(settings)[:40]!r}")
        settings = None
    if isinstance(methods, str):
        methods = [methods]
    if not isinstance(methods, (list, tuple)) or not all(isinstance(m, str) for m in methods):
        raise SettingsError("methods must be a list of method names")
    if len(methods) > MAX_METHODS:
        raise SettingsError(f"at most {MAX_METHODS} methods per race, got {len(methods)}")
    if rule not in (*RULES, "auto"):
        raise SettingsError(f"unknown acceptance rule {str(rule)[:40]!r}; choose auto, {', '.join(RULES)}")
    labels: dict[str, tuple[str, str | None]] = {}  # label -> (method, tag)
    for label in dict.fromkeys(methods):
        try:
            name, tag = split_label(label)
        except SettingsError as e:
            notes.append(str(e))
            continue
        if name not in METHODS:
            notes.append(f"{label}: unknown method (choose from {', '.join(METHODS)})")
        elif tag == JOINT and state.joint is None:
            notes.append(f"{label}: no jointly trained target here (start the app with --joint FOLDER)")
        elif tag == JOINT and name in state.joint.state.unavailable:
            notes.append(f"{label} is unavailable on the joint target: {state.joint.state.unavailable[name]}")
        elif tag != JOINT and name in state.unavailable:
            notes.append(f"{label} is unavailable: {state.unavailable[name]}")
        else:
            labels[label] = (name, tag)
    if not labels:
        raise SettingsError("Pick at least one available method. " + "; ".join(notes))
    temperature = clamp("temperature", temperature, 0.0, 2.0, 0.0, notes, float)
    if 0 < temperature < MIN_TEMPERATURE:
        notes.append(f"temperature {temperature:g} is below {MIN_TEMPERATURE}: used 0 (greedy)")
        temperature = 0.0
    top_p = clamp("top-p", top_p, 0.05, 1.0, 1.0, notes, float)
    ids = state.target.text.encode_chat(prompt)
    room = state.target.max_length - len(ids)
    if room < 1:
        raise SettingsError(f"The prompt has {len(ids)} tokens; the target's context is {state.target.max_length}.")
    max_new_tokens = clamp("max new tokens", max_new_tokens, 1, min(MAX_NEW_TOKENS, room), 128, notes)
    chosen, targets = {}, {}
    for label, (name, tag) in labels.items():
        limits = state.limits(name)
        given = (settings or {}).get(label) or {}
        if not isinstance(given, dict):
            notes.append(f"{label} settings must be a mapping of setting to number; ignored {str(given)[:40]!r}")
            given = {}
        for k in [k for k in given if k not in limits]:  # paths, model ids, dtypes: fixed when the server starts
            notes.append(f"{label} {k}: not a setting this page takes (it takes {', '.join(limits) or 'none'}); "
                         "ignored")
        here = state.joint.state if tag == JOINT else state
        start = joint_settings(state, state.joint, name) if tag == JOINT else state.preset(name, tag)
        clamped = {k: clamp(f"{label} {k}", v, *limits[k], start.get(k, limits[k][0]), notes)
                   for k, v in given.items() if k in limits}
        try:
            chosen[label] = here.drafter(name, {**start, **clamped})
            if here is not state:
                targets[label] = here.target
        except SpecvizError as e:
            notes.append(f"{label}: {e}")
    if not chosen:
        raise SettingsError("; ".join(notes))
    at_budget = {label: name for label, (name, _) in labels.items() if chosen.get(label) is state.drafters.get(name)}
    expected = {label: state.tuned[name].expected_speedup for label, name in at_budget.items()
                if name in state.tuned and state.tuned[name].settings}
    untuned = {label for label, name in at_budget.items() if state.untuned(name)}
    untuned |= {label for label in targets if state.untuned(labels[label][0])}  # a joint column takes the base budget
    seed = clamp("seed", seed, 0, MAX_SEED, 0, notes)  # a sampled race is the same race again at the same seed
    sampling = Sampling(temperature=temperature, top_p=top_p, rule=rule, seed=seed)  # greedy rule + T > 0: refused
    if not sampling.lossless:
        notes.append(f"the {sampling.resolved_rule} acceptance rule is lossy: outputs need not follow the target's "
                     "distribution")
    return Plan(ids, chosen, sampling, max_new_tokens, notes, expected, untuned, state.ar_tok_s, targets)


@dataclass
class SettingSpec:
    """One integer setting of one method, as a slider."""

    method: str
    name: str
    low: int
    high: int
    default: int


def setting_specs(state: AppState) -> list[SettingSpec]:
    """Every integer setting with a range of every available method, for the per-method accordions."""
    specs = []
    for method, (_, settings_cls) in METHODS.items():
        if method not in state.drafters:
            continue
        limits, defaults = state.limits(method), state.defaults(method)
        for f in fields(settings_cls):
            if f.name in limits and isinstance(f.default, int):
                low, high = limits[f.name]
                if low < high:  # a setting with one possible value gets no slider
                    specs.append(SettingSpec(method, f.name, low, min(high, SLIDER_MAX), defaults[f.name]))
    return specs


def slider_settings(specs: list[SettingSpec], values) -> dict[str, dict]:
    """The sliders' values as {method: {setting: value}}."""
    settings: dict[str, dict] = {}
    for spec, value in zip(specs, values):
        settings.setdefault(spec.method, {})[spec.name] = value
    return settings
