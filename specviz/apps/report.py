"""Results as text: one bench (or several runs of it, merged) as Markdown, and ``docs/results.md`` generated
from every results file committed in ``assets/bench`` and ``assets/experiments``.

The docs page is a function of the files alone (sorted by name, no clock read, no machine asked), so the same
files always give the same page and a test can tell when the committed page has fallen behind them.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

from specviz.core import files
from specviz.core.errors import SettingsError

from .batch_results import BatchSweep
from .experiment_results import SHIPPED as EXPERIMENTS_DIR
from .experiment_results import shipped_experiments
from .orderings import ordering_table
from .results import BenchResult, budget_table, markdown_rows, markdown_table, merge
from .train_profile_results import TrainProfile

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "assets" / "bench"
RESULTS_DOC = ROOT / "docs" / "results.md"
DOCS_COMMAND = "python -m specviz report --docs"


def headline(result: BenchResult) -> str:
    """The question set, prompts, tokens, dtype, rule, machine and date in one line."""
    text = (f"{result.questions or '?'}, {len(result.per_prompt)} prompts, {result.max_new_tokens} new tokens, "
            f"{result.dtype}, {result.sampling.rule}; {result.machine}, {result.date}")
    return text + (f"; {result.kernels_note}" if result.kernels_note else "")


def bench_report(result: BenchResult) -> str:
    """The method table, then the tuned budgets and the papers' orderings where the run has them."""
    parts = [markdown_table(result)]
    if budgets := budget_table(result):
        parts.append("Tuned budgets, expected against measured:\n\n" + budgets)
    if orderings := ordering_table(result.methods):
        parts.append("The papers' orderings, at equal budgets:\n\n" + orderings)
    return "\n\n".join(parts)


def summary_table(result: BenchResult) -> str:
    """The terminal's table after a bench: τ, speed, speedup and equality per method."""
    lines = [f"{'method':28} {'tau':>6} {'tok/s':>7} {'speedup':>8} {'identical':>10}"]
    for label, m in result.methods.items():
        tau = "-" if m.tau is None else f"{m.tau:.2f}"
        lines.append(f"{label:28} {tau:>6} {m.tokens_per_s:7.1f} {m.speedup:7.2f}x {m.exactness_text():>10}")
    return "\n".join(lines)


def report(paths: list[str]) -> str:
    """What ``python -m specviz report FILE...`` prints: the runs merged (each method from the first run that
    has it), their headline and tables; a batch-size sweep's file, its table."""
    if len(paths) == 1 and {"points", "max_new_tokens"} <= (_read(Path(paths[0])) or {}).keys():
        return BatchSweep.load(Path(paths[0])).markdown()
    result = merge([BenchResult.load(Path(p)) for p in paths], list(paths))
    merged = ("merged from " + ", ".join(paths) + " (speeds compare within one run only)\n") if len(paths) > 1 else ""
    return merged + headline(result) + "\n\n" + bench_report(result)


