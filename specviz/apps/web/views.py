"""What the web app shows, built from race lanes and bench results: columns, plots, tables, notes.

Columns and the message go out as plain values, never ``gr.update``/``gr.skip``: Gradio rebuilds a
component for every update dict it gets, which cost the engine several per cent while streaming."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import gradio as gr

from drafters import METHODS
from specviz.core.metrics import (
    TIE_TOLERANCE,
    divergence,
    extra_memory_pct,
    first_difference,
    speedup,
    summarize,
    token_margins,
)

from .. import render, teaching
from ..experiment_plot import experiment_figure
from ..experiment_results import shipped_experiments
from ..race import Lane, race
from ..results import BenchResult
from . import export, replay
from .plan import Plan
from .state import AppState

PLOT_EVERY_S = 5.0  # the plots are redrawn at most this often while streaming (plotly figures are slow to build)


def plots(runs: dict) -> list:
    """The Race tab's live plots: α_k per depth, tokens per step, latency per token."""
    return [render.acceptance_figure(runs), render.accepted_length_figure(runs), render.latency_figure(runs)]


def warm_up(state: AppState) -> None:
    """Two tokens from every method and one of each plot, so the first Run pays no one-off costs."""
    try:
        lanes = race(state.target, state.drafters, state.target.text.encode_chat("Hi"), 2, padding=state.padding)
        plots({lane.label: lane.records for lane in lanes})
    except Exception as e:  # a slower first Run is no reason to refuse to start
        print(f"specviz: warm-up failed ({e!r}); continuing", file=sys.stderr)


BUSY_BELOW = 0.6  # AR under this share of its idle speed: the machine is busy (run-to-run noise stays well above)
BUSY_MIN_TOKENS = 16  # fewer tokens time too little to judge


