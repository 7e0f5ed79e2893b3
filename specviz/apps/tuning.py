"""Each method's draft budget for this machine, target and dtype (``core.budget``), cached on disk.

First use measures the verify-cost curve (``profile``) and AR's own per-step overhead, then warms each
method up on eight held-out ShareGPT prompts at its largest budget (the acceptance every smaller budget would
have had follows, ``core.budget``) and times one draft alone at its shallowest and deepest budget (a
draft costs about one drafter pass per depth, so the depths between are interpolated). A grid whose
budgets are not nested (lookahead) is warmed up budget by budget instead. The results
are cached per machine, target, dtype, device and checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafters import METHODS, build_drafter
from drafters.checkpoint import default_path, weights_file
from drafters.trained import TrainedDrafter
from specviz.core.budget import Budget, Option, VerifyCurve, choose, estimate, padded_curve, padding
from specviz.core.engine import StepRecord, generate, output_ids, run
from specviz.core.errors import SettingsError
from specviz.core.load import cache_dir, cpu_flags, cpuinfo
from specviz.core.metrics import decode_steps
from specviz.core.protocol import DraftRequest
from specviz.core.target import TargetModel
from specviz.core.timing import now
from specviz.core.verify import Sampling

from .bench import machine_description
from .profile import profile

# Held-out chat prompts (never trained on, not the benchmarks'): τ varies so much from prompt to prompt
# (a standard deviation of 18-26 % of τ over an answer's first 32 tokens) that 8 short warm-ups estimate
# it better than 2 long ones for the same tokens generated.
WARMUP_FILE = Path(__file__).resolve().parents[2] / "assets" / "data" / "warmup_prompts.json"
WARMUP_PROMPTS = tuple(p["prompt"] for p in json.loads(WARMUP_FILE.read_text())["prompts"])
WARMUP_TOKENS = 16
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


def machine_key(target: TargetModel) -> str:
    on_cpu = target.device.type == "cpu"
    cpu = [cpuinfo("model name"), sorted(cpu_flags() & {"amx_bf16", "avx512_bf16", "avx2"})] if on_cpu else []
    facts = [machine_description(), *cpu, target.name, str(target.dtype), str(target.device), target.num_parameters,
             target.kernels]
    return hashlib.sha1(json.dumps(facts, default=str).encode()).hexdigest()[:12]


def _cached(name: str, make, refresh: bool = False):
    path = cache_dir() / "budgets" / f"{name}.json"
    if path.exists() and not refresh:
        try:
            return json.loads(path.read_text()), True
        except json.JSONDecodeError:
            pass  # a torn write: measure again
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
    return value, False


def _prompts(target: TargetModel) -> list[list[int]]:
    """The warm-up prompts as ids: those that leave room for the answer and a large tree in the context."""
    fits = [] if target.tokenizer is None else [ids for ids in map(target.encode_chat, WARMUP_PROMPTS)
                                                if len(ids) + WARMUP_TOKENS + 80 <= target.max_length]
    if fits:
        return fits
    gen = torch.Generator().manual_seed(0)  # a bare model or a tiny context: fixed pseudo-random ids
    return [torch.randint(0, target.vocab_size, (24,), generator=gen).tolist() for _ in WARMUP_PROMPTS]


def _draft_a_little(target: TargetModel, drafter) -> list[int]:
    """The first warm-up prompt and 4 tokens drafted after it, untimed: a GPU charges one-time set-up to a
    process's first drafts (the first trained drafter tuned on an H100 and an H200 came out 10x dearer
    per draft than the same network tuned next)."""
    ids = _prompts(target)[0]
    return ids + output_ids(list(generate(target, drafter, ids, 4)))


def _warm_up(target: TargetModel, drafter, prompts: int | None = None) -> list[StepRecord]:
    """The step records of ``drafter`` on the warm-up prompts (the first ``prompts`` of them)."""
    _draft_a_little(target, drafter)
    return [r for ids in _prompts(target)[:prompts]
            for r in run(target, drafter, ids, WARMUP_TOKENS, hover=False).records]


def _propose_ms(target: TargetModel, drafter, repeats: int = 5) -> float:
    """Median ms of one draft, alone, after a few tokens of the first warm-up prompt."""
    request = DraftRequest(_draft_a_little(target, drafter), 1 << 20, Sampling())
    times = []
    for _ in range(repeats):
        start = now(target.device)
        drafter.propose(request)
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


def machine_costs(target: TargetModel, refresh: bool = False) -> MachineCosts:
    """The verify-cost curves and AR's per-step overhead, measured once per machine and target. Sets
    ``target.padding``: the sizes its verifies pad, because a larger size is clearly cheaper here."""
    def measure() -> dict:
        sizes, context = (*range(1, 17), 24, 32, 48, 64), min(256, target.max_length - 80)
        curves = {shape: profile(target, context, sizes, repeats=5, tree=shape == "tree")["curve"]
                  for shape in ("chain", "tree")}
        ar = _warm_up(target, build_drafter("ar", target), prompts=2)  # AR's overhead per step: a few steps do
        return {**{shape: [[r["tokens"], r["ms"]] for r in c] for shape, c in curves.items()},
                "ar_other_ms": _per_step(ar, "draft", "accept", "other")}

    value, _ = _cached(f"costs-{machine_key(target)}", measure, refresh)
    target.padding = {shape: padding(*zip(*value[shape])) for shape in ("chain", "tree")}
    chain, tree = (padded_curve(*zip(*value[shape]), target.padding[shape]) for shape in ("chain", "tree"))
    return MachineCosts(chain, tree, value["ar_other_ms"])


def _checkpoint_id(name: str, settings: dict) -> str:
    if not issubclass(METHODS[name][0], TrainedDrafter):
        return ""
    weights = weights_file(Path(settings.get("checkpoint") or default_path(name)))  # not the card: bench edits it
    return hashlib.sha1(weights.read_bytes()).hexdigest()[:12] if weights is not None else "none"


def tune(target: TargetModel, name: str, given: dict | None = None, refresh: bool = False) -> Tuned:
    """The budget with the most expected tokens per second for ``name`` here (``given``: other settings)."""
    given = dict(given or {})
    grids = METHODS[name][1].budget_grids(target)
    if not grids:
        return Tuned(name, {}, 1.0, 1.0, 0.0)
    costs = machine_costs(target)  # measured once per machine: `refresh` re-measures the method, not the curve
    warm_up = [WARMUP_TOKENS, hashlib.sha1("".join(WARMUP_PROMPTS).encode()).hexdigest()[:8], ESTIMATOR]
    key = json.dumps([machine_key(target), name, sorted(given.items()), _checkpoint_id(name, given), warm_up],
                     default=str)

    def measure() -> dict:
        start, options = time.perf_counter(), []
        for grid in grids:
            if not grid.nested:  # each budget warmed up on its own: its τ, nodes and draft time as measured
                for settings, _, _ in grid.candidates():
                    records = _warm_up(target, build_drafter(name, target, **given, **settings))
                    options.append(Option(settings, estimate(records, 1 << 30, 1 << 30), _per_step(records, "draft"),
                                          _per_step(records, "accept", "other")))
                continue
            low, high = min(grid.depths), max(grid.depths)
            records = _warm_up(target, build_drafter(name, target, **given, **grid.settings(high)))
            ends = [_propose_ms(target, build_drafter(name, target, **given, **grid.settings(d))) for d in (low, high)]
            def propose(depth: float) -> float:  # a draft costs about one pass per depth: linear
                return ends[0] + (ends[1] - ends[0]) * (depth - low) / max(high - low, 1)

            observe = _observe_ms(records, propose, high)
            other = _per_step(records, "accept", "other")
            chain = grid.size_key is None and dict(grid.fixed).get("width", 1) == 1
            for settings, depth, size in grid.candidates():
                options.append(Option(settings, estimate(records, depth, size), observe + propose(depth), other, chain))
        best: Budget = choose(options, costs.chain, costs.ar_other_ms, costs.tree)
        return {**asdict(best), "seconds": time.perf_counter() - start}

    value, cached = _cached(f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}", measure, refresh)
    return Tuned(name, value["settings"], value["tokens_per_step"], value["expected_speedup"],
                 0.0 if cached else value["seconds"], value.get("phase_ms"))  # older caches lack the phases


def resolve(target: TargetModel, name: str, settings: dict) -> tuple[dict, Tuned | None]:
    """The settings a method runs with. ``preset``: tuned (the default, unless a budget setting is given),
    paper (the paper's setting) or fixed (the settings class's own values)."""
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
    tuned = tune(target, name, settings)
    return {**tuned.settings, **settings}, tuned
