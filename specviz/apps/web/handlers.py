"""The web app's entry points: the Race tab's stream and Stop, the /compare API, the Benchmark tab and
the tree view. Every torch call runs on the state's engine thread; the race itself runs free there and
the page takes what it made in batches (``background.in_batches``)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import gradio as gr

from drafters import METHODS
from specviz.core.errors import SpecvizError
from specviz.core.metrics import identical, summarize

from .. import render
from ..background import in_batches
from ..bench import bench_steps
from ..questions import BUILTIN, load_questions
from ..race import race
from . import views
from .plan import MAX_NEW_TOKENS, Plan, SettingSpec, clamp, column_labels, plan_race, slider_settings
from .precision import Precisions, dtype_name
from .state import AppState

# The columns are redrawn at most this often while streaming. Each refresh costs Gradio tens of ms of a core
# (every one of the tab's outputs is post-processed and sent), taken from the engine when they share a core.
SHOW_EVERY_S = 1.0
COMPARE_BUDGET_S = float(os.environ.get("SPECVIZ_COMPARE_BUDGET_S", 120))  # engine time per /compare call
BENCH_BUDGET_S = float(os.environ.get("SPECVIZ_BENCH_BUDGET_S", 600))  # engine time per Benchmark-tab run
BATCH_SIZES = (1, 2, 4)  # the Benchmark tab's batch sweep (the CLI takes any)


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


class Handlers:
    """Bound to one AppState; each public method is one Gradio listener or API."""

    def __init__(self, state: AppState, specs: list[SettingSpec]):
        self.state, self.specs = state, specs
        self.columns = column_labels(state)  # the Race tab's columns, by label
        self.precisions = Precisions(state)  # the page's precision switch: the server's state and its copy

    def at(self, precision: str | None) -> AppState:
        """The state in ``precision`` (a dtype's name; None: the server's), loaded the first time it is picked."""
        try:
            return self.precisions.state(precision)
        except SpecvizError as e:
            raise gr.Error(str(e)) from None

    def plan(self, prompt, methods, max_new_tokens, temperature, top_p, settings, rule="auto", seed=0,
             precision: str | None = None) -> tuple[AppState, Plan]:
        state = self.at(precision)
        try:
            plan = plan_race(state, prompt, methods, max_new_tokens, temperature, top_p, settings, rule, seed)
        except SpecvizError as e:
            raise gr.Error(str(e)) from None
        if (dtype := dtype_name(state)) != "float32":
            plan.notes.append(f"precision {dtype}: a lossless method may part from AR where the target's top two "
                              "tokens nearly tie (its badge then says so)")
        return state, plan

    def race(self, request: gr.Request, prompt, methods, max_new_tokens, temperature, top_p, show_rejected,
             rule="auto", seed=0, precision=None, *setting_values):
        """The Race tab: stream every selected method's column while the race runs at full speed."""
        state, plan = self.plan(prompt, methods, max_new_tokens, temperature, top_p,
                                slider_settings(self.specs, setting_values), rule, seed, precision)
        for label in [label for label in plan.drafters if label not in self.columns]:  # a tag only /compare takes
            del plan.drafters[label]
            plan.notes.append(f"{label}: the Race tab has no column for it (the /compare API takes any tag)")
        if not plan.drafters:
            raise gr.Error("Pick at least one of the Race tab's methods. " + "; ".join(plan.notes))
        view = views.RaceView(plan, state.target.text.decode, bool(show_rejected), dtype_name(state), self.columns,
                              state.target)
        session, stop = _session(request), threading.Event()
        self.state.stops[session] = stop
        try:
            yield view.start()
            lanes = race(state.target, plan.drafters, plan.ids, plan.max_new_tokens, plan.sampling, state.padding,
                         plan.targets)
            for batch in in_batches(lanes, state.engine, stop, SHOW_EVERY_S):
                yield view.advance(batch)
            yield view.finish()
        finally:
            if self.state.stops.get(session) is stop:
                del self.state.stops[session]

    def stop(self, request: gr.Request) -> None:
        """The Stop button: this session's race ends after the step in progress and keeps what ran."""
        if (stop := self.state.stops.get(_session(request))) is not None:
            stop.set()

    def compare(self, prompt: str, methods: list[str], max_new_tokens: float = 128, temperature: float = 0.0,
                top_p: float = 1.0, settings: dict | None = None, rule: str = "auto", seed: int = 0,
                precision: str | None = None) -> dict:
        """The public API: per method the text, each token's origin and step, and the run's metrics.

        ``methods`` are labels: a method's name, or a name and a tag in brackets to race one method twice:
        "eagle2 (paper)" at the paper's setting, "eagle2 (untuned)" at its class's own values, any other tag
        at the settings given for it. ``settings`` maps a label to its numeric settings, e.g.
        {"eagle2": {"depth": 4}, "eagle2 (deep)": {"depth": 8}}; values beyond their range are clamped and
        every change is listed under ``notes``. ``rule``: auto, greedy,
        rejection (lossless sampling) or typical (lossy). A call gets at most ``COMPARE_BUDGET_S`` of
        engine time; the methods stop there and say so. ``seed``: the sampling's random seed (a sampled call
        is the same call again at the same seed). ``precision``: "float32" (exact) or the page's fast dtype
        ("bfloat16"); by default the server's."""
        state, plan = self.plan(prompt, methods, max_new_tokens, temperature, top_p, settings, rule, seed, precision)
        target = state.target
        steps = race(target, plan.drafters, plan.ids, plan.max_new_tokens, plan.sampling, state.padding,
                     plan.targets)

        def run_all() -> dict:  # the whole race in one engine call, within the budget
            lanes, deadline = {}, time.perf_counter() + COMPARE_BUDGET_S
            for lane in steps:
                lanes[lane.label] = lane
                if time.perf_counter() > deadline:
                    plan.notes.append(f"stopped at this API's budget of {COMPARE_BUDGET_S:.0f} s of engine time")
                    break
            return lanes

        lanes = state.on_engine(run_all)
        result = {"notes": plan.notes, "methods": {}}
        for label, lane in lanes.items():
            tokens = [{"token": t, "text": target.text.decode([t]), "step": r.step,
                       "origin": "accepted draft" if i < r.accepted else "correction" if r.corrected else "bonus"}
                      for r in lane.records for i, t in enumerate(r.tokens)]
            same, reference = None, lanes.get(plan.reference(label))  # AR on the lane's own target
            if reference is not None and plan.sampling.greedy:
                same = identical(lane.output_ids, reference.output_ids)
            result["methods"][label] = {"text": target.text.decode(lane.output_ids), "tokens": tokens,
                                        "error": lane.error, "identical_to_ar": same,
                                        "budget": _budget(plan, label),
                                        "metrics": summarize(lane.records, lane.clock).as_dict()}
        result["tuning"], result["precision"] = state.tuning.line(), dtype_name(state)
        return result

    def benchmark(self, question_set: str, subset: str, count: int, methods: list[str], max_new_tokens: int,
                  progress=gr.Progress(track_tqdm=True)):
        """The engine's bench on a subset, streamed prompt by prompt: τ and speedup per method × category."""
        state = self.state
        try:
            questions, picked, max_new_tokens, notes = self._bench_request(question_set, subset, count, methods,
                                                                           max_new_tokens, (8, 128))
            total = len(questions)

            def running(n: int) -> str:  # what the engine is on now: the next question, by number and category
                return (f" · running question {n + 1} of {total} ({questions[n].category}) with "
                        f"{', '.join(picked)}, then AR" if n < total else "")

            yield views.benchmark_table(None), None, "\n".join([f"0 of {total} questions done{running(0)}", *notes])
            progress((0, total), desc=f"question 1 of {total}")
            steps = state.on_engine_thread(bench_steps(state.target, picked, questions, max_new_tokens=max_new_tokens))
            folder, deadline = tempfile.mkdtemp(), time.perf_counter() + BENCH_BUDGET_S
            for result in steps:
                n, going = len(result.per_prompt), result.interrupted  # all but the last result are interrupted
                if time.perf_counter() > deadline and result.interrupted:
                    notes.append(f"stopped at this page's budget of {BENCH_BUDGET_S / 60:.0f} min; "
                                 "`python -m specviz bench` runs any number of questions")
                    steps.close()
                    going = False
                table = views.benchmark_table(result)
                path = os.path.join(folder, f"specviz-{question_set}-{n}q.csv")
                table.to_csv(path, index=False)
                progress((n, total), desc=f"question {min(n + 1, total)} of {total}")
                now = running(n) if going else ""
                yield table, path, "\n".join([f"{n} of {total} questions done on {result.machine}{now}", *notes])
        except SpecvizError as e:
            raise gr.Error(str(e)) from None

    def _bench_request(self, question_set, subset, count, methods, max_new_tokens, defaults: tuple[int, int]):
        """A Benchmark-tab request checked and clamped: (questions, available methods, token limit, notes)."""
        state, notes = self.state, []
        if question_set not in BUILTIN:  # the page offers the built-in sets only: no paths
            raise gr.Error(f"questions must be one of {', '.join(BUILTIN)}")
        if not isinstance(methods, (list, tuple)) or not all(isinstance(m, str) for m in methods):
            raise gr.Error("methods must be a list of method names")
        picked = [m for m in methods if m in state.drafters]
        notes += [f"{m} is unavailable: {state.unavailable[m]}" for m in methods if m in state.unavailable]
        if not picked:
            raise gr.Error("Pick at least one available method.")
        count = clamp("questions", count, 1, 80, defaults[0], notes)
        max_new_tokens = clamp("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS, defaults[1], notes)
        questions = (load_questions(question_set, per_category=count) if subset == "per category"
                     else load_questions(question_set, limit=count))
        return questions, picked, max_new_tokens, notes

    def sweep(self, question_set: str, subset: str, count: int, methods: list[str], max_new_tokens: int,
              progress=gr.Progress(track_tqdm=True)):
        """The Benchmark tab's temperature sweep: speed and quality against temperature per rule."""
        import pandas as pd

        from ..sweep import sweep

        state = self.state
        try:
            questions, picked, max_new_tokens, notes = self._bench_request(question_set, subset, count, methods,
                                                                           max_new_tokens, (2, 64))
            steps = state.on_engine_thread(sweep(state.target, picked, questions, max_new_tokens=max_new_tokens))
            deadline = time.perf_counter() + BENCH_BUDGET_S
            for rows in steps:
                if time.perf_counter() > deadline:
                    notes.append(f"stopped at this page's budget of {BENCH_BUDGET_S / 60:.0f} min")
                    steps.close()
                yield render.sweep_figure(rows), pd.DataFrame(rows), "\n".join(notes)
        except SpecvizError as e:
            raise gr.Error(str(e)) from None

    def batches(self, question_set: str, subset: str, count: int, methods: list[str], max_new_tokens: int,
                progress=gr.Progress(track_tqdm=True)):
        """The Benchmark tab's batch sweep: the questions B at a time, each method beside AR at every B; ReDrafter
        also at its paper's beams, merged into one tree and kept apart (its Fig. 6)."""
        import pandas as pd

        from ..batch_plot import batch_figure
        from ..batching import sweep_points

        state = self.state
        try:
            questions, picked, max_new_tokens, notes = self._bench_request(question_set, subset, count, methods,
                                                                           max_new_tokens, (2, 64))
            labels = picked + (["redrafter:preset=paper", "redrafter:preset=paper:tree_attention=0"]
                               if "redrafter" in picked else [])
            sizes = [b for b in BATCH_SIZES if b <= len(questions)]  # a batch holds at most one per question
            if len(sizes) < len(BATCH_SIZES):
                notes.append(f"batch {', '.join(str(b) for b in BATCH_SIZES if b not in sizes)} left out: it needs "
                             "as many questions")
            steps = state.on_engine_thread(sweep_points(state.target, labels, questions, sizes, max_new_tokens,
                                                        source=question_set, bracket=False))  # a page's budget
            deadline, total = time.perf_counter() + BENCH_BUDGET_S, len(sizes) * (len(set(labels) - {"ar"}) + 1)
            for sweep in steps:
                if time.perf_counter() > deadline:
                    notes.append(f"stopped at this page's budget of {BENCH_BUDGET_S / 60:.0f} min; "
                                 "`python -m specviz bench --batch-sizes` runs any sweep")
                    steps.close()
                progress((len(sweep.points), total), desc=f"{len(sweep.points)} of {total} points")
                rows = [{"method": p.method, "batch": p.batch_size, "tok/s": p.throughput,
                         "× AR": round(sweep.speedup(p) or 1.0, 2), "tok/s per sequence": p.sequence_tok_s,
                         "τ": p.tau, "identical to AR": p.identical} for p in sweep.points]
                yield batch_figure(sweep), pd.DataFrame(rows), "\n".join(
                    [f"{len(sweep.points)} of {total} points on {sweep.machine}", *notes])
        except SpecvizError as e:
            raise gr.Error(str(e)) from None

    def preset(self, preset: str, precision: str | None = None) -> list[int]:
        """The settings sliders at a preset: "fastest" (the budgets tuned for this machine in ``precision``, as
        far as tuning has got) or "paper"."""
        values, state = [], self.at(precision)
        for spec in self.specs:
            value = state.defaults(spec.method).get(spec.name, spec.default)
            if preset == "paper":
                value = METHODS[spec.method][1].PAPER.get(spec.name, value)
            values.append(min(max(int(value), spec.low), spec.high))
        return values

    def step_view(self, runs: dict, method: str, step: int):
        return views.step_view(runs, method, step, self.state.target.text.decode)


def _budget(plan, label: str) -> str:
    """Where a method's budget came from: this machine's tuning, its untuned defaults, or the request (or none)."""
    return "untuned" if label in plan.untuned else "tuned" if label in plan.expected else "as given"
