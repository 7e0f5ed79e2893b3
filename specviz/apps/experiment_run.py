"""``python -m specviz experiment NAME``: train the arms an experiment needs at its budget, bench them, write its
results file, table and figure.

Resumable where it costs: each trained arm is a training run of its own in the cache (``train_drafters`` with
``resume``: a finished run is reused, a killed one goes on from its last saved state). The bench of all arms
runs in one process, every arm beside AR on the same prompts, once per temperature, and the results file is
rewritten after each temperature.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from drafters.checkpoint import read_card
from specviz.core.load import load_target
from specviz.core.verify import Sampling

from .bench import bench
from .experiment_results import ArmResult, ExperimentResult, Training
from .experiments import Budget, Experiment
from .machine import machine_description
from .questions import Question
from .training import data_recipe


def train_arms(exp: Experiment, budget: Budget, target, device: str) -> dict[str, Path]:
    """Each trained arm's checkpoint at ``budget``, trained now or found in the cache (``specviz train`` with the
    same settings finds the same runs)."""
    from drafters.training.config import TrainConfig

    from .training import train_drafters

    if not exp.trains:
        return {}
    recipe = data_recipe(budget.samples, True, budget.max_prompt_tokens, budget.answer_tokens, 32, budget.prompts,
                         budget.dtype, budget.dtype, device)
    precision = "bf16" if budget.dtype == "bfloat16" else "no"
    cfg = TrainConfig(epochs=budget.epochs, device=device, precision=precision, save_every=50)
    return train_drafters(exp.trains, target, recipe, cfg, None, resume=True, ship=False)


def _arm_result(arm, spec: str, temperature: float, summary, training: Training | None) -> ArmResult:
    return ArmResult(arm.label, spec, temperature, summary.tau, round(summary.speedup, 3),
                     round(summary.tokens_per_s, 2), summary.identical_to_ar, summary.prompts,
                     None if summary.alpha_conditional is None else [round(a, 3) for a in summary.alpha_conditional],
                     summary.mean_compression, arm.x, arm.train, training,
                     None if not summary.latency_ms else round(summary.latency_ms.get("draft", 0.0), 2))


def run_experiment(exp: Experiment, budget: Budget, questions: list[Question], question_set: str,
                   max_new_tokens: int, out: Path, target_spec: str | None = None, device: str = "cpu",
                   seed: int = 0) -> ExperimentResult:
    target = load_target(target_spec, "float32", device)
    folders = train_arms(exp, budget, target, device)
    training = {name: Training.from_card(read_card(folder)) for name, folder in folders.items()}
    specs = [arm.spec + (f":checkpoint={folders[arm.train]}" if arm.train else "") for arm in exp.arms]
    result = ExperimentResult(exp.name, exp.paper, exp.reproduces, exp.question,
                              budget.as_dict() if exp.trains else {}, f"{question_set}, {len(questions)} prompts",
                              max_new_tokens, machine_description(), time.strftime("%Y-%m-%d"), axis=exp.axis)
    for temperature in exp.temperatures:
        sampling = Sampling(temperature=temperature, seed=seed, rule="greedy" if temperature == 0 else "rejection")
        bench_result = bench(target, list(dict.fromkeys(specs)), questions, max_new_tokens, sampling)
        for arm, spec in zip(exp.arms, specs):
            result.arms.append(_arm_result(arm, spec, temperature, bench_result.methods[spec],
                                           training.get(arm.train)))
        result.save(out)
        print(f"{exp.name} T={temperature:g}: " + ", ".join(
            f"{a.label} τ {a.tau if a.tau is None else round(a.tau, 2)} {a.speedup:.2f}×"
            for a in result.arms if a.temperature == temperature), flush=True)
    result = replace(result, complete=True)
    result.save(out)
    return result
