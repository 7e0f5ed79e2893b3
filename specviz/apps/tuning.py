"""Each method's draft budget for this machine, target and dtype (``core.budget``), cached on disk.

First use measures the verify-cost curve (``profile``) and AR's own per-step overhead, then warms each
method up on eight held-out ShareGPT prompts at its largest budget (the acceptance every smaller budget would
have had follows, ``core.budget``) and times one draft alone at its shallowest and deepest budget (a
draft costs about one drafter pass per depth, so the depths between are interpolated). A grid whose
budgets are not nested (lookahead) is warmed up budget by budget instead. The results
are cached per machine, target, dtype, device and checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from drafters import METHODS, build_drafter
from drafters.checkpoint import default_path, weights_file
from drafters.trained import TrainedDrafter
from specviz.core.budget import Budget, Option, VerifyCurve, choose, estimate, padded_curve, padding
from specviz.core.engine import StepRecord, generate, output_ids, run
from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.files import atomic_write, content_key
from specviz.core.load import cache_dir
from specviz.core.metrics import decode_steps
from specviz.core.protocol import DraftRequest
from specviz.core.target import TargetModel, VerifyPadding
from specviz.core.timing import now
from specviz.core.verify import Sampling

from .machine import machine_key
from .methods import is_baseline, parse_method, split_engine
from .profile import profile
from .results import MethodBudget

# Held-out chat prompts (never trained on, not the benchmarks'): τ varies so much from prompt to prompt
# that 8 short warm-ups estimate it better than 2 long ones for the same tokens generated.
WARMUP_FILE = Path(__file__).resolve().parents[2] / "assets" / "data" / "warmup_prompts.json"
WARMUP_TOKENS = 16
SHIPPED_BUDGETS = Path(__file__).resolve().parents[2] / "budgets"
ESTIMATOR = 3  # how a budget's costs are estimated: a cached budget from another version is measured again
PRESETS = ("tuned", "paper", "fixed")  # the machine's budget, the paper's setting, the dataclass values


@dataclass
class Tuned:
    method: str
    settings: dict
    expected_tau: float
    expected_speedup: float
    seconds: float  # time the tuning took (0 when read from the cache)
    phase_ms: dict[str, float] | None = None  # expected ms per step: draft, verify, accept+other

    def expected_ms_per_token(self) -> dict[str, float]:
        """The expected phase split per token, comparable with a bench's measured one."""
        return {k: v / self.expected_tau for k, v in (self.phase_ms or {}).items()}

    @property
    def slower_than_ar(self) -> bool:
        return self.expected_speedup < 1.0

    def describe(self) -> str:
        if not self.settings:
            return f"{self.method}: no budget to tune (it runs at its own settings)"
        budget = ", ".join(f"{k} {v}" for k, v in self.settings.items())
        verdict = " (still slower than AR on this machine)" if self.slower_than_ar else ""
        return (f"{self.method}: {budget}; expected τ {self.expected_tau:.2f}, "
                f"{self.expected_speedup:.2f}x AR{verdict}")


@cache
def warmup_prompts() -> tuple[str, ...]:
    """The held-out warm-up prompts, read on first use (importing the tuner reads no file)."""
    return tuple(p["prompt"] for p in json.loads(WARMUP_FILE.read_text())["prompts"])


def budget_folders() -> list[Path]:
    """Where budgets are read, in order: this machine's cache (the only one written), then the folders
    ``SPECVIZ_BUDGETS`` names (separated by ``os.pathsep``; by default the repository's ``budgets/``). A Space
    ships there the budgets ``tune --export`` wrote on its own hardware class, so a restart on a fresh disk
    starts tuned. A file is named by its key (machine, target, dtype, device, checkpoint), so budgets from
    other hardware are never read."""
    shipped = os.environ.get("SPECVIZ_BUDGETS")
    others = [Path(p) for p in shipped.split(os.pathsep) if p] if shipped is not None else [SHIPPED_BUDGETS]
    return [cache_dir() / "budgets", *others]


def _found(name: str) -> Path | None:
    return next((path for folder in budget_folders() if (path := folder / f"{name}.json").is_file()), None)


def _cached(name: str, make, refresh: bool = False):
    path = None if refresh else _found(name)
    if path is not None:
        try:
            return json.loads(path.read_text()), True
        except (json.JSONDecodeError, OSError):
            pass  # a torn write or an unreadable file: measure again
    value = make()
    try:
        atomic_write(cache_dir() / "budgets" / f"{name}.json", json.dumps(value))
    except OSError as error:  # a read-only or full disk: use what was measured; the next start measures again
        print(f"specviz: a budget could not be cached ({error.strerror or error}); it is used all the same",
              file=sys.stderr, flush=True)
    return value, False


