"""The page: Race, Benchmark and Learn tabs wired to one ``Handlers``, and the server's launch."""

from __future__ import annotations

import os

import gradio as gr
from starlette.middleware import Middleware

from drafters import METHODS
from specviz.core.errors import SpecvizError
from specviz.core.load import EMBEDDED

from .. import render
from ..batch_plot import batch_figure
from ..questions import load_questions
from . import views
from .body_limit import BodyLimit, max_request_bytes
from .handlers import Handlers
from .joint import TAG as JOINT
from .plan import MAX_NEW_TOKENS, MAX_SEED, column_id, setting_specs
from .space import GPU
from .state import AppState

DEFAULT_METHODS = ("ar", "pld", "eagle2", "redrafter")
RULE_CHOICES = [("auto: greedy at T=0, else rejection sampling (lossless)", "auto"),
                ("rejection sampling (lossless)", "rejection"), ("typical acceptance (LOSSY)", "typical")]
# The arrow keys walk the step-through view, unless the user is typing somewhere.
ARROW_KEYS = """<script>
document.addEventListener('keydown', (e) => {
  if (e.target.closest('input, textarea, select, [contenteditable]')) return;
  const id = {ArrowLeft: 'step-prev', ArrowRight: 'step-next'}[e.key];
  if (id) document.getElementById(id)?.click();
});
</script>"""
# Run brings the columns to the top of the window. They are empty when it is clicked, so a screen is reserved for
# them first: without it a short page cannot scroll that far and the columns stay at the fold. The jump is
# instant because a smooth scroll is cancelled by the layout changes the first tokens cause.
SCROLL_JS = """() => {
  const columns = document.getElementById('race-columns');
  if (!columns) return;
  columns.style.minHeight = `${Math.round(window.innerHeight * 0.9)}px`;
  columns.scrollIntoView({block: 'start'});
}"""
QUEUE_SIZE = int(os.environ.get("SPECVIZ_QUEUE_SIZE", 16))  # waiting requests beyond this are turned away


def examples() -> list[str]:
    try:
        return [q.prompt for q in load_questions("mt-bench", per_category=1)[:5] + load_questions("humaneval", limit=3)]
    except SpecvizError:
        return ["Write a short poem about speculative decoding.", "Explain what a KV cache is in two sentences."]