class RaceView:
    """Turns race lanes into the Race tab's outputs: the columns that moved are rebuilt, plots every few seconds."""

    def __init__(self, plan: Plan, decode, show_rejected: bool, dtype: str = "float32",
                 columns: list[str] | None = None, target=None):
        self.plan, self.decode, self.show_rejected = plan, decode, show_rejected
        self.target = target  # the main target, whose forward path (eager, compiled) each header names
        self.tolerance = TIE_TOLERANCE.get(dtype, TIE_TOLERANCE["float32"])
        self.lanes: dict[str, Lane] = {}
        self.spans: dict[str, list[str]] = {m: [] for m in plan.drafters}
        self.html: dict[str, str] = {m: "" for m in columns or METHODS}  # every column of the page, as last sent
        self.notes = ""  # the message as sent at the start
        self.plotted = time.perf_counter()

    def column(self, label: str) -> str:
        lane, ar = self.lanes.get(label), self.lanes.get(self.plan.reference(label))  # AR on its own target
        records = lane.records if lane else []
        clock = lane.clock if lane else 0.0
        m = summarize(records, clock)
        # τ first: what the method achieved, which a busy machine cannot change; then progress, then speed
        bits = [f'<b title="tokens per target pass (τ): load on the machine does not change it">τ {m.tau:.2f}</b>',
                f"{m.new_tokens} / {self.plan.max_new_tokens} tokens"]
        expected = self.plan.expected.get(label)
        if ar is not None and ar is not lane and ar.clock > 0 and ar.records:
            bits.append(f"{speedup(m.new_tokens, clock, len(ar.output_ids), ar.clock):.2f}× AR"
                        + ("" if expected is None else f" (expected {expected:.2f}×)"))
        bits.append(f"{m.tokens_per_s:.1f} tok/s")
        target = self.plan.targets.get(label, self.target)
        if target is not None and ((status := target.engine).path != "eager" or status.detail):  # asked to compile
            bits.append(f'<span class="sv-engine" title="the target\'s forwards: {render.escape(str(status))}">'
                        f'{status.path}{" (compiling)" if status.compiling else ""}</span>')
        done = lane is not None and lane.finished
        if label in self.plan.untuned:
            bits.append('<span title="this machine\'s budget for it is not measured yet">untuned budget</span>')
        reference = self.plan.reference(label)
        badge = (self.adapted_badge(lane, self.lanes.get("ar")) if reference == label != "ar" else
                 self.badge(lane, ar, "AR" if reference == "ar" else reference))
        head = (f'<div class="sv-head" data-done="{int(done)}" style="border-left: 5px solid '
                f'{render.method_colour(label)}; padding-left: 6px"><b>{label}</b> · {" · ".join(bits)}'
                f'{badge}{" · done" if done else ""}</div>')
        error = f'<p class="sv-error">stopped: {render.escape(lane.error)}</p>' if lane and lane.error else ""
        return head + '<div class="sv-tokens">' + "".join(self.spans[label]) + "</div>" + error

    def badge(self, lane: Lane | None, ar: Lane | None, name: str = "AR") -> str:
        """``lane`` against ``ar``, the AR on its own target (called ``name``)."""
        if lane is None or ar is None or lane is ar:
            return ""
        if not self.plan.sampling.lossless:
            return (' · <span class="sv-differs" title="typical acceptance keeps tokens the target would not '
                    'always pick">lossy (typical acceptance)</span>')
        if not self.plan.sampling.greedy:
            return (' · <span title="sampling: same distribution as AR, different tokens; the same seed gives the '
                    f'same race">sampled, seed {self.plan.sampling.seed}</span>')
        final = lane.finished and ar.finished
        n = len(lane.output_ids) if final else min(len(lane.output_ids), len(ar.output_ids))
        d = divergence(lane.output_ids[:n], ar.output_ids[:n] if not final else ar.output_ids,
                       token_margins(ar.records), self.tolerance)
        if d.kind == "identical":
            return f' · <span class="sv-same">✅ identical to {name}{"" if final else " so far"}</span>'
        if d.kind == "near-tie":
            return (f' · <span class="sv-tie" title="{render.escape(d.describe())}">≈ identical up to floating point'
                    f" (near-tie at token {d.at + 1})</span>")
        return (f' · <span class="sv-differs" title="{render.escape(d.describe())}">'
                f"❌ differs from {name} at token {d.at + 1}</span>")

    def adapted_badge(self, lane: Lane | None, base: Lane | None) -> str:
        """What joint training did to the target's own greedy text: where it first parts from the base's."""
        if lane is None or base is None or not self.plan.sampling.greedy:
            return ""
        at = first_difference(lane.output_ids, base.output_ids)
        if at is None:
            return (' · <span title="the LoRA moved the logits, not this greedy text">same text as the base target'
                    f'{"" if lane.finished and base.finished else " so far"}</span>')
        return (' · <span title="the jointly trained LoRA changed what the target itself answers">'
                f"adapted: parts from the base target's text at token {at + 1}</span>")

    def start(self) -> tuple:
        self.html.update({m: self.column(m) for m in self.plan.drafters})
        self.notes = self.message()
        columns = [gr.update(visible=m in self.plan.drafters, value=self.html[m]) for m in self.html]
        return (*columns, gr.skip(), gr.skip(), gr.skip(), self.notes, gr.skip())

    def advance(self, lanes: list[Lane]) -> tuple:
        """Redraw the columns of the lanes that stepped (all of them when AR moved: their speedups)."""
        moved: set[str] = set()
        for lane in lanes:
            self.lanes[lane.label] = lane
            spans = self.spans[lane.label]
            spans[len(spans):] = [render.step_html(r, self.decode, self.show_rejected)
                                  for r in lane.records[len(spans):]]
            reference = self.plan.reference(lane.label) == lane.label  # an AR: the others' speedups move with it
            moved |= {lane.label} | (set(self.lanes) if reference else set())
        self.html.update({m: self.column(m) for m in moved})
        now = time.perf_counter()
        figures = [gr.skip()] * 3
        if now - self.plotted >= PLOT_EVERY_S:
            figures, self.plotted = self.figures(), now
        return (*self.html.values(), *figures, self.notes, gr.skip())

    def finish(self) -> tuple:
        self.html.update({m: self.column(m) for m in self.plan.drafters})
        shared = {"greedy": self.plan.sampling.greedy, "sampling": asdict(self.plan.sampling),
                  "prompt": self.decode(self.plan.ids)}  # what the download of the race names
        runs = {k: {"records": v.records, "clock": v.clock, "error": v.error, **shared} for k, v in self.lanes.items()}
        return (*self.html.values(), *self.figures(), self.message(), runs)

    def figures(self) -> list:
        return plots({k: v.records for k, v in self.lanes.items()})

    def message(self) -> str:
        notes = list(self.plan.notes)
        if stopped := [m for m in self.plan.drafters if m in self.lanes and not self.lanes[m].finished]:
            notes.append(f"Stopped: {', '.join(stopped)} did not finish; the columns, plots and trees show what ran.")
        if busy := self.busy():
            notes.append(busy)
        return "\n".join(f"- {n}" for n in notes)

    def busy(self) -> str:
        """A note when AR ran far below its idle speed here: the machine is shared, so speeds are unreliable."""
        ar, idle = self.lanes.get("ar"), self.plan.ar_tok_s
        if ar is None or not ar.finished or not idle or len(ar.output_ids) < BUSY_MIN_TOKENS:
            return ""
        measured = summarize(ar.records, ar.clock).tokens_per_s
        if measured >= BUSY_BELOW * idle:
            return ""
        return (f"This machine is busy: AR ran at {measured:.1f} tok/s, against {idle:.1f} measured on it idle, so "
                "tokens/s and × AR are unreliable now. τ (tokens per target pass) is not affected.")


