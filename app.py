"""specviz: watch speculative-decoding drafters race side by side (Gradio).

    python app.py [--target HF_ID_OR_FOLDER]      # or SPECVIZ_TARGET; GRADIO_SERVER_NAME / _PORT

The target and every drafter load once, here at module level (never in gr.State). One generator
drives all selected methods through the fair race of ``specviz.race``; Stop cancels between steps.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import fields

import gradio as gr

from drafters import METHODS, build_drafter
from specviz import render, teaching
from specviz.data import load_questions
from specviz.engine import check_request
from specviz.errors import SpecvizError
from specviz.load import load_target
from specviz.metrics import summarize
from specviz.race import race
from specviz.verify import Sampling

try:  # ZeroGPU on a Space; a no-op everywhere else
    from spaces import GPU
except ImportError:
    def GPU(fn):
        return fn

MAX_NEW_TOKENS = 512
PLOT_EVERY = 8  # steps between plot refreshes while streaming


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.environ.get("SPECVIZ_TARGET"), help="HF model id or folder (default: embedded)")
    p.add_argument("--device", default=os.environ.get("SPECVIZ_DEVICE"))
    return p.parse_known_args()[0]


ARGS = _args()
START = time.perf_counter()
TARGET = load_target(ARGS.target, "float32", ARGS.device)
DRAFTERS, UNAVAILABLE = {}, {}
for _name in METHODS:
    try:
        DRAFTERS[_name] = build_drafter(_name, TARGET)
    except SpecvizError as _e:
        UNAVAILABLE[_name] = str(_e)
COLD_START_S = time.perf_counter() - START
EXAMPLES = [q.prompt for q in load_questions("mt-bench", per_category=1)[:4] + load_questions("humaneval", limit=2)]


def _setting_specs() -> list[tuple[str, str, int, int, int]]:
    """(method, field, low, high, default) for every integer setting with a range, for the accordions."""
    specs = []
    for name, (_, settings_cls) in METHODS.items():
        if name not in DRAFTERS:
            continue
        for f in fields(settings_cls):
            if f.name in settings_cls.ranges and isinstance(f.default, int):
                low, high = settings_cls.ranges[f.name]
                if name == "skip" and f.name == "layers":
                    high = TARGET.config.num_hidden_layers
                specs.append((name, f.name, low, min(high, 64), f.default))
    return specs


SETTINGS = _setting_specs()
_BUILT: dict[tuple, object] = {}


def _drafter(name: str, settings: dict):
    """The drafter for ``name`` with ``settings``; built once per distinct setting, defaults preloaded."""
    key = (name, tuple(sorted(settings.items())))
    if not settings:
        return DRAFTERS[name]
    if key not in _BUILT:
        if len(_BUILT) > 32:
            _BUILT.clear()
        _BUILT[key] = build_drafter(name, TARGET, **settings)
    return _BUILT[key]


def _decode(ids) -> str:
    return TARGET.decode(ids)


def _stats(label: str, records, clock: float, ar_rate: float | None, same: bool | None) -> str:
    m = summarize(records, clock)
    rate = m.new_tokens / clock if clock > 0 else 0.0
    speed = f" · {rate / ar_rate:.2f}× AR" if ar_rate and label != "ar" else ""
    badge = "" if same is None else (" · ✅ identical to AR" if same else " · ❌ differs from AR")
    return f"**{label}** · {m.new_tokens} tokens · τ {m.tau:.2f} · {rate:.1f} tok/s{speed}{badge}"


@GPU
def compare(prompt: str, methods: list[str], max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            show_rejected: bool = True, *setting_values):
    """Stream the race. Yields (one html per method column, 3 figures, message, runs state)."""
    notes = []
    if not prompt or not prompt.strip():
        raise gr.Error("The prompt is empty: type a question or pick an example.")
    methods = [m for m in (methods or []) if m in DRAFTERS]
    if not methods:
        raise gr.Error("Pick at least one available method.")
    if not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS:
        notes.append(f"max new tokens clamped to [1, {MAX_NEW_TOKENS}]")
    max_new_tokens = min(max(int(max_new_tokens), 1), MAX_NEW_TOKENS)
    try:
        sampling = Sampling(temperature=float(temperature), top_p=float(top_p), seed=0)
        ids = TARGET.encode_chat(prompt)
        check_request(TARGET, ids, max_new_tokens)
    except SpecvizError as e:
        raise gr.Error(str(e)) from None
    chosen = {}
    for m in methods:
        settings = {f: int(v) for (name, f, _, _, default), v in zip(SETTINGS, setting_values)
                    if name == m and v is not None and int(v) != default}
        try:
            chosen[m] = _drafter(m, settings)
        except SpecvizError as e:
            notes.append(f"{m}: {e}")
    if not chosen:
        raise gr.Error("; ".join(notes))
    lanes, last_plot = {}, 0
    for n, lane in enumerate(race(TARGET, chosen, ids, max_new_tokens, sampling)):
        lanes[lane.label] = lane
        if n - last_plot >= PLOT_EVERY or all(x.finished for x in lanes.values()) and len(lanes) == len(methods):
            last_plot = n
            yield _view(lanes, methods, show_rejected, sampling, notes, plots=True)
        else:
            yield _view(lanes, methods, show_rejected, sampling, notes, plots=False)
    yield _view(lanes, methods, show_rejected, sampling, notes, plots=True)


def _view(lanes, methods, show_rejected, sampling, notes, plots: bool):
    ar = lanes.get("ar")
    ar_rate = len(ar.output_ids) / ar.clock if ar and ar.clock else None
    columns, stats = [], []
    for m in METHODS:
        lane = lanes.get(m)
        if lane is None:
            columns.append(gr.update(visible=m in methods, value=""))
            continue
        same = None
        if ar is not None and ar.finished and lane.finished and sampling.greedy and m != "ar":
            same = lane.output_ids == ar.output_ids
        body = render.tokens_html(lane.records, _decode, show_rejected)
        if lane.error:
            body += f'<p class="sv-rej">stopped: {lane.error}</p>'
        columns.append(gr.update(visible=True, value=f"<h4>{_stats(m, lane.records, lane.clock, ar_rate, same)}</h4>{body}"))
    runs = {k: v.records for k, v in lanes.items()}
    figures = ([render.acceptance_figure(runs), render.accepted_length_figure(runs), render.latency_figure(runs)]
               if plots else [gr.skip()] * 3)
    message = "; ".join(notes) or ""
    runs = {k: {"records": v.records, "clock": v.clock, "error": v.error} for k, v in lanes.items()} if plots else gr.skip()
    return (*columns, *figures, message, runs)


def tree_view(runs: dict, method: str, step: int):
    records = ((runs or {}).get(method) or {}).get("records", [])
    record = next((r for r in records if r.step == int(step)), None)
    return render.tree_figure(record, _decode, method)


def compare_api(prompt: str, methods: list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                top_p: float = 1.0) -> dict:
    """The public API: per method the text, each token's origin and step, and the run's metrics."""
    result, runs = {}, {}
    for view in compare(prompt, methods, max_new_tokens, temperature, top_p, False):
        runs = view[-1]
    for label, run in runs.items():
        origins, ids = [], []
        for r in run["records"]:
            ids += r.tokens
            origins += [{"token": t, "text": _decode([t]), "step": r.step,
                         "origin": "accepted draft" if i < r.accepted else "target"} for i, t in enumerate(r.tokens)]
        result[label] = {"text": _decode(ids), "tokens": origins, "error": run["error"],
                         "metrics": summarize(run["records"], run["clock"]).as_dict()}
    return result


@GPU
def run_benchmark(question_set: str, limit: int, methods: list[str], max_new_tokens: int,
                  progress=gr.Progress(track_tqdm=True)):
    """The engine's bench on a subset; a table of τ and speedup per method × category, and its CSV."""
    import tempfile

    import pandas as pd

    from specviz.bench import bench

    methods = [m for m in (methods or []) if m in DRAFTERS]
    if not methods:
        raise gr.Error("Pick at least one available method.")
    questions = load_questions(question_set, limit=max(1, min(int(limit), 80)))
    result = bench(TARGET, methods, questions, max_new_tokens=max(1, min(int(max_new_tokens), MAX_NEW_TOKENS)))
    rows = []
    for label, m in result["methods"].items():
        row = {"method": label, "τ": round(m.get("tau", 1.0), 2), "speedup": round(m["speedup"], 2),
               "tok/s": round(m["tokens_per_s"], 1), "identical to AR": f"{m['identical_to_ar']}/{m['prompts']}"}
        for cat, c in sorted(m["by_category"].items()):
            row[f"{cat} τ"] = None if c["tau"] is None else round(c["tau"], 2)
            row[f"{cat} ×"] = round(c["speedup"], 2)
        rows.append(row)
    table = pd.DataFrame(rows)
    path = os.path.join(tempfile.mkdtemp(), f"specviz-{question_set}-{len(questions)}q.csv")
    table.to_csv(path, index=False)
    return table, path


