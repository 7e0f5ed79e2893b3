"""Benchmarks (not tests): methods on a question set, every speed a ratio within one process.

Every method runs on the same prompts in the same process, interleaved prompt by prompt, and
speedup is AR's time per token over the method's. ``hf`` and ``hf-pld`` run transformers' own
``generate`` (plain, and with ``prompt_lookup_num_tokens=10``) as outside baselines.
"""

from __future__ import annotations

import json
import lzma
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from drafters import build_drafter, parse_spec
from drafters.checkpoint import CARD, default_path, read_card, shareable_path, update_card
from specviz.core import xzfile
from specviz.core.engine import StepRecord, run
from specviz.core.errors import SettingsError
from specviz.core.metrics import TIE_TOLERANCE, compare, decode_steps, divergence, extra_memory_pct, token_margins
from specviz.core.packing import unpacked
from specviz.core.target import TargetModel
from specviz.core.timing import now
from specviz.core.verify import Sampling

from .questions import Question

HF_BASELINES = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}


def parse_method(spec: str) -> tuple[str, dict]:
    """A method spec as the CLI takes it: any drafter, or one of transformers' own baselines."""
    return parse_spec(spec, extra=HF_BASELINES)


@dataclass
class PromptRun:
    output: list[int]
    wall_s: float
    records: list[StepRecord] | None = None  # None for the HF baselines


def _hf_runner(target: TargetModel, max_new_tokens: int, sampling: Sampling, extra: dict) -> Callable:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, **extra)
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)

    def go(ids: list[int]) -> PromptRun:
        start = now(target.device)
        with torch.inference_mode(), unpacked(target.model):
            out = target.model.generate(torch.tensor([ids], device=target.device), **kwargs)
        wall = now(target.device) - start
        return PromptRun(out[0, len(ids):].tolist(), wall)

    return go


def resolved_budgets(target: TargetModel, methods: list[str]) -> dict[str, dict]:
    """What each engine method's budget will be (``settings``, and the tuner's expectations when tuned; read from
    the cache when tuned before). A run log keeps them, so a resumed run runs every method as its first prompts
    did even when the cache was lost and a new tuning would choose otherwise."""
    from .tuning import resolve

    budgets = {}
    for label, (name, settings) in ((m.strip(), parse_method(m)) for m in methods):
        if name in HF_BASELINES:
            continue
        settings, tuned = resolve(target, name, settings)
        budgets[label] = {"settings": settings}
        if tuned is not None:
            budgets[label].update(tuned=True, expected_tau=tuned.expected_tau,
                                  expected_speedup=tuned.expected_speedup,
                                  expected_ms_per_token=tuned.expected_ms_per_token())
    return budgets


def _engine_runner(target: TargetModel, name: str, budget: dict, max_new_tokens: int,
                   sampling: Sampling) -> tuple[Callable, int]:
    """The method at its budget (``resolved_budgets``) and its extra parameters."""
    drafter = build_drafter(name, target, **budget["settings"])

    def go(ids: list[int]) -> PromptRun:
        result = run(target, drafter, ids, max_new_tokens, sampling, hover=False)
        return PromptRun(result.output_ids, result.wall_s, result.records)

    return go, drafter.num_parameters()


def bench(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
          sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
          on_prompt: Callable[[dict], None] | None = None, runs: dict[str, list[PromptRun]] | None = None,
          budgets: dict[str, dict] | None = None) -> dict:
    """Run every method on every question (AR always included as the reference).

    ``on_prompt`` gets the results so far after each prompt but the last, so a caller can save them
    and a killed run loses at most one prompt. Ctrl-C returns the prompts every method finished.
    ``runs`` is filled in place, and may hold a killed run's first prompts to resume it, with the ``budgets``
    those prompts ran at (see bench_steps)."""
    results = None
    try:
        for results in bench_steps(target, methods, questions, max_new_tokens, sampling, warmup, progress, runs,
                                   budgets):
            if on_prompt is not None and results["interrupted"]:
                on_prompt(results)
    except KeyboardInterrupt:
        if results is None:
            raise
    return results


