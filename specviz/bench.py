"""Benchmarks (not tests): methods on a question set, and the target's verify-cost curve.

Every method runs on the same prompts in the same process, interleaved prompt by prompt, and
speedup is AR's time per token over the method's. ``hf`` and ``hf-pld`` run transformers' own
``generate`` (plain, and with ``prompt_lookup_num_tokens=10``) as outside baselines.
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from drafters import METHODS, build_drafter

from .data import Question
from .engine import Clock, StepRecord, run
from .errors import SettingsError
from .metrics import extra_memory_pct, summarize
from .target import TargetModel
from .tree import DraftTree
from .verify import Sampling

HF_BASELINES = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> tuple[str, dict]:
    """'skip:layers=12:num_tokens=3' -> ('skip', {'layers': 12, 'num_tokens': 3})."""
    name, *pairs = spec.strip().split(":")
    settings = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise SettingsError(f"bad setting {pair!r} in {spec!r}; write name:key=value:key=value")
        settings[key] = _value(val)
    if name not in METHODS and name not in HF_BASELINES:
        raise SettingsError(f"unknown method {name!r}; choose from {', '.join([*METHODS, *HF_BASELINES])}")
    return name, settings


@dataclass
class PromptRun:
    output: list[int]
    wall_s: float
    records: list[StepRecord] | None = None  # None for the HF baselines


def _hf_runner(target: TargetModel, max_new_tokens: int, sampling: Sampling, extra: dict) -> Callable:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, **extra)
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    clock = Clock(target.device)

    def go(ids: list[int]) -> PromptRun:
        start = clock()
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([ids], device=target.device), **kwargs)
        wall = clock() - start
        new = out[0, len(ids) :].tolist()
        return PromptRun(new, wall)

    return go


def _engine_runner(target: TargetModel, name: str, settings: dict, max_new_tokens: int, sampling: Sampling) -> tuple[Callable, int]:
    drafter = build_drafter(name, target, **settings)

    def go(ids: list[int]) -> PromptRun:
        result = run(target, drafter, ids, max_new_tokens, sampling)
        return PromptRun(result.output_ids, result.wall_s, result.records)

    return go, drafter.num_parameters()


def _aggregate(runs: list[PromptRun], ar_runs: list[PromptRun], questions: list[Question], target_params: int,
               extra_params: int, sampling: Sampling) -> dict:
    tokens = sum(len(r.output) for r in runs)
    wall = sum(r.wall_s for r in runs)
    ar_tokens, ar_wall = sum(len(r.output) for r in ar_runs), sum(r.wall_s for r in ar_runs)
    out = {
        "prompts": len(runs),
        "new_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "speedup": (ar_wall / ar_tokens) / (wall / tokens) if tokens and ar_tokens else 0.0,
        "identical_to_ar": sum(r.output == a.output for r, a in zip(runs, ar_runs)),
        "extra_memory_pct": extra_memory_pct(extra_params, target_params),
    }
    if runs[0].records is not None:
        records = [rec for r in runs for rec in r.records]
        m = summarize(records, wall)
        out.update(tau=m.tau, latency_ms=m.latency_ms, mean_tree_size=m.mean_tree_size,
                   mean_compression=m.mean_compression, alpha_conditional=m.alpha_conditional, alpha_unconditional=m.alpha_unconditional)
    if not sampling.greedy:
        out["identical_to_ar_note"] = "sampling: outputs differ from AR by design; compare distributions, not tokens"
    by_cat: dict[str, dict] = {}
    for q, r, a in zip(questions, runs, ar_runs):
        c = by_cat.setdefault(q.category, {"tokens": 0, "wall": 0.0, "ar_tokens": 0, "ar_wall": 0.0, "steps": 0, "acc": 0})
        c["tokens"] += len(r.output)
        c["wall"] += r.wall_s
        c["ar_tokens"] += len(a.output)
        c["ar_wall"] += a.wall_s
        if r.records is not None:
            decode = [x for x in r.records if x.step > 0]
            c["steps"] += len(decode)
            c["acc"] += sum(x.accepted + 1 for x in decode)
    out["by_category"] = {
        k: {
            "tau": c["acc"] / c["steps"] if c["steps"] else None,
            "speedup": (c["ar_wall"] / c["ar_tokens"]) / (c["wall"] / c["tokens"]) if c["tokens"] and c["ar_tokens"] else 0.0,
        }
        for k, c in by_cat.items()
    }
    return out


def bench(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
          sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
          on_prompt: Callable[[dict], None] | None = None, runs: dict[str, list[PromptRun]] | None = None) -> dict:
    """Run every method on every question (AR always included as the reference).

    ``on_prompt`` gets the results so far after each prompt but the last, so a caller can save them
    and a killed run loses at most one prompt. Ctrl-C returns the prompts every method finished.
    ``runs`` is filled in place, and may hold a killed run's first prompts to resume it (see bench_steps)."""
    results = None
    try:
        for results in bench_steps(target, methods, questions, max_new_tokens, sampling, warmup, progress, runs):
            if on_prompt is not None and results["interrupted"]:
                on_prompt(results)
    except KeyboardInterrupt:
        if results is None:
            raise
    return results