def tree_choices(runs: dict):
    """The tree view's methods (those that drafted) and steps; it opens on the first step with a tree."""
    drafted = {m: [r.step for r in run["records"] if len(r.tree)] for m, run in (runs or {}).items()}
    methods = [m for m, steps in drafted.items() if steps]
    first = methods[0] if methods else None
    steps = max((len(runs[m]["records"]) - 1 for m in methods), default=1)
    return (gr.update(choices=methods, value=first),
            gr.update(maximum=max(steps, 2), value=drafted[first][0] if first else 1))


def step_view(runs: dict, method: str, step: int, decode) -> tuple:
    """The step-through view of one step: its draft tree and what happened in it."""
    run = (runs or {}).get(method) or {}
    records = run.get("records", [])
    index = next((i for i, r in enumerate(records) if r.step == int(step or 0)), None)
    if index is None:
        return render.tree_figure(None, decode, method or ""), "Run a race, then pick a method and a step."
    before = [t for r in records[:index] for t in r.tokens]
    detail = render.step_detail(records[index], decode, before, method, run.get("greedy", True))
    return render.tree_figure(records[index], decode, method), detail


def next_step(runs: dict, method: str, step: int, delta: int) -> int:
    """The step ``delta`` away (prev/next buttons, arrow keys), within the method's run."""
    steps = [r.step for r in ((runs or {}).get(method) or {}).get("records", [])]
    return min(max(int(step or 0) + delta, 1 if len(steps) > 1 else 0), max(steps, default=0))


def benchmark_table(result: BenchResult | None):
    """τ, speedup, tok/s and identical-to-AR per method, and τ and speedup per category."""
    import pandas as pd

    rows = []
    if result is None:  # before the first run: the real column names, no rows
        return pd.DataFrame(columns=["method", "τ", "speedup", "tok/s", "identical to AR"])
    for label, m in result.methods.items():
        row = {"method": label, "τ": round(1.0 if m.tau is None else m.tau, 2), "speedup": round(m.speedup, 2),
               "tok/s": round(m.tokens_per_s, 1), "identical to AR": m.exactness_text()}
        for cat, c in sorted(m.by_category.items()):
            row[f"{cat} τ"] = None if c.tau is None else round(c.tau, 2)
            row[f"{cat} ×"] = round(c.speedup, 2)
        rows.append(row)
    return pd.DataFrame(rows)


def learn_text(state: AppState, notes: bool = True) -> str:
    """The Learn tab's text: the papers, how to read the race, precision, budgets (and each method's note)."""
    parts = [teaching.FOUNDATIONS,
             "Papers: " + " · ".join(f"[{k}]({v})" if v else k for k, v in teaching.PAPERS.items()),
             teaching.READING, teaching.PRECISION, teaching.BUDGETS, teaching.BATCHING]
    if state.joint:
        parts.append(teaching.JOINT)
    if notes:
        parts += [method_note(state, name) for name in state.drafters]
        parts += [f"### {k}\n**Unavailable here:** {v}" for k, v in state.cannot_run.items()]
    return "\n\n".join(parts)


def method_note(state: AppState, name: str) -> str:
    drafter = state.drafters[name]
    params = drafter.num_parameters()
    return teaching.note(name, drafter.title, params, extra_memory_pct(params, state.target.num_parameters),
                         getattr(drafter, "card", None))


def method_figure(name: str):
    inputs, drafter, output = teaching.DIAGRAMS.get(name, ((), name, "draft"))
    return render.method_diagram(inputs, drafter, output, f"{name}: what it reads, runs and proposes")


def race_download(runs: dict, decode) -> tuple:
    """The two download buttons after a race: its JSON (``export``) and a page replaying it offline
    (``replay``); hidden before the first race."""
    if not runs:
        return gr.update(visible=False), gr.update(visible=False)
    first = next(iter(runs.values()))
    race = export.race_dict(runs, first["prompt"], first["sampling"], decode)
    return (gr.update(value=str(export.race_file(race)), visible=True),
            gr.update(value=str(replay.replay_file(race)), visible=True))


NO_EXPERIMENTS = ("No experiment results are shipped yet. `python -m specviz experiment list` names them; "
                  "`python -m specviz experiment NAME --ship` runs one and writes its results here.")


def experiment_choices() -> list[str]:
    return list(shipped_experiments())


def experiment_view(name: str | None) -> tuple[str, object]:
    """A shipped experiment's table (with what it asks and where it ran) and its figure."""
    result = shipped_experiments().get(name) if name else None
    if result is None:
        return NO_EXPERIMENTS, experiment_figure(None)
    return result.markdown(), experiment_figure(result)