def _prompts(target: TargetModel) -> list[list[int]]:
    """The warm-up prompts as ids: those that leave room for the answer and a large tree in the context."""
    fits = [] if target.text.tokenizer is None else [ids for ids in map(target.text.encode_chat, warmup_prompts())
                                                if len(ids) + WARMUP_TOKENS + 80 <= target.max_length]
    if fits:
        return fits
    gen = torch.Generator().manual_seed(0)  # a bare model or a tiny context: fixed pseudo-random ids
    return [torch.randint(0, target.vocab_size, (24,), generator=gen).tolist() for _ in warmup_prompts()]


def _draft_a_little(target: TargetModel, drafter, padding: VerifyPadding | None = None) -> tuple[list[int], object]:
    """The first warm-up prompt and 4 tokens drafted after it, untimed, and the drafter's state after them: a GPU
    charges one-time set-up to a process's first drafts (the first trained drafter tuned on a GPU came out far
    dearer per draft than the same network tuned next)."""
    ids, state = _prompts(target)[0], drafter.start()
    return ids + output_ids(list(generate(target, drafter, ids, 4, state=state, padding=padding))), state


def _warm_up(target: TargetModel, drafter, prompts: int | None = None,
             padding: VerifyPadding | None = None) -> list[StepRecord]:
    """The step records of ``drafter`` on the warm-up prompts (the first ``prompts`` of them)."""
    _draft_a_little(target, drafter, padding)
    return [r for ids in _prompts(target)[:prompts]
            for r in run(target, drafter, ids, WARMUP_TOKENS, padding=padding).records]


def _propose_ms(target: TargetModel, drafter, repeats: int = 5, padding: VerifyPadding | None = None) -> float:
    """Median ms of one draft, alone, after a few tokens of the first warm-up prompt."""
    ids, state = _draft_a_little(target, drafter, padding)
    request = DraftRequest(ids, 1 << 20, Sampling())
    times = []
    for _ in range(repeats):
        start = now(target.device)
        drafter.propose(state, request)
        times.append(1000 * (now(target.device) - start))
    return statistics.median(times)


def _observe_ms(records: list[StepRecord], propose: Callable[[float], float], depth: int) -> float:
    """ms per step of feeding the drafter what was accepted: each warm-up step's draft time less its own
    proposal's, drafted ``depth`` deep or as deep as the warm-up's tokens left allowed (near the end of
    a warm-up they cap it: subtracting the full depth's proposal there undercounted this)."""
    spent, produced = [], 0
    for r in records:
        if r.step == 0:  # a prefill starts the next warm-up prompt
            produced = 0
        else:
            cap = min(depth, WARMUP_TOKENS - produced - 1)
            spent.append(1000 * r.timings.draft - (propose(cap) if cap > 0 else 0.0))
        produced += len(r.tokens)
    return max(statistics.fmean(spent), 0.0) if spent else 0.0


def _per_step(records: list[StepRecord], *phases: str) -> float:
    steps = decode_steps(records)
    return 1000 * sum(getattr(r.timings, p) for r in steps for p in phases) / max(len(steps), 1)


@dataclass(frozen=True)
class MachineCosts:
    """As measured, with this machine's padding applied (``core.budget.padding``), fitted non-decreasing."""

    chain: VerifyCurve  # ms to verify n tokens as a chain (plain causal attention)
    tree: VerifyCurve  # ... as a tree (a 4D mask: another attention path, slower on some CPUs)
    ar_other_ms: float  # AR's own per-step overhead besides the verify
    padding: VerifyPadding = VerifyPadding()  # the sizes worth verifying as a larger one here: pass it to decodes


BATCH_SIZES_MEASURED = (1, 2, 4, 8, 16, 32, 64)  # tokens per sequence in a batch's verify-cost curve


