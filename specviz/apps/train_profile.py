"""Where a training step's time goes: ``profile --train``.

Each method (or variant) is set up exactly as ``train`` sets it up (``drafters.training.loop.set_up``) and takes
real optimizer steps (``train_step``, its phases timed as ``StepTimings``) on a seeded sample of a budget's
training sequences. The target's features are extracted for that sample alone, so no feature cache is needed
and a fresh machine can profile in a minute. Every method steps on the same batches, so the rows compare methods
(and two revisions of the code, run one after the other on one quiet machine); the projection to a whole run is
that run's step count times the mean step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from specviz.core.errors import SettingsError
from specviz.core.load import cache_dir
from specviz.core.timing import PhaseTimer

from .experiment_train import budget_config, budget_recipe
from .experiments import BUDGETS
from .machine import machine_description
from .training import training_classes

PHASES = ("taps", "forward", "backward", "optimizer")


@dataclass
class StepProfile:
    """One method's timed steps: mean ms per phase, and the tokens each step trained on."""

    method: str
    ms: dict[str, float]  # per phase of ``PHASES`` and "total"
    step_ms: list[float]  # each timed step's total, in order (their spread shows a noisy machine)
    answer_tokens: float  # positions the loss counted, per step
    padded_tokens: float  # the batch as padded, per step

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / (self.ms["total"] / 1000)


@dataclass
class TrainProfile:
    target: str
    device: str
    precision: str  # "bf16" autocast or "no"
    threads: int
    machine: str
    date: str
    data: str  # where the sampled sequences came from
    sequences: int  # how many were sampled
    batch_tokens: int
    warmup: int
    steps: int
    run_steps: int | None  # steps of a whole run at the budget, where its sequences are known
    rows: list[StepProfile] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        autocast = "bf16 autocast" if self.precision == "bf16" else "fp32"
        lines = [f"training step by phase, ms (mean of {self.steps} steps after {self.warmup} warm-up), {autocast}, "
                 f"{self.batch_tokens:,}-token batches, {self.device}, on {self.machine}",
                 f"  data: {self.sequences} sequences sampled from {self.data}",
                 f"  {'method':18} " + " ".join(f"{p:>9}" for p in (*PHASES, "total")) + "   answer tok/s"
                 + (f"   whole run ({self.run_steps:,} steps)" if self.run_steps else "")]
        for row in self.rows:
            line = f"  {row.method:18} " + " ".join(f"{row.ms[p]:9.1f}" for p in (*PHASES, "total"))
            line += f"   {row.tokens_per_s:12,.0f}"
            if self.run_steps:
                line += f"   {self.run_steps * row.ms['total'] / 3.6e6:8.2f} h"
            lines.append(line)
        spread = max((max(r.step_ms) - min(r.step_ms)) / r.ms["total"] for r in self.rows) if self.rows else 0
        lines.append(f"  the timed steps of one method differ by up to {spread:.0%} of its mean (their batches differ "
                     "in length; a larger spread means a noisy machine)")
        return "\n".join(lines)


def sample_sequences(target, recipe, need_tokens: int, seed: int = 0):
    """Training sequences summing to at least ``need_tokens`` tokens, drawn at random (seeded) from the budget's own
    where they were made for this target, else from ShareGPT's own answers (as ``--no-self-distill`` trains):
    (the sample, where it came from, and the budget's whole training split where it is known, else None)."""
    from drafters.training.sequences import DataRecipe, collect_sequences, find_sequences, load_sequences

    found = find_sequences(target, recipe, cache_dir() / "train")
    if found is not None:
        pool, source = load_sequences(found)["train"], f"{found.name} (the budget's training split)"
    else:  # a target of the user's own: no self-distilled sequences, and making them takes hours
        guess = max(64, need_tokens // 128)
        plain = DataRecipe(guess, False, recipe.max_prompt_tokens, recipe.max_new_tokens, prompts=recipe.prompts)
        pool, source = collect_sequences(target, plain)["train"], "ShareGPT's own answers (no self-distilled set here)"
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    picked, total = [], 0
    for i in order:
        if total >= need_tokens:
            break
        picked.append(pool[i])
        total += pool[i][0].numel()
    return picked, source, (pool if found is not None else None)


def whole_run_steps(pool, cfg) -> int:
    """Optimizer steps of a whole run over ``pool`` at ``cfg`` (the batches depend only on the lengths)."""
    from drafters.training.batches import length_batches

    lengths = [min(s.numel(), cfg.max_length) for s, _ in pool]
    return cfg.epochs * len(length_batches(lengths, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed)))