def bench_steps(target: TargetModel, methods: list[str], questions: list[Question], max_new_tokens: int = 128,
                sampling: Sampling | None = None, warmup: bool = True, progress: bool = True,
                runs: dict[str, list[PromptRun]] | None = None) -> Iterator[dict]:
    """Yield the results so far after every prompt; all but the last are marked ``interrupted``.

    ``runs`` (method label → one PromptRun per question, in order) is filled in place; the questions
    it already holds, from an earlier run of the same methods, are kept and not run again."""
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
    runners, extra = {}, {}
    for label, (name, settings) in zip(labels, specs):
        if name in HF_BASELINES:
            runners[label], extra[label] = _hf_runner(target, max_new_tokens, sampling, {**HF_BASELINES[name], **settings}), 0
        else:
            runners[label], extra[label] = _engine_runner(target, name, settings, max_new_tokens, sampling)
    prompts = [target.encode_chat(q.prompt) for q in questions]
    if warmup:
        for go in runners.values():
            go(prompts[0][:64])
    results = runs if runs is not None else {}
    if any(results.values()) and set(results) != set(labels):
        raise SettingsError(f"the run to resume has the methods {sorted(results)}, not {sorted(labels)}")
    for label in labels:
        results.setdefault(label, [])
    finished = len(results["ar"])
    if finished > len(questions) or any(len(r) != finished for r in results.values()):
        raise SettingsError(f"the run to resume has {finished} prompts per method; this question set has {len(questions)}")
    per_prompt = [_row(q, len(ids), {label: results[label][i] for label in labels})
                  for i, (q, ids) in enumerate(zip(questions[:finished], prompts))]

    def report(interrupted: bool) -> dict:
        done = questions[: len(per_prompt)]
        summary = {
            label: _aggregate(results[label][: len(done)], results["ar"][: len(done)], done, target.num_parameters,
                              extra[label], sampling)
            for label in labels
        }
        return {
            "target": target.name,
            "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""),
            "max_new_tokens": max_new_tokens,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "rule": sampling.resolved_rule,
                         "lossless": sampling.lossless},
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_description(),
            "interrupted": interrupted,
            "methods": summary,
            "per_prompt": list(per_prompt),
        }

    remaining = list(zip(questions, prompts))[finished:]
    if not remaining:  # resuming a run that had finished
        yield report(False)
    for q, ids in tqdm(remaining, desc="bench", disable=not progress, unit="prompt", initial=finished, total=len(questions)):
        shift = len(per_prompt) % len(labels)  # rotate the order so no method always runs first
        ran = {label: runners[label](ids) for label in labels[shift:] + labels[:shift]}
        done = {label: ran[label] for label in labels}
        for label in labels:
            results[label].append(done[label])
        per_prompt.append(_row(q, len(ids), done))
        yield report(len(per_prompt) < len(questions))


def _row(q: Question, prompt_tokens: int, done: dict[str, PromptRun]) -> dict:
    row = {"id": q.id, "category": q.category, "prompt_tokens": prompt_tokens, "methods": {}}
    for label, r in done.items():
        entry = {"new_tokens": len(r.output), "wall_s": r.wall_s, "identical_to_ar": r.output == done["ar"].output}
        if r.records is not None:
            decode = [x for x in r.records if x.step > 0]
            entry["steps"] = len(decode)
            entry["accepted_per_step"] = [x.accepted for x in decode]
        row["methods"][label] = entry
    return row


class RunLog:
    """A bench's PromptRuns, appended to a file after every prompt, so that a killed run can resume.

    The file holds the run's settings, then one pickle per finished prompt; a prompt cut short by the
    kill is dropped on loading. Only load logs this program wrote: pickle runs code from the file."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings

    def start(self) -> None:
        with self.path.open("wb") as f:
            pickle.dump(self.settings, f)

    def resume(self) -> dict[str, list[PromptRun]]:
        if not self.path.exists():
            raise SettingsError(f"nothing to resume: {self.path} does not exist (bench writes it while it runs and "
                                "removes it when the run is complete)")
        runs: dict[str, list[PromptRun]] = {}
        with self.path.open("rb") as f:
            try:
                settings = pickle.load(f)
            except Exception as e:
                raise SettingsError(f"{self.path} is not a bench run log ({e})") from None
            if settings != self.settings:
                changed = sorted(k for k in settings.keys() | self.settings.keys() if settings.get(k) != self.settings.get(k))
                raise SettingsError(f"{self.path} was a run with other {', '.join(changed)}; run without --resume to start again")
            good = f.tell()
            while True:
                try:
                    prompt = pickle.load(f)
                except Exception:  # the end, or the prompt being written when the run was killed
                    break
                for label, prompt_run in prompt.items():
                    runs.setdefault(label, []).append(prompt_run)
                good = f.tell()
        with self.path.open("r+b") as f:
            f.truncate(good)
        return runs

    def append(self, prompt: dict[str, PromptRun]) -> None:
        with self.path.open("ab") as f:
            pickle.dump(prompt, f)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def machine_description() -> str:
    import os
    import platform

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"{platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def profile(target: TargetModel, context: int = 256, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 7) -> dict:
    """Median ms of one target forward verifying n tokens after ``context`` cached tokens."""
    if context < 1 or context + max(sizes) > target.max_length:
        raise SettingsError(f"context must be in [1, {target.max_length - max(sizes)}], got {context}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()
    clock = Clock(target.device)
    target.prefill(prompt)
    rows = []
    for n in tqdm(sizes, desc="profile", unit="size"):
        tree = DraftTree.chain(torch.randint(0, target.vocab_size, (n - 1,), generator=gen))
        times = []
        for i in range(repeats + 1):
            start = clock()
            target.verify(prompt[-1], tree)
            elapsed = clock() - start
            target.cache.crop(-n)
            if i:  # the first call warms up
                times.append(elapsed)
        rows.append({"tokens": n, "ms": 1000 * statistics.median(times)})
    base = rows[0]["ms"]
    for r in rows:
        r["relative_to_1"] = r["ms"] / base
    return {"target": target.name, "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
            "context": context, "machine": machine_description(), "date": time.strftime("%Y-%m-%d"), "curve": rows}

