"""Throughput against batch size (``bench --batch-sizes``): every method decodes the questions B at a time
(``core.batch``, continuous batching), beside AR at the same B, in one process. At each batch size AR runs
before and after every method (AR M1 AR M2 AR ...), and a method's speedup is over the mean of the two AR runs
around it (``BatchPoint.baseline``): a shared machine whose speed drifts during the sweep (a fifth within
minutes, seen) moves a method's baseline with it. AR's own point pools all its runs.

Speculation's gain shrinks as the batch grows: at batch 1 a verify of many tokens costs about what one token
costs (the forward is bound by reading the weights), but a full batch already keeps the machine's arithmetic
busy, and every draft token then costs its share. Per point the sweep records the batch's throughput (all
sequences' tokens per second), each sequence's own speed (its tokens over its time in the batch, averaged),
τ (tokens per target forward a sequence took part in) and, greedy, how many sequences equal AR's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import date

from drafters import build_drafter
from specviz.core.batch import batch_capacity, generate_batch
from specviz.core.errors import SettingsError
from specviz.core.metrics import tau
from specviz.core.protocol import Drafter
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling

from .batch_results import BatchPoint, BatchSweep
from .machine import machine_description
from .methods import parse_method
from .questions import Question
from .tuning import resolve

WARM_TOKENS = 16  # a warm-up's tokens a prompt: oneDNN builds a kernel the first time it meets a row count (ms each)


def lane_by_lane(drafter: Drafter) -> Drafter:
    """``drafter`` drafting a batch's lanes one call each, with its own batched call on one lane at a time: the
    other arm of the A/B that prices batched drafting (``batched_drafting=0`` in a method's label). The trees
    are the same; only the number of network calls per step changes."""
    batched = drafter.propose_batch
    drafter.propose_batch = lambda states, requests: [batched([s], [r])[0] for s, r in zip(states, requests)]
    return drafter


def measure(target: TargetModel, label: str, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
            sampling: Sampling, warm: bool = True) -> tuple[BatchPoint, list[list[int]]]:
    """One method at one batch size over ``prompts``: its point and every sequence's output. A label's
    ``batched_drafting=0`` drafts lane by lane (``lane_by_lane``) at the budget the method has without it.
    ``warm``: first decode every prompt for ``WARM_TOKENS`` (its prefill and the step shapes the timed run meets)."""
    name, given = parse_method(label)
    batched = given.pop("batched_drafting", 1)
    if batched not in (0, 1):
        raise SettingsError(f"{label}: batched_drafting is 1 (every lane in one call, the default) or 0 (lane by "
                            f"lane), got {batched!r}")
    settings, _ = resolve(target, name, given, batch=batch_size)  # tuned here for this batch size, unless given
    drafter = build_drafter(name, target, **settings)
    if not batched:
        drafter = lane_by_lane(drafter)
    if warm:  # one-off costs stay out of the timing: graphs compiled (and recorded), kernels built, caches filled
        capacity = batch_capacity(prompts, max_new_tokens)  # the timed run's: a warm-up on its buffers
        target.warm_batches(batch_size, capacity)
        for _ in generate_batch(target, drafter, prompts, WARM_TOKENS, sampling, batch_size, capacity=capacity):
            pass
    records: list[list] = [[] for _ in prompts]
    joined, left = [0.0] * len(prompts), [0.0] * len(prompts)
    start = time.perf_counter()
    for i, record in generate_batch(target, drafter, prompts, max_new_tokens, sampling, batch_size):
        now = time.perf_counter()
        if record.step == 0:
            joined[i] = now - record.timings.total  # it joined when its prefill began
        records[i].append(record)
        left[i] = now
    wall = time.perf_counter() - start
    outputs = [[t for r in rs for t in r.tokens] for rs in records]
    tokens = sum(map(len, outputs))
    steps = [r for rs in records for r in rs if r.step > 0]
    pooled_tau = sum(r.accepted + 1 for r in steps) / len(steps) if steps else tau([])
    speeds = [len(o) / (b - a) for o, a, b in zip(outputs, joined, left) if b > a]
    point = BatchPoint(label, batch_size, len(prompts), tokens, round(wall, 3), round(pooled_tau, 3),
                       round(tokens / wall, 2), round(sum(speeds) / max(len(speeds), 1), 2), settings=settings,
                       runs=[round(tokens / wall, 2)])
    return point, outputs


def pooled(first: BatchPoint, again: BatchPoint) -> BatchPoint:
    """AR's runs at one batch size as one point: its tokens over their mean time, i.e. the harmonic mean of the
    runs' throughputs (each kept in ``runs``, to show the machine's drift), their mean per-sequence speed."""
    n, runs = len(first.runs), [*first.runs, *again.runs]
    return replace(first, wall_s=round((first.wall_s * n + again.wall_s) / (n + 1), 3),
                   throughput=round(len(runs) / sum(1 / r for r in runs), 2),
                   sequence_tok_s=round((first.sequence_tok_s * n + again.sequence_tok_s) / (n + 1), 2), runs=runs)


RESUME_KEYS = ("target", "device", "dtype", "machine", "questions", "max_new_tokens", "sampling", "engine")


def kept_sizes(done: BatchSweep, sweep: BatchSweep, labels: list[str]) -> set[int]:
    """The batch sizes a killed sweep (``done``) measured for every method, which a resume keeps. A size it left
    half done is measured again whole: its speedups compare methods run in one process. ``done`` must have run
    the same way (target, machine, questions, tokens, sampling)."""
    other = [k for k in RESUME_KEYS if getattr(done, k) != getattr(sweep, k)]
    if other:
        raise SettingsError(f"the sweep to resume ran with another {', '.join(other)}: "
                            f"{', '.join(f'{getattr(done, k)!r}' for k in other)}")
    return {p.batch_size for p in done.points
            if all((q := done.point(m, p.batch_size)) and (m == "ar" or q.baseline is not None) for m in labels)}


def sweep_points(target: TargetModel, methods: list[str], questions: list[Question], batch_sizes: list[int],
                 max_new_tokens: int = 128, sampling: Sampling | None = None, source: str = "",
                 done: BatchSweep | None = None, bracket: bool = True) -> Iterator[BatchSweep]:
    """Every method (AR first, always) at every batch size on ``questions``: the sweep so far after each point.
    ``bracket``: AR again after every method, the method's baseline the two around it (the module docstring);
    without it, AR once. ``done``: a killed run of the same sweep, whose complete batch sizes are kept
    (``kept_sizes``)."""
    sampling = sampling or Sampling()
    if not batch_sizes or min(batch_sizes) < 1:
        raise SettingsError(f"batch sizes must be positive integers, got {batch_sizes}")
    if max(batch_sizes) > len(questions):  # a batch never holds more sequences than there are questions
        raise SettingsError(f"batch size {max(batch_sizes)} needs at least {max(batch_sizes)} questions, got "
                            f"{len(questions)}: it would run as batch {len(questions)}; add questions (e.g. "
                            "--per-category 2 or --limit) or leave the size out")
    labels = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]
    prompts = [target.text.encode_chat(q.prompt) for q in questions]
    sweep = BatchSweep(target.name, str(target.device), str(target.dtype).replace("torch.", ""),
                       machine_description(), str(date.today()), f"{source or 'questions'} ({len(prompts)})",
                       max_new_tokens, asdict(sampling), engine=target.engine.path)
    kept = kept_sizes(done, sweep, labels) & set(batch_sizes) if done is not None else set()
    sweep.points = [p for p in done.points if p.batch_size in kept and p.method in labels] if kept else []
    if kept >= set(batch_sizes):  # a finished sweep, resumed: nothing left to measure
        yield sweep
    for batch_size in batch_sizes:
        if batch_size in kept:
            continue
        ar, reference = measure(target, "ar", prompts, batch_size, max_new_tokens, sampling)
        sweep.points.append(ar)
        yield sweep
        for label in labels[1:]:
            point, outputs = measure(target, label, prompts, batch_size, max_new_tokens, sampling)
            if sampling.greedy:
                point = replace(point, identical=sum(a == b for a, b in zip(outputs, reference)))
            if bracket:
                before = ar.runs[-1]
                again, _ = measure(target, "ar", prompts, batch_size, max_new_tokens, sampling, warm=False)
                point = replace(point, baseline=round((before + again.throughput) / 2, 2))
                index = sweep.points.index(ar)
                ar = sweep.points[index] = pooled(ar, again)
            sweep.points.append(point)
            yield sweep


def batch_sweep(target: TargetModel, methods: list[str], questions: list[Question], batch_sizes: list[int],
                max_new_tokens: int = 128, sampling: Sampling | None = None, source: str = "",
                on_point=None, done: BatchSweep | None = None) -> BatchSweep:
    """``sweep_points`` to the end; ``on_point(sweep)`` after each point (a caller saves it: a killed sweep keeps
    what it measured, and ``done`` resumes it)."""
    sweep = None
    for sweep in sweep_points(target, methods, questions, batch_sizes, max_new_tokens, sampling, source, done):
        if on_point is not None:
            on_point(sweep)
    return sweep