def learn_text() -> str:
    parts = ["Papers and code: " + " · ".join(f"[{k}]({v})" if v else k for k, v in teaching.PAPERS.items())]
    for name, drafter in DRAFTERS.items():
        params = drafter.num_parameters()
        parts.append(teaching.note(name, drafter.title, params, 100 * params / TARGET.num_parameters))
    parts += [f"### {k}\nunavailable: {v}" for k, v in UNAVAILABLE.items()]
    return "\n\n".join(parts)


with gr.Blocks(title="specviz") as demo:
    gr.Markdown("# specviz: speculative decoding, side by side\n"
                f"Target **{TARGET.name}** on {TARGET.device}; loaded in {COLD_START_S:.1f} s. "
                "Green: accepted draft tokens · amber: the target's own (bonus or correction) token · "
                "red, struck through: rejected drafts.")
    if UNAVAILABLE:
        gr.Markdown("Unavailable: " + "; ".join(f"**{k}** ({v})" for k, v in UNAVAILABLE.items()))
    with gr.Tab("Race"):
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=4, scale=3)
            with gr.Column(scale=1):
                methods = gr.Dropdown(list(DRAFTERS), value=[m for m in ("ar", "pld", "eagle2") if m in DRAFTERS],
                                      multiselect=True, label="Methods")
                max_new = gr.Slider(1, MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens")
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
                show_rejected = gr.Checkbox(value=True, label="Show rejected drafts")
        setting_inputs = []
        with gr.Row():
            for method in dict.fromkeys(name for name, *_ in SETTINGS):
                with gr.Accordion(f"{method} settings", open=False):
                    for name, field, low, high, default in SETTINGS:
                        if name == method:
                            setting_inputs.append(gr.Slider(low, high, value=default, step=1, label=field))
        gr.Examples(EXAMPLES, inputs=prompt, cache_examples=False)
        with gr.Row():
            run_btn = gr.Button("Run", variant="primary")
            stop_btn = gr.Button("Stop")
        message = gr.Markdown()
        with gr.Row(equal_height=False):
            columns = [gr.HTML(visible=False, elem_id=f"col-{m}") for m in METHODS]
        with gr.Row():
            alpha_plot, length_plot, latency_plot = gr.Plot(label="α_k"), gr.Plot(label="tokens per step"), gr.Plot(label="latency")
        runs = gr.State({})
        with gr.Row():
            tree_method = gr.Dropdown(list(DRAFTERS), value="eagle2" if "eagle2" in DRAFTERS else None, label="Tree of")
            tree_step = gr.Slider(1, MAX_NEW_TOKENS, value=1, step=1, label="Step")
        tree_plot = gr.Plot(label="draft tree")
        event = run_btn.click(compare, [prompt, methods, max_new, temperature, top_p, show_rejected, *setting_inputs],
                              [*columns, alpha_plot, length_plot, latency_plot, message, runs], api_name="race",
                              concurrency_id="engine")
        stop_btn.click(None, cancels=[event])
        for trigger in (tree_method.change, tree_step.change, runs.change):
            trigger(tree_view, [runs, tree_method, tree_step], tree_plot, api_visibility="private")
    with gr.Tab("Benchmark"):
        with gr.Row():
            bench_set = gr.Dropdown(["mt-bench", "humaneval"], value="mt-bench", label="Questions")
            bench_limit = gr.Slider(1, 80, value=8, step=1, label="Questions (first N)")
            bench_tokens = gr.Slider(16, MAX_NEW_TOKENS, value=128, step=16, label="Max new tokens")
        bench_methods = gr.Dropdown(list(DRAFTERS), value=[m for m in ("ar", "pld") if m in DRAFTERS],
                                    multiselect=True, label="Methods")
        bench_btn = gr.Button("Run benchmark")
        bench_table = gr.Dataframe(label="τ and speedup vs AR, per method and category")
        bench_csv = gr.File(label="CSV")
        bench_btn.click(run_benchmark, [bench_set, bench_limit, bench_methods, bench_tokens], [bench_table, bench_csv],
                        concurrency_id="engine", api_name="benchmark")
    with gr.Tab("Learn"):
        gr.Markdown(learn_text())
    api = gr.Button(visible=False)
    api.click(compare_api, [prompt, methods, max_new, temperature, top_p], gr.JSON(visible=False), api_name="compare",
              concurrency_id="engine")

if __name__ == "__main__":
    demo.queue(default_concurrency_limit=1).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), css=render.CSS)
