"""Benchmarks (not tests): methods on a question set, every speed a ratio within one process.

Every method runs on the same prompts in the same process, interleaved prompt by prompt (the order rotates so
no method always runs first), and speedup is AR's time per token over the method's. ``hf`` and ``hf-pld`` run
transformers' own ``generate`` (``methods.HF_BASELINES``) as outside baselines. The loop yields typed results
(``results.BenchResult``) after every prompt; saving them and logging the runs for a resume is the caller's
(``runlog``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from drafters import build_drafter
from specviz.core.attention import transformers_attention
from specviz.core.cpu import usable_cores
from specviz.core.engine import StepRecord, margins, run
from specviz.core.errors import SettingsError
from specviz.core.metrics import TIE_TOLERANCE, compare, decode_steps, divergence, extra_memory_pct, token_margins
from specviz.core.packing import unpacked
from specviz.core.target import TargetModel, VerifyPadding
from specviz.core.timing import now
from specviz.core.verify import Sampling

from .machine import machine_description
from .methods import HF_BASELINES, is_baseline, parse_method, split_engine
from .questions import Question
from .results import BenchResult, DivergenceAt, MethodBudget, MethodRow, MethodSummary, PromptRow, RunSampling
from .tuning import machine_costs, resolved_budgets

SAMPLED_NOTE = "sampling: outputs differ from AR by design; compare distributions, not tokens"


@dataclass
class PromptRun:
    """One method on one prompt: what it generated, in how long, and its step records."""

    output: list[int]
    wall_s: float
    records: list[StepRecord] | None = None  # None for the HF baselines


Runner = Callable[[list[int]], PromptRun]


def _hf_runner(target: TargetModel, max_new_tokens: int, sampling: Sampling, extra: dict) -> Runner:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, **extra)
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)

    def go(ids: list[int]) -> PromptRun:
        start = now(target.device)
        with torch.inference_mode(), unpacked(target.model), transformers_attention(target.model):
            out = target.model.generate(torch.tensor([ids], device=target.device), **kwargs)
        wall = now(target.device) - start
        return PromptRun(out[0, len(ids):].tolist(), wall)

    return go


def _engine_runner(target: TargetModel, name: str, budget: MethodBudget, max_new_tokens: int,
                   sampling: Sampling, padding: VerifyPadding | None = None) -> tuple[Runner, int]:
    """The method at its budget (``tuning.resolved_budgets``) and its extra parameters. AR's runs keep each
    token's margin (``engine.margins``), which tells a near-tie from a clear divergence; no run computes more."""
    drafter = build_drafter(name, target, **budget.settings)
    observers = (margins,) if name == "ar" else ()

    def go(ids: list[int]) -> PromptRun:
        result = run(target, drafter, ids, max_new_tokens, sampling, observers=observers, padding=padding)
        return PromptRun(result.output_ids, result.wall_s, result.records)

    return go, drafter.num_parameters()


def bench(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
          sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
          on_prompt: Callable[[BenchResult], None] | None = None, runs: dict[str, list[PromptRun]] | None = None,
          budgets: dict[str, MethodBudget] | None = None) -> BenchResult:
    """Run every method on every question (AR always included as the reference).

    ``on_prompt`` gets the results so far after each prompt but the last, so a caller can save them
    and a killed run loses at most one prompt. Ctrl-C returns the prompts every method finished.
    ``runs`` is filled in place, and may hold a killed run's first prompts to resume it, with the ``budgets``
    those prompts ran at (see bench_steps)."""
    result = None
    try:
        for result in bench_steps(target, methods, questions, max_new_tokens, sampling, warmup, progress, runs,
                                  budgets):
            if on_prompt is not None and result.interrupted:
                on_prompt(result)
    except KeyboardInterrupt:
        if result is None:
            raise
    return result


def method_labels(methods: list[str]) -> list[str]:
    """The labels the bench runs, AR first when not listed (the reference for speedup and identical_to_ar)."""
    labels = [m.strip() for m in methods]
    for label in labels:
        parse_method(split_engine(label)[0])  # a wrong spec is refused before anything runs
    if len(set(labels)) != len(labels):
        raise SettingsError(f"a method is listed twice in {methods}")
    return labels if "ar" in labels else ["ar", *labels]


def _check_resumable(runs: dict[str, list[PromptRun]], labels: list[str], questions: list[Question]) -> int:
    """How many prompts ``runs`` holds for every label (0 for a fresh run); refuses a run of other methods."""
    if any(runs.values()) and set(runs) != set(labels):
        raise SettingsError(f"the run to resume has the methods {sorted(runs)}, not {sorted(labels)}")
    for label in labels:
        runs.setdefault(label, [])
    finished = len(runs["ar"])
    if finished > len(questions) or any(len(r) != finished for r in runs.values()):
        raise SettingsError(f"the run to resume has {finished} prompts per method; "
                            f"this question set has {len(questions)}")
    return finished