def machine_costs(target: TargetModel, refresh: bool = False, batch: int = 1) -> MachineCosts:
    """The verify-cost curves, AR's per-step overhead and the verify padding (the sizes a larger size is clearly
    cheaper than), measured once per machine and target. Decodes pad only when given ``padding``.

    At ``batch`` B > 1 the curve is one forward verifying n tokens in each of B sequences, divided by B: what
    one sequence pays in a full batch (a batch pads nothing; AR's overhead per step is its own, as alone)."""
    if batch > 1:
        alone = machine_costs(target)
        context = min(256, target.max_length - 80)
        value, _ = _cached(f"{_costs_file(target)}-batch{batch}", lambda: {"tree": [
            [r["tokens"], r["ms"]] for r in profile(target, context, BATCH_SIZES_MEASURED, repeats=3, tree=True,
                                                    batch=batch)["curve"]]}, refresh)
        tokens, ms = zip(*value["tree"])
        shared = VerifyCurve.fit(tokens, [m / batch for m in ms])
        return MachineCosts(shared, shared, alone.ar_other_ms)

    def measure() -> dict:
        sizes, context = (*range(1, 17), 24, 32, 48, 64), min(256, target.max_length - 80)
        curves = {shape: profile(target, context, sizes, repeats=5, tree=shape == "tree")["curve"]
                  for shape in ("chain", "tree")}
        ar = _warm_up(target, build_drafter("ar", target), prompts=2)  # AR's overhead per step: a few steps do
        return {**{shape: [[r["tokens"], r["ms"]] for r in c] for shape, c in curves.items()},
                "ar_other_ms": _per_step(ar, "draft", "accept", "other")}

    value, _ = _cached(_costs_file(target), measure, refresh)
    pad = VerifyPadding(*(padding(*zip(*value[shape])) for shape in ("chain", "tree")))
    chain, tree = (padded_curve(*zip(*value[shape]), pad.as_dict()[shape]) for shape in ("chain", "tree"))
    return MachineCosts(chain, tree, value["ar_other_ms"], pad)


def _costs_file(target: TargetModel) -> str:
    return f"costs-{machine_key(target)}"


def _budget_file(target: TargetModel, name: str, given: dict, batch: int = 1) -> str:
    warm_up = [WARMUP_TOKENS, content_key("".join(warmup_prompts()).encode(), 8), ESTIMATOR]
    key = [machine_key(target), name, sorted(given.items()), _checkpoint_id(name, given), warm_up]
    return f"{name}-{content_key(key if batch == 1 else [*key, batch])}"


def _checkpoint_id(name: str, settings: dict) -> str:
    if not issubclass(METHODS[name][0], TrainedDrafter):
        return ""
    weights = weights_file(Path(settings.get("checkpoint") or default_path(name)))  # not the card: bench edits it
    return content_key(weights.read_bytes()) if weights is not None else "none"


def tune(target: TargetModel, name: str, given: dict | None = None, refresh: bool = False, batch: int = 1) -> Tuned:
    """The budget with the most expected tokens per second for ``name`` here (``given``: other settings). At
    ``batch`` B > 1: for each of B sequences decoding together, priced at the batch's verify cost per sequence
    (a full batch makes every verified token dearer, so the budget shrinks as B grows); the warm-ups run alone,
    since what a method accepts and what its draft costs do not depend on the batch."""
    given = dict(given or {})
    grids = METHODS[name][1].budget_grids(target)
    if not grids:
        return Tuned(name, {}, 1.0, 1.0, 0.0)
    alone = machine_costs(target)  # measured once per machine: `refresh` re-measures the method, not the curve
    costs = alone if batch == 1 else machine_costs(target, batch=batch)

    def measure() -> dict:
        start, options = time.perf_counter(), []
        for grid in grids:
            if not grid.nested:  # each budget warmed up on its own: its τ, nodes and draft time as measured
                for settings, _, _ in grid.candidates():
                    records = _warm_up(target, build_drafter(name, target, **given, **settings), padding=alone.padding)
                    options.append(Option(settings, estimate(records, 1 << 30, 1 << 30), _per_step(records, "draft"),
                                          _per_step(records, "accept", "other")))
                continue
            low, high = min(grid.depths), max(grid.depths)
            drafter = build_drafter(name, target, **given, **grid.settings(high))
            records = _warm_up(target, drafter, padding=alone.padding)
            ends = [_propose_ms(target, build_drafter(name, target, **given, **grid.settings(d)), padding=alone.padding)
                    for d in (low, high)]
            def propose(depth: float) -> float:  # a draft costs about one pass per depth: linear
                return ends[0] + (ends[1] - ends[0]) * (depth - low) / max(high - low, 1)

            observe = _observe_ms(records, propose, high)
            other = _per_step(records, "accept", "other")
            chain = grid.size_key is None and dict(grid.fixed).get("width", 1) == 1
            for settings, depth, size in grid.candidates():
                options.append(Option(settings, estimate(records, depth, size), observe + propose(depth), other, chain))
        best: Budget = choose(options, costs.chain, costs.ar_other_ms, costs.tree)
        return {**asdict(best), "seconds": time.perf_counter() - start}

    value, cached = _cached(_budget_file(target, name, given, batch), measure, refresh)
    return Tuned(name, value["settings"], value["tokens_per_step"], value["expected_speedup"],
                 0.0 if cached else value["seconds"], value.get("phase_ms"))  # older caches lack the phases