def bench_steps(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
                sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
                runs: dict[str, list[PromptRun]] | None = None,
                budgets: dict[str, dict] | None = None) -> Iterator[dict]:
    """Yield the results so far after every prompt; all but the last are marked ``interrupted``.

    ``runs`` (method label → one PromptRun per question, in order) is filled in place; the questions
    it already holds, from an earlier run of the same methods, are kept and not run again. ``budgets`` (label →
    ``resolved_budgets``' record) fixes the engine methods' budgets; the rest are resolved here."""
    if not questions:
        raise SettingsError("no questions to run")
    sampling = sampling or Sampling()
    specs = [parse_method(m) for m in methods]
    labels = [m.strip() for m in methods]
    if len(set(labels)) != len(labels):
        raise SettingsError(f"a method is listed twice in {methods}")
    if "ar" not in labels:  # AR is the reference for speedup and identical_to_ar
        specs.insert(0, ("ar", {}))
        labels.insert(0, "ar")
    budgets = dict(budgets or {})
    runners, extra = {}, {}
    for label, (name, settings) in zip(labels, specs):
        if name in HF_BASELINES:
            runners[label] = _hf_runner(target, max_new_tokens, sampling, {**HF_BASELINES[name], **settings})
            extra[label] = 0
        else:
            if label not in budgets:
                budgets.update(resolved_budgets(target, [label]))
            runners[label], extra[label] = _engine_runner(target, name, budgets[label], max_new_tokens, sampling)
    prompts = [target.encode_chat(q.prompt) for q in questions]
    results = runs if runs is not None else {}
    if any(results.values()) and set(results) != set(labels):
        raise SettingsError(f"the run to resume has the methods {sorted(results)}, not {sorted(labels)}")
    for label in labels:
        results.setdefault(label, [])
    finished = len(results["ar"])
    if finished > len(questions) or any(len(r) != finished for r in results.values()):
        raise SettingsError(f"the run to resume has {finished} prompts per method; "
                            f"this question set has {len(questions)}")
    if warmup and finished < len(questions):  # a resume with nothing left to run needs none
        for go in runners.values():
            go(prompts[0][:64])
    tolerance = TIE_TOLERANCE.get(str(target.dtype).replace("torch.", "")) if sampling.greedy else None
    per_prompt = [_row(q, len(ids), {label: results[label][i] for label in labels}, tolerance)
                  for i, (q, ids) in enumerate(zip(questions[:finished], prompts))]

    def report(interrupted: bool) -> dict:
        categories = [q.category for q in questions[: len(per_prompt)]]
        summary = {}
        for label in labels:
            done = len(per_prompt)
            summary[label] = compare(results[label][:done], results["ar"][:done], categories, tolerance)
            summary[label]["extra_memory_pct"] = extra_memory_pct(extra[label], target.num_parameters)
            if label in budgets:
                summary[label]["budget"] = budgets[label]
            if not sampling.greedy:
                summary[label]["identical_to_ar_note"] = ("sampling: outputs differ from AR by design; "
                                                          "compare distributions, not tokens")
        return {
            "target": target.name,
            "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""),
            "max_new_tokens": max_new_tokens,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "rule": sampling.resolved_rule,
                         "lossless": sampling.lossless},
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_description(),
            "linear_kernels": target.kernels,  # hf runs on the default ones: transformers as its users get it
            "verify_padding": {shape: {str(n): m for n, m in pad.items()} for shape, pad in target.padding.items()},
            "cores_used": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "interrupted": interrupted,
            "methods": summary,
            "per_prompt": list(per_prompt),
        }

    remaining = list(zip(questions, prompts))[finished:]
    if not remaining:  # resuming a run that had finished
        yield report(False)
    for q, ids in tqdm(remaining, desc="bench", disable=not progress, unit="prompt", initial=finished,
                       total=len(questions)):
        shift = len(per_prompt) % len(labels)  # rotate the order so no method always runs first
        ran = {label: runners[label](ids) for label in labels[shift:] + labels[:shift]}
        done = {label: ran[label] for label in labels}
        for label in labels:
            results[label].append(done[label])
        per_prompt.append(_row(q, len(ids), done, tolerance))
        yield report(len(per_prompt) < len(questions))


def _row(q: Question, prompt_tokens: int, done: dict[str, PromptRun], tolerance: float | None) -> dict:
    row = {"id": q.id, "category": q.category, "prompt_tokens": prompt_tokens, "methods": {}}
    ar = done["ar"]
    for label, r in done.items():
        entry = {"new_tokens": len(r.output), "wall_s": r.wall_s, "identical_to_ar": r.output == ar.output}
        if tolerance is not None and r.output != ar.output:
            d = divergence(r.output, ar.output, token_margins(ar.records), tolerance)
            entry["divergence"] = {"kind": d.kind, "at": d.at, "gap": d.gap}
        if r.records is not None:
            decode = decode_steps(r.records)
            entry["steps"] = len(decode)
            entry["accepted_per_step"] = [x.accepted for x in decode]
        row["methods"][label] = entry
    return row


