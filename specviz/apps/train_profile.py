"""Where a training step's time goes: ``profile --train``.

Each method (or variant) is set up exactly as ``train`` sets it up (``drafters.training.loop.set_up``) and takes
real optimizer steps (``train_step``, its phases timed as ``StepTimings``) on a few of a whole run's own batches,
spread over their lengths (``stratified``). The target's features are extracted for those batches alone, so no
feature cache is needed and a fresh machine profiles in minutes. Every method steps on the same batches, so the rows
compare methods (and two revisions of the code, run one after the other on one quiet machine); the projection to a
whole run is its step count times the mean step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from specviz.core.errors import SettingsError
from specviz.core.load import cache_dir
from specviz.core.timing import PhaseTimer

from .experiment_train import budget_config, budget_recipe, shipped_bases
from .experiments import BUDGETS, Budget, Experiment
from .machine import machine_description
from .train_profile_results import PHASES, StepProfile, TrainProfile
from .training import training_classes


def sequence_pool(target, recipe, enough: int):
    """The budget's training split where it was made for this target, else ShareGPT's own answers to about
    ``enough`` prompts (as ``--no-self-distill`` trains; self-distilling a new target's takes hours):
    (sequences, where they came from, whether they are the budget's own)."""
    from drafters.training.sequences import DataRecipe, collect_sequences, find_sequences, load_sequences

    found = find_sequences(target, recipe, cache_dir() / "train")
    if found is not None:
        return load_sequences(found)["train"], f"{found.name} (the budget's training split)", True
    if recipe.domain and not recipe.self_distilled:  # a slice's own answers: made in seconds, so made exactly
        return collect_sequences(target, recipe)["train"], f"ShareGPT's {recipe.domain} slice (its own answers)", True
    plain = DataRecipe(enough, False, recipe.max_prompt_tokens, recipe.max_new_tokens, prompts=recipe.prompts)
    return collect_sequences(target, plain)["train"], "ShareGPT's own answers (no self-distilled set here)", False


def run_batches(pool, cfg) -> list[list[int]]:
    """One epoch's batches of a whole run over ``pool`` at ``cfg``, as ``train`` draws them (indices into ``pool``)."""
    from drafters.training.batches import length_batches

    lengths = [min(s.numel(), cfg.max_length) for s, _ in pool]
    return length_batches(lengths, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed))


def stratified(batches: list[list[int]], pool, count: int) -> list[list[int]]:
    """``count`` of a run's ``batches`` spread evenly over their widths (shortest to longest), so the mean of their
    steps estimates a whole run's mean step: a step's cost turns on its batch's length (attention) and answer
    tokens (the head), and a few random batches miss that by far (their steps differ up to threefold)."""
    by_width = sorted(batches, key=lambda b: (max(pool[i][0].numel() for i in b), b))
    return [by_width[int((k + 0.5) * len(by_width) / count)] for k in range(count)]


def profile_training(target, classes: dict[str, type], steps: int = 5, warmup: int = 1, precision: str | None = None,
                     budget: str = "shared", exp: Experiment | None = None) -> TrainProfile:
    """Time ``steps`` real training steps of each of ``classes`` (training classes by label: ``training_classes``,
    ``arm_classes``) after ``warmup`` untimed ones, phase by phase, at ``budget``'s settings (``precision`` overrides
    its autocast) and on its data (``exp``'s domain slice where it has one), on ``steps`` of a whole run's own
    batches (``stratified``); the features are extracted for their sequences alone."""
    from drafters.training.dataset import data_card, extraction_dtype
    from drafters.training.features import extract_features

    if steps < 1 or warmup < 0:
        raise SettingsError(f"--steps must be at least 1 and the warm-up at least 0, got {steps} and {warmup}")
    device = str(target.device)
    chosen = BUDGETS[budget]
    recipe, cfg = budget_recipe(exp, chosen, device), budget_config(chosen, device)
    cfg = replace(cfg, precision=precision or cfg.precision)
    pool, source, own = sequence_pool(target, recipe, enough=32 * steps)
    whole = run_batches(pool, cfg)
    picked = stratified(whole, pool, min(steps, len(whole)))
    # in seeded random order: the timed steps also spread over the run's progress (``profile_steps``), and a late
    # objective term (HASS's Top-K) should not land on the longest batch alone
    chosen_batches = [picked[i] for i in torch.randperm(len(picked), generator=torch.Generator().manual_seed(0))]
    members = [i for b in chosen_batches for i in b]  # each batch's sequences, in order, become the sample
    seqs = [pool[i] for i in members]
    data = extract_features(target, seqs, cfg.batch_tokens, desc=None, dtype=extraction_dtype(target, recipe))
    batches, at = [], 0
    for b in chosen_batches:
        batches.append(list(range(at, at + len(b))))
        at += len(b)
    result = TrainProfile(target.name, device, cfg.mixed_precision, torch.get_num_threads(), machine_description(),
                          time.strftime("%Y-%m-%d"), source, len(seqs), cfg.batch_tokens, warmup, len(batches),
                          cfg.epochs * len(whole) if own else None)
    result.rows = profile_steps(target, classes, data, data_card(target, recipe), cfg, batches, warmup)
    return result


def profile_steps(target, classes: dict[str, type], data, meta: dict, cfg, batches: list[list[int]],
                  warmup: int) -> list[StepProfile]:
    """Each training class (by label) set up as ``train`` sets it up on ``data`` (a FeatureSet) and ``cfg``, then
    one real step on each of ``batches`` (lists of indices into ``data``), timed by phase, after ``warmup`` untimed
    steps on the first. Every class takes the same batches. Timed step k of n runs as if (k + 1/2) / n of the
    training were done, so an objective whose terms join late (HASS's Top-K, the last fifth) has them in its share
    of steps."""
    from drafters.training.batches import make_batch
    from drafters.training.loop import StepTimings, make_accelerator, set_up, train_step
    from drafters.training.state import Progress

    accelerator = make_accelerator(cfg)  # one for every method, as ``train`` shares one across drafters
    made = [make_batch(data, ids, cfg.max_length, accelerator.device) for ids in batches]  # the same for each
    answer = statistics.fmean(int(valid.sum()) for _, _, valid in made)
    padded = statistics.fmean(tokens.numel() for tokens, _, _ in made)
    rows = []
    for name, cls in classes.items():
        run = set_up(cls, target, data, cfg, meta, accelerator)
        progress, timings = Progress(running={}, history=[]), []
        for i, batch in enumerate([made[0]] * warmup + made):
            if i >= warmup:
                progress.step = int((i - warmup + 0.5) * run.total_steps / len(made))
            timer = PhaseTimer(accelerator.device, StepTimings())
            train_step(run, batch, progress, timer)
            if i >= warmup:
                timings.append(timer.timings)
        ms = {p: 1000 * statistics.fmean(getattr(t, p) for t in timings) for p in PHASES}
        ms["total"] = sum(ms.values())
        rows.append(StepProfile(name, ms, [1000 * t.total for t in timings], answer, padded))
        accelerator.free_memory()  # let go of this method's network and optimizer before the next
    return rows


def arm_classes(exp: Experiment, budget: Budget, target, device: str) -> dict[str, type]:
    """The training class of each arm ``exp`` trains at ``budget`` on ``device``, by its run's label (a joint arm:
    ``semi-attn-joint0.25``); an arm that benches a shipped checkpoint at that budget trains nothing."""
    from drafters.training.joint import JointOptions

    recipe, cfg = budget_recipe(exp, budget, device), budget_config(budget, device)
    shipped = shipped_bases(exp.trains, budget, target, recipe, cfg, quiet=True)
    classes = {}
    for name, lam in exp.trained_runs:
        if lam is None and name in shipped:
            continue
        cls = training_classes([name], None if lam is None else JointOptions(lam))[name]
        classes[name if lam is None else cls.variant_name] = cls
    return classes


def shared_prefixes(classes: dict[str, type], exp: Experiment, budget: Budget, target, device: str,
                    total: int | None) -> list[tuple]:
    """Per class of ``arm_classes``: (its shared prefix's folder, branch step, whether it is written), or None where
    its objective shares no prefix or the run's steps (``total``) are unknown (``drafters.training.prefix``)."""
    from drafters.training.prefix import branch_step
    from drafters.training.state import saved_state

    from .training import run_prefix

    recipe, cfg = budget_recipe(exp, budget, device), budget_config(budget, device)
    out = []
    for cls in classes.values():
        folder = run_prefix(cls, recipe.features_key(target), cfg)
        branch = branch_step(getattr(cls, "loss", None), total) if folder is not None and total else None
        out.append(None if branch is None else (folder, branch, saved_state(folder) is not None))
    return out