def resolve(target: TargetModel, name: str, settings: dict, batch: int = 1) -> tuple[dict, Tuned | None]:
    """The settings a method runs with. ``preset``: tuned (the default, unless a budget setting is given: for
    ``batch`` sequences at a time), paper (the paper's setting) or fixed (the settings class's own values)."""
    settings = dict(settings)
    preset = settings.pop("preset", None)
    settings_cls = METHODS[name][1]
    if preset is not None and preset not in PRESETS:
        raise SettingsError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if preset == "paper":
        return {**settings_cls.PAPER, **settings}, None
    budget_keys = set().union(*(g.keys for g in settings_cls.budget_grids(target))) if preset != "fixed" else set()
    if preset == "fixed" or not budget_keys or budget_keys & set(settings):
        return settings, None
    tuned = tune(target, name, settings, batch=batch)
    return {**tuned.settings, **settings}, tuned


def resolved_budgets(target: TargetModel, methods: list[str]) -> dict[str, MethodBudget]:
    """What each engine method's budget will be (its settings, and the tuner's expectations when tuned; read
    from the cache when tuned before). A run log keeps them, so a resumed run runs every method as its first
    prompts did even when the cache was lost and a new tuning would choose otherwise."""
    budgets = {}
    for label in (m.strip() for m in methods):
        spec, engine = split_engine(label)  # "engine=eager": the method on the eager path, at that path's budget
        name, settings = parse_method(spec)
        if is_baseline(name):
            continue
        settings, tuned = resolve(target.eager_view() if engine == "eager" else target, name, settings)
        budgets[label] = MethodBudget(settings) if tuned is None else MethodBudget(
            settings, True, tuned.expected_tau, tuned.expected_speedup, tuned.expected_ms_per_token())
    return budgets


def export_budgets(target: TargetModel, names: list[str], folder: Path,
                   given: dict[str, dict] | None = None) -> list[Path]:
    """Copy the verify costs and the budgets of ``names`` (at their default settings, or ``given[name]``) into
    ``folder``, for a Space to ship (``budget_folders``). Tune first: only what is measured is exported."""
    folder.mkdir(parents=True, exist_ok=True)
    written, given = [], given or {}
    for file in [_costs_file(target), *(_budget_file(target, n, given.get(n, {})) for n in names)]:
        if (found := _found(file)) is not None and found.parent.resolve() != folder.resolve():
            written.append(Path(shutil.copy2(found, folder / found.name)))
    return written


def tune_and_report(target: TargetModel, names: list[str], refresh: bool = False,
                    export: Path | None = None) -> None:
    """``python -m specviz tune``: the machine's verify-cost curves, then each method's budget, printed;
    with ``export``, the files are copied there too (``export_budgets``)."""
    costs = machine_costs(target, refresh)
    for shape, curve in (("chain", costs.chain), ("tree", costs.tree)):
        print(f"verify cost of a {shape}, fitted non-decreasing ({str(target.dtype).replace('torch.', '')}, "
              f"{target.device}): " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in zip(curve.tokens, curve.ms)))
    print(f"AR's own per-step overhead {costs.ar_other_ms:.1f} ms")
    for shape, pad in costs.padding.as_dict().items():
        print(f"{shape}s padded to a size this machine verifies faster: "
              + (", ".join(f"{n} -> {m}" for n, m in pad.items()) or "none"))
    for name in names:
        try:
            tuned = tune(target, name, refresh=refresh)
        except SpecvizError as e:
            print(f"{name}: not tuned ({e})")
            continue
        took = f"  [tuned in {tuned.seconds:.1f} s]" if tuned.seconds else "" if not tuned.settings else "  [cached]"
        print(tuned.describe() + took)
    if export is not None:
        written = export_budgets(target, names, export)
        print(f"exported {len(written)} budget files to {export} (ship them with SPECVIZ_BUDGETS={export})")