def markdown_rows(header: list[str], rows: list[str]) -> str:
    """A Markdown table from its column names and its rows ('' when there are no rows)."""
    if not rows:
        return ""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows])


def exactness_text(m: dict) -> str:
    """'8/8', or with near-ties and clear divergences counted apart: '5/8 (+3 near-ties, 0 clear)'."""
    text = f"{m['identical_to_ar']}/{m['prompts']}"
    e = m.get("exactness")
    if e and (e["near-tie"] or e["clear"]):
        text += f" (+{e['near-tie']} near-tie{'s' * (e['near-tie'] != 1)}, {e['clear']} clear)"
    return text


def machine_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"{platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def machine_fingerprint() -> str:
    """What speed depends on, without the thread count (a pinned part and the full run share one machine)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        names = {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")}
    except OSError:
        names = set()
    model = ", ".join(sorted(names)) or platform.processor() or platform.machine()
    return f"{model} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"


def save_results(path: Path, results: dict) -> None:
    """Write ``results`` as JSON, xz-compressed when ``path`` ends in ``.xz``; atomically, so a kill mid-write
    leaves the previous version."""
    data = json.dumps(results, indent=1).encode()
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(xzfile.compress_for(path, data))
    partial.replace(path)


def load_results(path: Path) -> dict:
    if not path.exists():
        raise SettingsError(f"no results file {str(path)!r}")
    try:
        return json.loads(xzfile.read_bytes(path))
    except (lzma.LZMAError, EOFError, ValueError) as e:
        raise SettingsError(f"{path} is not a bench results file ({e})") from None


def merge_results(runs: list[dict], names: list[str]) -> dict:
    """Bench results of several runs over the same prompts and settings as one (the first run's figures win
    for a label two runs share). Each method keeps the number of the run it came from (``run``): speeds
    compare only within one run."""
    first = runs[0]
    ids = sorted(p["id"] for p in first["per_prompt"])
    merged = {**first, "methods": {}, "per_prompt": [{**p, "methods": dict(p["methods"])} for p in first["per_prompt"]]}
    by_id = {p["id"]: p for p in merged["per_prompt"]}
    for n, (results, name) in enumerate(zip(runs, names)):
        for key in ("questions", "target", "max_new_tokens", "dtype", "sampling"):
            if results.get(key) != first.get(key):
                raise SettingsError(f"{name} has another {key} ({results.get(key)!r}) than {names[0]} "
                                    f"({first.get(key)!r}): only runs of the same prompts and settings merge")
        if sorted(p["id"] for p in results["per_prompt"]) != ids:
            raise SettingsError(f"{name} ran other prompts than {names[0]}: only runs of the same prompts merge")
        for label, figures in results["methods"].items():
            if label in merged["methods"]:
                continue
            merged["methods"][label] = {**figures, "run": n}
            for prompt in results["per_prompt"]:
                by_id[prompt["id"]]["methods"][label] = prompt["methods"][label]
    if len(runs) > 1:
        merged.update(merged_from=names, interrupted=any(r.get("interrupted") for r in runs),
                      machine=" + ".join(dict.fromkeys(r["machine"] for r in runs)),
                      date=" + ".join(dict.fromkeys(r["date"] for r in runs)))
    return merged


def card_key(questions: str | None) -> str:
    name = (questions or "mt-bench").lower()
    if name in ("mt-bench", "humaneval"):
        return name.replace("-", "")
    return "bench:" + Path(name).name


def record_benchmark(results: dict, source: str) -> list[Path]:
    """Write each shipped trained method's bench figures into its card, under 'mtbench', 'humaneval' or
    'bench:<file>' after the question set, so one set's results never overwrite another's."""
    touched, key = [], card_key(results.get("questions"))
    for label, m in results["methods"].items():
        name, settings = parse_method(label)
        folder = Path(settings.get("checkpoint") or default_path(name))
        if "tau" not in m or not (folder / CARD).exists():
            continue
        card = read_card(folder)
        entry = {k: m[k] for k in ("tau", "alpha_conditional", "alpha_unconditional", "tokens_per_s", "speedup",
                                   "identical_to_ar", "prompts") if k in m}
        entry.update(questions=results.get("questions"), max_new_tokens=results["max_new_tokens"],
                     dtype=results["dtype"], machine=results["machine"], cores_used=results.get("cores_used"),
                     date=results["date"],
                     results_file=shareable_path(source))
        bench = card.get(key) or {}
        bench[label] = entry
        update_card(folder, **{key: bench})
        touched.append(folder)
    return touched