def build_demo(state: AppState) -> gr.Blocks:
    specs = setting_specs(state)
    handlers = Handlers(state, specs)
    target = state.target
    picked = [m for m in DEFAULT_METHODS if m in state.drafters]
    joint = ""
    if state.joint:  # the comparison it was loaded for: each target's AR, and its method on each
        m = state.joint.method
        picked = [x for x in ("ar", m) if x in state.drafters] + [f"ar ({JOINT})", f"{m} ({JOINT})"]
        joint = (f" Beside it, the target adapted by joint training with `{m}` ({state.joint.folder.name}): "
                 f"columns tagged ({JOINT}) run on it.")
    private = dict(api_visibility="private")
    with gr.Blocks(title="specviz") as demo:
        dtype = str(target.dtype).replace("torch.", "")
        exact = ("exact: every lossless method gives the target's own text" if dtype == "float32" else
                 "fast: a lossless method may part from AR where the target's top two tokens nearly tie")
        name = "SmolLM2-135M-Instruct (embedded)" if target.name == EMBEDDED else target.name
        gr.Markdown(f"# specviz: speculative decoding, side by side\nTarget **{name}** "
                    f"({target.num_parameters / 1e6:.0f}M parameters) on {target.device} in {dtype} ({exact}; "
                    "the Precision switch changes it), "
                    f"loaded with {len(state.drafters)} methods in {state.cold_start_s:.1f} s.{joint} " + render.LEGEND)
        precisions = handlers.precisions
        tuning_line = gr.Markdown(precisions.line(), elem_id="tuning")
        timer = gr.Timer(2, active=not precisions.finished)  # stops itself once tuning has ended

        def status():
            return precisions.line(), gr.Timer(active=not precisions.finished)

        timer.tick(status, None, [tuning_line, timer], queue=False, **private)
        demo.load(status, None, [tuning_line, timer], queue=False, **private)
        if state.cannot_run:
            with gr.Accordion(f"Unavailable here: {', '.join(state.cannot_run)}", open=False):
                gr.Markdown("\n".join(f"- **{k}**: {v}" for k, v in state.cannot_run.items()), elem_id="unavailable")
        with gr.Tab("Race"):
            with gr.Row():
                prompt = gr.Textbox(label="Prompt", lines=4, scale=3)
                with gr.Column(scale=2):
                    methods = gr.Dropdown(handlers.columns, value=picked, multiselect=True, label="Methods",
                                          info="unavailable ones explain why when picked; a method twice: "
                                               "\"eagle2\" runs at the settings below, \"eagle2 (paper)\" at "
                                               "its paper's", elem_id="methods")
                    max_new = gr.Slider(1, MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens", elem_id="max-new")
                    with gr.Row():
                        temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
                        seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed",
                                         info="sampling: the same seed gives the same race")
                    rule = gr.Dropdown(RULE_CHOICES, value="auto", label="Acceptance rule", elem_id="rule",
                                       info="typical acceptance is lossy: its outputs need not follow the target")
                    precision = gr.Radio(precisions.choices(), value=dtype, label="Precision",
                                         info=precisions.trade(), elem_id="precision")
                    show_rejected = gr.Checkbox(value=False, label="Show rejected drafts (a count per step)",
                                                info="✗n after a step: hover or tap it for the struck-through "
                                                     "drafts; off: each column reads as the target's own text")
            setting_inputs = []
            with gr.Row():
                fastest = gr.Button("Preset: fastest on this machine", size="sm", elem_id="preset-fastest")
                paper = gr.Button("Preset: as in the papers", size="sm", elem_id="preset-paper")
            with gr.Row():
                for method in dict.fromkeys(s.method for s in specs):
                    with gr.Accordion(f"{method} settings", open=False):
                        setting_inputs += [gr.Slider(s.low, s.high, value=s.default, step=1, label=s.name,
                                                     elem_id=f"set-{s.method}-{s.name}")
                                           for s in specs if s.method == method]
            fastest.click(lambda p: handlers.preset("fastest", p), precision, setting_inputs, **private)
            # the other precision is loaded the first time it is picked; its sliders start at its own budgets
            precision.change(lambda p: [*handlers.preset("fastest", p), gr.Timer(active=True)], precision,
                             [*setting_inputs, timer], **private)
            # the sliders were laid out before the background tuning ended: a page opened later starts at the
            # budgets tuned so far, not at the untuned defaults baked into the layout
            demo.load(lambda: handlers.preset("fastest"), None, setting_inputs, queue=False, **private)
            paper.click(lambda p: handlers.preset("paper", p), precision, setting_inputs, **private)
            gr.Examples(examples(), inputs=prompt, cache_examples=False)
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                stop_btn = gr.Button("Stop", elem_id="stop")
            message = gr.Markdown(elem_id="message")
            with gr.Row(equal_height=False, elem_id="race-columns"):  # a grid: as many columns as fit, then rows
                columns = [gr.HTML(visible=False, elem_id=column_id(m), elem_classes="sv-column")
                           for m in handlers.columns]
            with gr.Row():
                empty = views.plots({})  # drawn at page load, so the browser has plotly ready before the first Run
                alpha_plot = gr.Plot(empty[0], label="α_k per depth", elem_id="plot-alpha")
                length_plot = gr.Plot(empty[1], label="tokens per step", elem_id="plot-length")
                latency_plot = gr.Plot(empty[2], label="latency per token", elem_id="plot-latency")
            runs = gr.State({})
            with gr.Row():
                download = gr.DownloadButton("Download this race (JSON: every step, tree and decision)",
                                             visible=False, size="sm", elem_id="download-race")
                download_replay = gr.DownloadButton("Download a page that replays it offline (HTML)",
                                                    visible=False, size="sm", elem_id="download-replay")
            gr.Markdown("### Step through a run\nPick a method, then walk its speculation steps with ◀ ▶ "
                        "(or the arrow keys): the draft tree, what the target accepted and why it stopped.")
            with gr.Row():
                tree_method = gr.Dropdown([], label="Method", scale=1, elem_id="tree-method")
                prev_btn = gr.Button("◀ previous", size="sm", scale=0, elem_id="step-prev")
                tree_step = gr.Slider(1, 2, value=1, step=1, label="Step", scale=3, elem_id="tree-step")
                next_btn = gr.Button("next ▶", size="sm", scale=0, elem_id="step-next")
            with gr.Row(equal_height=False):
                tree_plot = gr.Plot(label="draft tree", elem_id="plot-tree", scale=1)
                with gr.Column(scale=1):  # wide enough for the node table
                    step_info = gr.HTML(elem_id="step-info", elem_classes="sv-column")
            # Run is disabled while its race runs, and the page scrolls to the columns (below the fold on a laptop)
            started = run_btn.click(lambda: gr.Button(interactive=False), None, run_btn, queue=False, js=SCROLL_JS,
                                    **private)
            started.then(GPU(handlers.race), [prompt, methods, max_new, temperature, top_p, show_rejected, rule,
                                              seed, precision, *setting_inputs],
                         [*columns, alpha_plot, length_plot, latency_plot, message, runs], api_name="race",
                         concurrency_id="engine", show_progress="hidden").then(
                lambda: gr.Button(interactive=True), None, run_btn, queue=False, **private)
            stop_btn.click(handlers.stop, None, None, api_name="stop", concurrency_limit=None)
            tree_inputs, tree_outputs = [runs, tree_method, tree_step], [tree_plot, step_info]
            runs.change(lambda r: views.race_download(r, target.text.decode), runs, [download, download_replay],
                        **private)
            runs.change(views.tree_choices, runs, [tree_method, tree_step], **private).then(
                handlers.step_view, tree_inputs, tree_outputs, **private)
            tree_method.input(handlers.step_view, tree_inputs, tree_outputs, **private)
            tree_step.release(handlers.step_view, tree_inputs, tree_outputs, **private)
            for button, delta in ((prev_btn, -1), (next_btn, 1)):
                button.click(lambda r, m, s, d=delta: views.next_step(r, m, s, d), tree_inputs, tree_step,
                             **private).then(handlers.step_view, tree_inputs, tree_outputs, **private)
        with gr.Tab("Benchmark"):
            with gr.Row():
                bench_set = gr.Dropdown(["mt-bench", "humaneval"], value="mt-bench", label="Questions")
                bench_subset = gr.Radio(["first N", "per category"], value="per category", label="Subset")
                bench_count = gr.Slider(1, 80, value=1, step=1, label="N")
                bench_tokens = gr.Slider(16, MAX_NEW_TOKENS, value=128, step=16, label="Max new tokens")
            bench_methods = gr.Dropdown([m for m in METHODS if m not in state.left_out], value=picked,
                                        multiselect=True, label="Methods")
            with gr.Row():
                bench_btn = gr.Button("Run benchmark", variant="primary")
                bench_stop = gr.Button("Stop")
            bench_status = gr.Markdown()
            bench_table = gr.Dataframe(
                value=views.benchmark_table(None), label="τ and speedup vs AR, per method and category "
                "(same process, same prompts)", elem_id="bench-table")
            bench_csv = gr.File(label="CSV")
            bench_event = bench_btn.click(GPU(handlers.benchmark),
                                          [bench_set, bench_subset, bench_count, bench_methods, bench_tokens],
                                          [bench_table, bench_csv, bench_status], concurrency_id="engine",
                                          api_name="benchmark")
            bench_stop.click(None, cancels=[bench_event])
            def sweep_panel(title: str, about: str, button: str, run, api: str, ids: tuple[str, str, str | None],
                            plot_label: str, table_label: str, figure=None) -> None:
                """A sweep over the questions and methods above: its button, a plot, a table and a status."""
                with gr.Accordion(title, open=False):
                    gr.Markdown(about)
                    button_id, plot_id, table_id = ids
                    btn = gr.Button(button, elem_id=button_id)
                    status = gr.Markdown()
                    plot = gr.Plot(figure, label=plot_label, elem_id=plot_id)
                    table = gr.Dataframe(label=table_label, elem_id=table_id)
                    event = btn.click(GPU(run), [bench_set, bench_subset, bench_count, bench_methods, bench_tokens],
                                      [plot, table, status], concurrency_id="engine", api_name=api)
                    bench_stop.click(None, cancels=[event])

            sweep_panel("Temperature sweep: speed and quality against temperature, per acceptance rule",
                        "Each cell races the methods and AR at one temperature and rule on the questions above "
                        "(seed 0). Lossless rejection sampling keeps the target's distribution, so its quality (the "
                        "target's own log-likelihood of the text) follows AR's; typical acceptance is lossy and "
                        "drifts. The shape of ReDrafter's Table 2.",
                        "Run sweep (T = 0, 0.5, 1; rejection and typical)", handlers.sweep, "sweep",
                        ("sweep", "plot-sweep", None), "sweep", "per method, rule and temperature")
            sweep_panel("Batch size: throughput against batch size, per method",
                        "The questions above decoded 1, 2 and 4 at a time (continuous batching), each method beside "
                        "AR at the same batch size. Speculation's gain shrinks as the batch fills the machine (the "
                        "Learn tab says why); with `redrafter` picked, its paper's 4×4 beams also run merged into "
                        "one tree and kept apart: ReDrafter's Figure 6.",
                        "Run batch sweep (batch 1, 2, 4)", handlers.batches, "batches",
                        ("batch-sweep", "plot-batch", "batch-table"), "batch size", "per method and batch size",
                        batch_figure(None))
            with gr.Accordion("The papers' experiments: ablations and figures, with shipped results", open=False):
                shipped = views.experiment_choices()
                first = shipped[0] if shipped else None
                chosen = gr.Dropdown(shipped, value=first, label="Experiment", elem_id="experiment")
                text, figure = views.experiment_view(first)
                experiment_table = gr.Markdown(text, elem_id="experiment-table")
                experiment_plot = gr.Plot(figure, show_label=False, elem_id="plot-experiment")
                chosen.change(views.experiment_view, chosen, [experiment_table, experiment_plot], **private)
        with gr.Tab("Learn"):
            gr.Markdown(views.learn_text(state, notes=False))
            for name, drafter in state.drafters.items():
                with gr.Row(equal_height=False):
                    gr.Markdown(views.method_note(state, name), elem_classes="sv-note")
                    gr.Plot(views.method_figure(name), show_label=False, elem_id=f"diagram-{name}")
            if state.cannot_run:
                gr.Markdown("\n\n".join(f"### {k}\n**Unavailable here:** {v}" for k, v in state.cannot_run.items()))
        # plain typed values, so absurd ones reach the clamps
        gr.api(GPU(handlers.compare), api_name="compare", concurrency_id="engine")
    return demo


def calm_queue(queue) -> None:
    """Gradio's queue loop polls every 1 ms on Linux (and its progress loop every 10 ms), even when idle;
    on 2 cores that took a visible share of the engine's speed, while 20 ms and 100 ms cost nothing visible.
    These are attributes of Gradio's queue object, not public settings: left alone where they are missing."""
    if hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, 0.02)
    if hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 0.1)


def launch(demo: gr.Blocks, context_tokens: int) -> None:
    """Serve ``demo``; requests larger than a prompt filling ``context_tokens`` can need are refused unread."""
    demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)
    calm_queue(demo._queue)
    limit = Middleware(BodyLimit, max_bytes=max_request_bytes(context_tokens))
    # show_error: an error Gradio raises itself (too few arguments, a value its components refuse) reaches the
    # caller with its message; without it such an error arrives as {"error": null}
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), css=render.CSS, head=ARROW_KEYS,
                show_error=True, app_kwargs={"middleware": [limit]})