def profile_training(target, names: list[str], steps: int = 5, warmup: int = 1, precision: str | None = None,
                     budget: str = "shared", seed: int = 0) -> TrainProfile:
    """Time ``steps`` real training steps of each of ``names`` after ``warmup`` untimed ones, phase by phase, at
    ``budget``'s settings (``precision`` overrides its autocast), on a sample of its sequences."""
    from drafters.training.dataset import data_card, extraction_dtype
    from drafters.training.features import extract_features

    if steps < 1 or warmup < 0:
        raise SettingsError(f"--steps must be at least 1 and the warm-up at least 0, got {steps} and {warmup}")
    device = str(target.device)
    chosen = BUDGETS[budget]
    recipe, whole = budget_recipe(None, chosen, device), budget_config(chosen, device)
    # one pass over the sample: a whole run's step count comes from ``whole_run_steps``
    cfg = replace(whole, epochs=1, precision=precision or whole.precision)
    # twice the tokens the steps take: a length-bucketed sample that small pads about as a whole run does
    seqs, source, pool = sample_sequences(target, recipe, 2 * (steps + warmup) * cfg.batch_tokens, seed)
    data = extract_features(target, seqs, cfg.batch_tokens, desc=None, dtype=extraction_dtype(target, recipe))
    result = TrainProfile(target.name, device, cfg.mixed_precision, torch.get_num_threads(), machine_description(),
                          time.strftime("%Y-%m-%d"), source, len(seqs), cfg.batch_tokens, warmup, steps,
                          whole_run_steps(pool, whole) if pool is not None else None)
    result.rows = profile_steps(target, names, data, data_card(target, recipe), cfg, steps, warmup)
    return result


def profile_steps(target, names: list[str], data, meta: dict, cfg, steps: int, warmup: int) -> list[StepProfile]:
    """Each method set up as ``train`` sets it up on ``data`` (a FeatureSet) and ``cfg``, then ``warmup`` + ``steps``
    real steps, the last ``steps`` timed by phase. Every method takes the same batches (the plan is drawn from
    ``cfg.seed``), cycled where ``data`` holds fewer."""
    from drafters.training.loop import StepTimings, epoch_batches, make_accelerator, set_up, train_step
    from drafters.training.state import Progress

    rows = []
    for name, cls in training_classes(names).items():
        run = set_up(cls, target, data, cfg, meta, make_accelerator(cfg))
        progress, timings, answer, padded = Progress(running={}, history=[]), [], 0, 0
        batches = (b for _ in range(steps + warmup) for b in epoch_batches(run, data, run.plan[0], 0))
        for i, batch in zip(range(steps + warmup), batches):
            timer = PhaseTimer(target.device, StepTimings())
            train_step(run, batch, progress, timer)
            if i >= warmup:
                timings.append(timer.timings)
                answer += int(batch[2].sum())
                padded += batch[0].numel()
        ms = {p: 1000 * statistics.fmean(getattr(t, p) for t in timings) for p in PHASES}
        ms["total"] = sum(ms.values())
        rows.append(StepProfile(name, ms, [1000 * t.total for t in timings], answer / steps, padded / steps))
        run.accelerator.free_memory()
    return rows