def bench_steps(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
                sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
                runs: dict[str, list[PromptRun]] | None = None,
                budgets: dict[str, MethodBudget] | None = None) -> Iterator[BenchResult]:
    """Yield the results so far after every prompt; all but the last are marked ``interrupted``.

    ``runs`` (method label → one PromptRun per question, in order) is filled in place; the questions
    it already holds, from an earlier run of the same methods, are kept and not run again. ``budgets`` (label →
    ``tuning.resolved_budgets``' record) fixes the engine methods' budgets; the rest are resolved here."""
    if not questions:
        raise SettingsError("no questions to run")
    sampling = sampling or Sampling()
    labels = method_labels(methods)
    budgets = dict(budgets or {})
    runners: dict[str, Runner] = {}
    extra_params: dict[str, int] = {}
    engine_methods, eager_labels = {}, set()
    for label in labels:
        spec, engine = split_engine(label)
        name, settings = parse_method(spec)
        if is_baseline(name) and engine is not None:
            raise SettingsError(f"{label}: transformers' generate has no engine to choose")
        if is_baseline(name):
            runners[label] = _hf_runner(target, max_new_tokens, sampling, {**HF_BASELINES[name], **settings})
            extra_params[label] = 0
            continue
        if label not in budgets:
            budgets.update(resolved_budgets(target, [label]))
        engine_methods[label] = name
        if engine == "eager":
            eager_labels.add(label)
    # tuned budgets were chosen for this machine's verify costs, padding included: their runs pad as priced
    padding = machine_costs(target).padding if any(budgets[label].tuned for label in engine_methods) else None
    for label, name in engine_methods.items():
        on = target.eager_view() if label in eager_labels else target
        runners[label], extra_params[label] = _engine_runner(on, name, budgets[label], max_new_tokens, sampling,
                                                             padding)
    runners = {label: runners[label] for label in labels}  # warmed up in the order listed
    prompts = [target.text.encode_chat(q.prompt) for q in questions]
    runs = runs if runs is not None else {}
    finished = _check_resumable(runs, labels, questions)
    if warmup and finished < len(questions):  # a resume with nothing left to run needs none
        for go in runners.values():
            go(prompts[0][:64])
    tolerance = TIE_TOLERANCE.get(dtype_name(target)) if sampling.greedy else None
    rows = [prompt_row(q, len(ids), {label: runs[label][i] for label in labels}, tolerance)
            for i, (q, ids) in enumerate(zip(questions[:finished], prompts))]

    def result() -> BenchResult:
        done = len(rows)
        categories = [q.category for q in questions[:done]]
        summaries = {label: method_summary(runs[label][:done], runs["ar"][:done], categories, tolerance,
                                           extra_memory_pct(extra_params[label], target.num_parameters),
                                           budgets.get(label), sampling)
                     for label in labels}
        return run_facts(target, max_new_tokens, sampling, summaries, list(rows), done < len(questions), padding)

    if finished == len(questions):  # resuming a run that had finished
        yield result()
    for q, ids in tqdm(list(zip(questions, prompts))[finished:], desc="bench", disable=not progress, unit="prompt",
                       initial=finished, total=len(questions)):
        shift = len(rows) % len(labels)  # rotate the order so no method always runs first
        ran = {label: runners[label](ids) for label in labels[shift:] + labels[:shift]}
        for label in labels:
            runs[label].append(ran[label])
        rows.append(prompt_row(q, len(ids), {label: ran[label] for label in labels}, tolerance))
        yield result()


def dtype_name(target: TargetModel) -> str:
    return str(target.dtype).replace("torch.", "")


def method_summary(runs: list[PromptRun], ar_runs: list[PromptRun], categories: list[str], tolerance: float | None,
                   extra_memory: float, budget: MethodBudget | None, sampling: Sampling) -> MethodSummary:
    summary = MethodSummary.from_dict(compare(runs, ar_runs, categories, tolerance))
    summary.extra_memory_pct, summary.budget = extra_memory, budget
    if not sampling.greedy:
        summary.identical_to_ar_note = SAMPLED_NOTE
    return summary


def run_facts(target: TargetModel, max_new_tokens: int, sampling: Sampling, methods: dict[str, MethodSummary],
              rows: list[PromptRow], interrupted: bool, padding: VerifyPadding | None = None) -> BenchResult:
    """The result with where and how it ran: the machine, the kernels, the verify padding, the cores."""
    return BenchResult(
        target=target.name, device=str(target.device), dtype=dtype_name(target), max_new_tokens=max_new_tokens,
        sampling=RunSampling(sampling.temperature, sampling.top_p, sampling.resolved_rule, sampling.lossless),
        date=time.strftime("%Y-%m-%d"), machine=machine_description(), methods=methods, per_prompt=rows,
        interrupted=interrupted,
        linear_kernels=target.kernels,  # hf runs on the default ones: transformers as its users get it
        verify_padding={shape: {str(n): m for n, m in pad.items()}
                        for shape, pad in (padding.as_dict() if padding else {}).items()},
        cores_used=usable_cores(),
        engine=str(target.engine), attention=getattr(target.config, "_attn_implementation", None))


def prompt_row(q: Question, prompt_tokens: int, done: dict[str, PromptRun], tolerance: float | None) -> PromptRow:
    """Every method's figures on one prompt, against AR's output on it."""
    ar = done["ar"]
    methods = {}
    for label, r in done.items():
        row = MethodRow(len(r.output), r.wall_s, r.output == ar.output)
        if tolerance is not None and r.output != ar.output:
            d = divergence(r.output, ar.output, token_margins(ar.records), tolerance)
            row.divergence = DivergenceAt(d.kind, d.at, d.gap)
        if r.records is not None:
            decode = decode_steps(r.records)
            row.steps, row.accepted_per_step = len(decode), [x.accepted for x in decode]
        methods[label] = row
    return PromptRow(q.id, q.category, prompt_tokens, methods)
