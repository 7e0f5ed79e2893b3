"""``python -m specviz experiment NAME``: train the arms an experiment needs at its budget, bench them, write its
results file, table and figure.

Resumable where it costs: each trained arm is a training run of its own in the cache (``experiment_train``: a
finished run is reused, a killed one goes on from its last saved state). The arms that share a
target are benched in one process, each beside that target's AR on the same prompts, once per temperature; an
arm trained jointly (a LoRA on the target) is benched on its adapted target, beside that target's own AR. The
results file is rewritten after each bench.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from drafters.checkpoint import REPO, read_card
from specviz.core.files import cache_dir
from specviz.core.load import load_target
from specviz.core.verify import Sampling

from .bench import PromptRun, bench
from .domain_eval import rouge_l
from .experiment_results import ArmResult, ExperimentResult, Training
from .experiment_train import train_arms
from .experiments import Arm, Budget, Experiment
from .machine import machine_description
from .questions import Question


def recorded(spec: str) -> str:
    """``spec`` as a results file keeps it: a checkpoint in the repository by its path there, one in the cache
    as ``$SPECVIZ_CACHE/...``, so a shipped file names no machine's folders."""
    for root, name in ((cache_dir(), "$SPECVIZ_CACHE/"), (REPO, "")):
        spec = spec.replace(f"checkpoint={root.resolve()}/", f"checkpoint={name}").replace(
            f"checkpoint={root}/", f"checkpoint={name}")
    return spec


def _arm_result(arm: Arm, spec: str, temperature: float, summary, training: Training | None,
                quality: float | None) -> ArmResult:
    return ArmResult(arm.label, recorded(spec), temperature, summary.tau, round(summary.speedup, 3),
                     round(summary.tokens_per_s, 2), summary.identical_to_ar, summary.prompts,
                     None if summary.alpha_conditional is None else [round(a, 3) for a in summary.alpha_conditional],
                     summary.mean_compression, arm.x, arm.train, training,
                     None if not summary.latency_ms else round(summary.latency_ms.get("draft", 0.0), 2),
                     quality, arm.lam)


def target_quality(target, runs: list[PromptRun], references: list[str] | None) -> float | None:
    """Mean Rouge-L of the target's own answers (AR's outputs) against the references, where there are some."""
    if not references:
        return None
    scores = [rouge_l(target.text.decode(r.output), ref) for r, ref in zip(runs, references)]
    return round(sum(scores) / len(scores), 4)


def run_experiment(exp: Experiment, budget: Budget, questions: list[Question], question_set: str,
                   max_new_tokens: int, out: Path, target_spec: str | None = None, device: str = "cpu",
                   seed: int = 0, references: list[str] | None = None, trained_on: str | None = None,
                   jobs: int = 1, allow_slow_bf16: bool = False) -> ExperimentResult:
    target = load_target(target_spec, "float32", device)
    folders = train_arms(exp, budget, target, device, trained_on, jobs=jobs, target_spec=target_spec,
                         allow_slow_bf16=allow_slow_bf16)
    training = {key: Training.from_card(read_card(folder)) for key, folder in folders.items()}
    specs = [arm.spec + (f":checkpoint={folders[arm.train, arm.lam]}" if arm.train else "") for arm in exp.arms]
    groups: dict[Path | None, list[int]] = {}  # the adapted target's folder (None: the base) -> its arms
    for i, arm in enumerate(exp.arms):
        groups.setdefault(None if arm.lam is None else folders[arm.train, arm.lam] / "target", []).append(i)
    trained = exp.trains or exp.joint
    result = ExperimentResult(exp.name, exp.paper, exp.reproduces, exp.question,
                              budget.as_dict() | ({"domain": exp.domain} if exp.domain else {}) if trained else {},
                              f"{question_set}, {len(questions)} prompts", max_new_tokens, machine_description(),
                              time.strftime("%Y-%m-%d"), axis=exp.axis)
    for temperature in exp.temperatures:
        sampling = Sampling(temperature=temperature, seed=seed, rule="greedy" if temperature == 0 else "rejection")
        done: dict[int, ArmResult] = {}
        for folder, arms in groups.items():
            own = target if folder is None else load_target(str(folder), "float32", device)
            runs: dict[str, list[PromptRun]] = {}
            bench_result = bench(own, list(dict.fromkeys(specs[i] for i in arms)), questions, max_new_tokens,
                                 sampling, runs=runs)
            quality = target_quality(own, runs["ar"], references) if temperature == 0 else None
            for i in arms:
                arm = exp.arms[i]
                done[i] = _arm_result(arm, specs[i], temperature, bench_result.methods[specs[i]],
                                      training.get((arm.train, arm.lam)), quality)
        result.arms.extend(done[i] for i in sorted(done))
        result.save(out)
        print(f"{exp.name} T={temperature:g}: " + ", ".join(
            f"{a.label} τ {a.tau if a.tau is None else round(a.tau, 2)} {a.speedup:.2f}×"
            for a in result.arms if a.temperature == temperature), flush=True)
    result = replace(result, complete=True)
    result.save(out)
    return result