def _read(path: Path) -> dict | None:
    """The file's JSON object, or None when it is not one (a damaged or foreign file is listed, never fatal)."""
    try:
        data = json.loads(files.read_bytes(path))
    except (OSError, lzma.LZMAError, EOFError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _profile_row(name: str, d: dict) -> str:
    curve = " · ".join(f"{r['tokens']}: {r['ms']:.1f}" for r in d["curve"])
    return (f"| `{name}` | {d.get('machine', '?')} | {d.get('dtype', '?')} | {d.get('shape', 'chain')} "
            f"| {d.get('context', '?')} | {d.get('date', '?')} | {curve} |")


def _sweep_section(name: str, d: dict) -> str:
    rows = [f"| `{r['method']}` | {r['rule']} | {r['temperature']} | {r['tau']:.2f} | {r['speedup']:.2f}× "
            f"| {r['tokens_per_s']:.1f} | {r['log_likelihood']:.3f} |" for r in d["rows"]]
    table = markdown_rows(["method", "rule", "temperature", "τ", "speedup", "tok/s",
                           "log-likelihood per token"], rows)
    return f"### `{name}`\n\n{d.get('machine', '?')}, {d.get('dtype', '?')}\n\n{table}"


def _reliability_section(name: str, d: dict) -> str:
    """The reliability test's summary (``tests/test_reliability.py``)."""
    outcomes = ", ".join(f"{kind} {n}" for kind, n in sorted(d["outcomes"].items()))
    extra = d.get("extra", {})
    return (f"### `{name}`\n\n{extra.get('machine', '?')}, {extra.get('date', '?')}: {d['cases']} cases "
            f"({outcomes}); {len(d['failures'])} failures (tracebacks, errors without a message, hangs). A "
            "well-behaved caller's first token while four others sent abusive or 10 MB requests: at most "
            f"{d['max_good_first_token_s']:.2f} s; a 10 MB prompt refused, as its caller saw it, in "
            f"{extra.get('huge_prompt_refused_alone_s', 0) * 1000:.0f} ms alone and at most "
            f"{d['huge_prompt_refused_s'] * 1000:.0f} ms amid the abuse ({extra.get('huge_prompts_refused', '?')} of "
            "them); the "
            "app's resident memory before the burst of generated calls, after it, and after its single-fault "
            "calls were sent again (a second time where the first repeat grew by 64 MB or more): "
            f"{extra.get('rss_mb_before_after_burst_after_repeats', '?')} MB.")


def _bench_section(name: str, result: BenchResult) -> str:
    state = " (interrupted: the prompts every method finished)" if result.interrupted else ""
    return f"### `{name}`\n\n{headline(result)}{state}\n\n{bench_report(result)}"


def _app_speed_section(name: str, d: dict) -> str:
    """``scripts/measure_app.py``'s medians: tokens/s through each way into the app, against the CLI's."""
    rows = [f"| {key.split(' ', 1)[0]} | {key.split(' ', 1)[1]} | {v['tok_s']:.1f} | {v['x_cli']:.2f} |"
            for key, v in d["summary"].items()]
    low, high = d["first_token_on_screen_s"]
    return (f"### `{name}`\n\n`{d['command']}` on {d['machine']}, {d['date']}; {d['dtype']}; {d['settings']}; "
            f"{d['max_new_tokens']} tokens.\n\n" + markdown_rows(["method", "through", "tok/s", "× CLI"], rows)
            + f"\n\nRun to first token on screen: {low:.2f}–{high:.2f} s; chromium kept "
            f"{d['chromium_cores_median']:.2f} cores busy during a run (median).")


def results_doc(folder: Path | None = None, experiments: Path | None = None) -> str:
    """``docs/results.md``: every results file in ``folder`` as a section, benches first, then the verify-cost
    curves and the temperature sweeps, then the papers' experiments (``experiments``, default
    ``assets/experiments``); files of another layout are named, not read."""
    benches, profiles, sweeps, reliability, app, batches, training, other = [], [], [], [], [], [], [], []
    for path in sorted(p for p in Path(folder or BENCH_DIR).iterdir() if p.name.endswith((".json", ".json.xz"))):
        d = _read(path)
        if d is not None and {"methods", "per_prompt"} <= d.keys():
            try:
                benches.append(_bench_section(path.name, BenchResult.from_dict(d)))
                continue
            except (KeyError, TypeError, AttributeError, SettingsError):
                pass
        elif d is not None and isinstance(d.get("curve"), list):
            profiles.append(_profile_row(path.name, d))
            continue
        elif d is not None and TrainProfile.is_one(d):
            training.append(f"### `{path.name}`\n\n" + TrainProfile.from_dict(d).markdown())
            continue
        elif d is not None and isinstance(d.get("rows"), list):
            sweeps.append(_sweep_section(path.name, d))
            continue
        elif d is not None and {"points", "max_new_tokens"} <= d.keys():
            batches.append(f"### `{path.name}`\n\n" + BatchSweep.from_dict(d).markdown())
            continue
        elif d is not None and {"summary", "first_token_on_screen_s"} <= d.keys():
            app.append(_app_speed_section(path.name, d))
            continue
        elif d is not None and {"cases", "outcomes", "failures"} <= d.keys():
            reliability.append(_reliability_section(path.name, d))
            continue
        other.append(f"- `{path.name}`")
    parts = [f"# Results\n\nGenerated by `{DOCS_COMMAND}` from the results files in `assets/bench/`; edit those "
             "files (or add one), then run the command. τ is the tokens per target forward; speedups compare "
             "methods within one run, on that run's machine."]
    if benches:
        parts.append("## Benchmarks\n\n" + "\n\n".join(benches))
    if profiles:
        parts.append("## Verify-cost curves\n\nms of one target forward verifying n tokens after the context "
                     "(`python -m specviz profile`).\n\n"
                     + markdown_rows(["file", "machine", "dtype", "shape", "context", "date", "tokens: ms"], profiles))
    if training:
        parts.append("## Training steps\n\nA training step of each method by phase, and a whole run's projected "
                     "time (`python -m specviz profile --train METHODS`).\n\n" + "\n\n".join(training))
    if sweeps:
        parts.append("## Temperature sweeps\n\n" + "\n\n".join(sweeps))
    if batches:
        parts.append("## Throughput against batch size\n\n`python -m specviz bench --batch-sizes ...`: the questions "
                     "decoded B at a time, each method beside AR at the same B.\n\n" + "\n\n".join(batches))
    if reliability:
        parts.append("## Reliability\n\n" + "\n\n".join(reliability))
    if app:
        parts.append("## The app against the CLI\n\n" + "\n\n".join(app))
    shipped = shipped_experiments(experiments or EXPERIMENTS_DIR)
    if shipped:
        parts.append("## The papers' experiments\n\n`python -m specviz experiment NAME` (files in "
                     "`assets/experiments/`): each arm trained at the budget named, then benched beside AR.\n\n"
                     + "\n\n".join(f"### `{name}.json`\n\n{r.markdown()}" for name, r in shipped.items()))
    if other:
        parts.append("## Other files\n\nNot a layout this page reads:\n\n" + "\n".join(other))
    return "\n\n".join(parts) + "\n"


def write_results_doc(path: Path | None = None, folder: Path | None = None, experiments: Path | None = None) -> Path:
    """Regenerate ``docs/results.md`` (or ``path``) from the results files in ``folder`` and ``experiments``."""
    path = path or RESULTS_DOC
    files.atomic_write(path, results_doc(folder or BENCH_DIR, experiments))
    return path
