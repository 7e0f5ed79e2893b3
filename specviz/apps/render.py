"""What the app shows, from StepRecords: coloured token HTML and plotly figures (no Gradio here)."""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from drafters import METHODS
from specviz.core.engine import StepRecord
from specviz.core.metrics import acceptance_by_depth, acceptance_counts, decode_steps, summarize
from specviz.core.timing import PHASES

from .methods import LABEL

COLOURS = {"accepted": "#2e9e4f", "bonus": "#d98c00", "rejected": "#c0392b", "prompt": "#777777"}
PHASE_COLOURS = {"draft": "#4c78a8", "verify": "#f58518", "accept": "#54a24b", "other": "#b0b0b0"}
LEGEND = ('<span class="sv-acc">accepted draft</span> · <span class="sv-bonus">the target\'s own token (bonus or '
          'correction)</span> · <span class="sv-rej">rejected draft</span>. Hover a token for its step, depth and '
          'probabilities.')
CSS = """
#race-columns { display: grid !important; grid-template-columns: repeat(auto-fill, minmax(min(100%, 300px), 1fr));
  gap: 10px; align-items: start; }
#race-columns > * { min-width: 0 !important; max-width: 100%; margin: 0 !important; }
.sv-column { min-width: 0; overflow: hidden; border: 1px solid #e5e5e5; border-radius: 6px; padding: 6px 8px; }
.sv-head { font-size: 0.9em; margin-bottom: 4px; overflow-wrap: anywhere; }
.sv-tokens { overflow-wrap: anywhere; word-break: break-word; }
.sv-same { color: #2e7d32; } .sv-tie { color: #b7791f; } .sv-differs, .sv-error { color: #c0392b; }
.sv-tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.6; }
.sv-acc { background: #d7f0dd; border-bottom: 2px solid #2e9e4f; }
.sv-bonus { background: #fbe7c2; border-bottom: 2px solid #d98c00; }
.sv-rej { color: #c0392b; text-decoration: line-through; opacity: 0.7; }
.sv-rejn { color: #c0392b; font-size: 0.7em; vertical-align: super; cursor: help; }
.sv-rejn .sv-rejl { display: none; } .sv-rejn:hover .sv-rejl, .sv-rejn:focus .sv-rejl { display: inline; }
.sv-nodes { font-size: 0.85em; border-collapse: collapse; }
.sv-nodes td, .sv-nodes th { padding: 1px 6px; white-space: nowrap; }
.sv-nodes tr.sv-accepted { background: #d7f0dd; } .sv-nodes tr.sv-rejected { background: #f8dcd8; }
.sv-nodes tr.sv-not { color: #999; }
#step-info { overflow-x: auto; }
"""
LAYOUT = dict(uirevision="specviz", height=300, margin=dict(l=50, r=20, t=40, b=40))
# as the default, not per figure: a figure's own template runs plotly's checks every time
pio.templates.default = "plotly_white"


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def _span(kind: str, text: str, title: str) -> str:
    shown = html.escape(text).replace("\n", "↵\n") or "∅"  # newlines and empty tokens stay visible
    return f'<span class="sv-{kind}" title="{html.escape(title, quote=True)}">{shown}</span>'


def visible(token: str) -> str:
    """A token as a label: newlines, tabs, a bare space and the empty token stay visible."""
    if not token.strip():
        return token.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣") or "∅"
    return token.replace("\n", "↵")


def _p(value) -> str:
    return "–" if value is None else f"{float(value):.3f}"


def node_p(record: StepRecord, i: int) -> float | None:
    """The target's probability of draft node ``i`` (0-based), where an observer filled it (``engine.hover``)."""
    return float(record.node_target_p[i]) if i < record.node_target_p.numel() else None


def step_html(record: StepRecord, decode, show_rejected: bool) -> str:
    """One step's spans: accepted drafts, then rejected alternatives (optional), then the bonus."""
    tree, out = record.tree, []
    depths = tree.depths.tolist()
    draft_p = [math.exp(x) for x in tree.logprobs.tolist()] if tree.logprobs is not None else [None] * len(tree)

    def node_title(i: int, what: str) -> str:
        return (f"step {record.step} · depth {depths[i]} · {what} · draft p {_p(draft_p[i])} · "
                f"target p {_p(node_p(record, i))}")

    for node, token in zip(record.path, record.tokens):
        out.append(_span("acc", decode([token]), node_title(node - 1, "accepted draft")))
    if show_rejected and len(tree):  # a count per step; hover or tap (focus) opens the struck-through drafts
        last = record.path[-1] if record.path else 0
        rejected = [_span("rej", decode([int(tree.tokens[i])]), node_title(i, "rejected draft"))
                    for i, parent in enumerate(tree.parents.tolist()) if parent == last and i + 1 not in record.path]
        if rejected:
            count = f'title="{len(rejected)} rejected at depth {len(record.path) + 1}">✗{len(rejected)}'
            listed = f'<span class="sv-rejl">{"".join(rejected)}</span>'
            out.append(f'<span class="sv-rejn" tabindex="0" {count}{listed}</span>')
    if len(record.tokens) > len(record.path):  # the bonus (it may be cut at the length limit)
        kind = "correction" if record.corrected else "bonus"
        title = (f"step {record.step} · depth {len(record.path) + 1} · target {kind} token · "
                 f"target p {_p(record.bonus_target_p)}")
        out.append(_span("bonus", decode([record.tokens[-1]]), title))
    return "".join(out)


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39")  # one colour per method, the same everywhere
COMPACT_LEGEND = dict(font=dict(size=10), itemwidth=30, tracegroupgap=2)


def method_colour(label: str) -> str:
    """A method's colour, the same in every race, plot and column header: by its place in the registry (a
    label with settings, ``eagle2:depth=4``, takes its method's); a label of no method gets one by its name.
    A second column of one method (``eagle2 (paper)``) takes a lighter shade of it, so the two stay apart."""
    name = label.split(":", 1)[0]
    name, tag = match.groups() if (match := LABEL.fullmatch(name)) else (name, None)
    order = list(METHODS)
    index = order.index(name) if name in order else sum(map(ord, label))
    colour = PALETTE[index % len(PALETTE)]
    if tag is None:
        return colour
    channels = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * 0.5):02x}" for c in channels)


def method_colours(labels) -> dict[str, str]:
    return {label: method_colour(label) for label in labels}


def step_detail(record: StepRecord, decode, before: list[int], label: str = "", greedy: bool = True) -> str:
    """One speculation step for the step-through view: the text so far, every draft node with its draft
    and target probabilities and what became of it, why the accepted path stopped, the target's own
    token, the time split, and what the method drafted from (a PLD n-gram, ReDrafter's beams)."""
    tree, path, info = record.tree, record.path, record.tree.info
    on_path, depths = {0, *path}, tree.depths.tolist()
    draft_p = [math.exp(x) for x in tree.logprobs.tolist()] if tree.logprobs is not None else [None] * len(tree)
    tok = [visible(decode([int(t)])) for t in tree.tokens]
    parents = tree.parents.tolist()
    outcome = []
    for i, parent in enumerate(parents, start=1):
        outcome.append("accepted" if i in on_path else "rejected" if parent in on_path else "not reached")
    shown = html.escape(decode(before)[-600:])
    mine = html.escape(decode(record.tokens))
    parts = [f"<h4>{html.escape(label)} · step {record.step}</h4>",
             f'<div class="sv-tokens">…{shown}<mark>{mine}</mark></div>']
    if not len(tree):
        parts.append("<p>No draft this step: the target verified its last token alone and added one of its own.</p>")
    else:
        last = path[-1] if path else 0
        stop = [i for i, p in enumerate(parents, start=1) if p == last and i not in on_path]
        accepted = " ".join(f"<code>{html.escape(tok[n - 1])}</code>" for n in path) or "nothing"
        parts.append(f"<p>Drafted <b>{len(tree)}</b> node(s) up to depth {tree.max_depth}; the target accepted "
                     f"<b>{len(path)}</b>: {accepted}.</p>")
        if stop and record.decisions:
            parts.append(f"<p>It stopped at depth {len(path) + 1}: every child of the last accepted node was "
                         "rejected. How the rule decided, node by node, with the numbers as it saw them:</p>"
                         + decisions_table(record, tok, greedy))
        elif stop:
            i = stop[0]
            rule = ("greedy: the target keeps a draft only if it is its own top token"
                    if greedy else "rejection sampling: kept with probability min(1, target p / draft p)")
            parts.append(f"<p>It stopped at depth {len(path) + 1}: the first rejected node, "
                         f"<code>{html.escape(tok[i - 1])}</code>, had draft p {_p(draft_p[i - 1])} and target p "
                         f"{_p(node_p(record, i - 1))} ({rule}).</p>")
        elif path:
            parts.append(f"<p>The accepted path ends at depth {len(path)} because the draft ended there: node "
                         f"{path[-1]} has no children.</p>")
        rows = "".join(
            f'<tr class="sv-{o.split()[0]}"><td>{i}</td><td>{depths[i - 1]}</td><td>{parents[i - 1]}</td>'
            f"<td><code>{html.escape(tok[i - 1])}</code></td><td>{_p(draft_p[i - 1])}</td>"
            f"<td>{_p(node_p(record, i - 1))}</td><td>{o}</td></tr>"
            for i, o in enumerate(outcome, start=1))
        parts.append('<table class="sv-nodes"><tr><th>node</th><th>depth</th><th>parent</th><th>token</th>'
                     f"<th>draft p</th><th>target p</th><th></th></tr>{rows}</table>")
    if len(record.tokens) > len(path):
        kind = ("correction (it replaces the rejected drafts)" if record.corrected
                else "bonus (the draft ended, and the same forward gives one more token)")
        parts.append(f"<p>Then the target added its own token <code>{html.escape(decode([record.tokens[-1]]))}"
                     f"</code> (target p {_p(record.bonus_target_p)}): the {kind}.</p>")
    if "ngram" in info:
        parts.append(f"<p>Prompt lookup matched the n-gram <code>{html.escape(decode(info['ngram']))}</code> at "
                     f"position {info['ngram_at']} and proposed what followed it.</p>")
    if "beams" in info:
        w, n = info["beams"].shape
        parts.append(f"<p>{w} beams of {n} tokens merged into {len(tree)} nodes (compression "
                     f"{info['compression']:.2f}): shared prefixes are verified once.</p>")
    if "lookahead" in info:
        parts.append(f"<p>Lookahead: {info['candidates']} node(s) of pooled n-grams that start with the last "
                     f"token, and the Jacobi window ({info['levels']} level(s) × {info['window']} columns, "
                     f"{info['lookahead']} nodes) whose next tokens become the next level.</p>")
    if "choices" in info:
        parts.append(f"<p>Medusa's static tree: {len(info['choices'])} rank paths chosen from the heads' "
                     "validation accuracy; every step uses the same shape.</p>")
    t = record.timings
    parts.append("<p>Time: " + " · ".join(f"{p} {1000 * getattr(t, p):.1f} ms" for p in PHASES) + "</p>")
    return "\n".join(parts)


def acceptance_figure(runs: dict[str, list[StepRecord]]) -> go.Figure:
    """One line per method: conditional α_k solid, unconditional dashed (one legend entry per method)."""
    fig, colours = go.Figure(), method_colours(runs)
    for label, records in runs.items():
        cond, uncond = acceptance_by_depth(records)
        accepted, tested, steps = acceptance_counts(records)
        depth = list(range(1, len(cond) + 1))
        for values, of, dash, kind, what in ((cond, tested, "solid", "conditional", "steps that tested depth"),
                                             (uncond, [steps] * len(depth), "dash", "unconditional", "steps, depth")):
            fig.add_trace(go.Scatter(x=depth, y=values, mode="lines+markers", name=label, legendgroup=label,
                                     showlegend=kind == "conditional", line=dict(color=colours[label], dash=dash),
                                     customdata=list(zip(accepted, of)),
                                     hovertemplate=f"{label} {kind}: α_%{{x}} = %{{y:.2f}}, accepted in "
                                                   f"%{{customdata[0]}} of %{{customdata[1]}} {what} %{{x}}"
                                                   "<extra></extra>"))
    # the key on two lines: on one it ran past a third of a laptop's width
    fig.update_layout(title="α_k per draft depth<br><sup>solid: conditional (÷ steps that tested depth k)<br>"
                      "dashed: unconditional (÷ all steps)</sup>", legend=COMPACT_LEGEND,
                      xaxis=dict(title="draft depth k", dtick=1), yaxis_title="α_k", yaxis_range=[0, 1.05],
                      **{**LAYOUT, "margin": {**LAYOUT["margin"], "t": 70}})
    return fig


def accepted_length_figure(runs: dict[str, list[StepRecord]]) -> go.Figure:
    """How many tokens each step brought (accepted drafts + the target's own), as a box per method."""
    fig, colours = go.Figure(), method_colours(runs)
    for label, records in runs.items():
        fig.add_trace(go.Box(y=[len(r.tokens) for r in decode_steps(records)], name=label, boxmean=True,
                             marker_color=colours[label], boxpoints="outliers", showlegend=False))
    fig.update_layout(title="tokens per step (accepted + bonus)<br><sup>box: quartiles · dashed: mean (τ)</sup>",
                      yaxis=dict(title="tokens", rangemode="tozero", dtick=1), **LAYOUT)
    return fig


def latency_figure(runs: dict[str, list[StepRecord]]) -> go.Figure:
    per_token = {label: summarize(records).latency_ms for label, records in runs.items()}
    fig = go.Figure()
    for phase in PHASES:
        fig.add_trace(go.Bar(x=list(runs), y=[ms[phase] for ms in per_token.values()], name=phase,
                             marker_color=PHASE_COLOURS[phase]))
    fig.update_layout(title="latency per generated token (ms)", yaxis_title="ms / token", barmode="stack", **LAYOUT)
    return fig


def method_diagram(inputs: tuple[str, ...], drafter: str, output: str, title: str = "") -> go.Figure:
    """What a drafter reads (left), runs (middle) and hands the target to verify in one forward (right)."""
    fig = go.Figure()
    boxes = [(0.0, 1 - (i + 0.5) / max(len(inputs), 1), text, "#e8f0fb") for i, text in enumerate(inputs)]
    boxes += [(1.0, 0.5, drafter, "#fdf2dc"), (2.0, 0.5, output, "#e3f4e7"), (3.0, 0.5, "target verifies", "#eeeeee")]
    for x, y, text, colour in boxes:
        fig.add_shape(type="rect", x0=x - 0.42, x1=x + 0.42, y0=y - 0.17, y1=y + 0.17, fillcolor=colour,
                      line=dict(color="#999999", width=1))
        fig.add_annotation(x=x, y=y, text="<br>".join(_wrap(text, 24)), showarrow=False, font=dict(size=11))
    starts = [(x, y) for x, y, _, _ in boxes[: len(inputs)]] + [(1.0, 0.5), (2.0, 0.5)]
    ends = [(1.0, 0.5)] * len(inputs) + [(2.0, 0.5), (3.0, 0.5)]
    for (x0, y0), (x1, y1) in zip(starts, ends):
        fig.add_annotation(x=x1 - 0.43, y=y1, ax=x0 + 0.43, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=3, arrowwidth=1.5, arrowcolor="#666666", text="")
    fig.update_xaxes(visible=False, range=[-0.5, 3.5])
    fig.update_yaxes(visible=False, range=[-0.05, 1.05])
    fig.update_layout(title=title, height=190, margin=dict(l=10, r=10, t=30, b=10), showlegend=False)
    return fig


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + len(word) + 1 > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line] if line else lines


def sweep_figure(rows: list[dict]) -> go.Figure:
    """Speedup and the target's log-likelihood of the output against temperature: a line per method and
    rule, solid for lossless rules, dashed for lossy ones."""
    fig = make_subplots(1, 2, subplot_titles=("speedup vs AR at the same temperature",
                                              "quality: target log-likelihood per token"), horizontal_spacing=0.12)
    colours = method_colours(dict.fromkeys(r["method"] for r in rows))
    lines: dict[tuple, list[dict]] = {}
    for r in rows:
        lines.setdefault((r["method"], "lossless" if r["lossless"] else "lossy (typical)"), []).append(r)
    for (method, kind), points in lines.items():
        style = dict(color=colours[method], dash="solid" if kind == "lossless" else "dash")
        x = [p["temperature"] for p in points]
        for col, key in ((1, "speedup"), (2, "log_likelihood")):
            fig.add_trace(go.Scatter(x=x, y=[p[key] for p in points], mode="lines+markers", line=style,
                                     name=f"{method} · {kind}", legendgroup=f"{method}{kind}", showlegend=col == 1),
                          row=1, col=col)
    fig.update_xaxes(title_text="temperature")
    fig.update_layout(legend=COMPACT_LEGEND, **{**LAYOUT, "height": 360})
    return fig


def tree_figure(record: StepRecord | None, decode, label: str = "") -> go.Figure:
    """One step's draft tree: x = depth, y = leaf order, the accepted path in green, the rest dimmed.

    For beam drafters (ReDrafter) a left panel shows the beams before their shared prefixes merged."""
    if record is None or not len(record.tree):
        fig = go.Figure()
        fig.update_layout(title=f"{label}: no draft tree at this step", **LAYOUT)
        return fig
    tree, info = record.tree, record.tree.info
    accepted = {0, *record.path}
    beams = "beams" in info
    fig = make_subplots(1, 2, column_widths=[0.4, 0.6], horizontal_spacing=0.08,
                        subplot_titles=("beams before dedup", "tree after dedup")) if beams else go.Figure()
    where = dict(row=1, col=2) if beams else {}
    for trace in _tree_traces(tree, accepted, decode):
        fig.add_trace(trace, **where)
    if beams:
        for trace in _beam_traces(info["beams"], info["beam_nodes"], accepted, decode):
            fig.add_trace(trace, row=1, col=1)
        fig.update_yaxes(visible=False, autorange="reversed", row=1, col=1)
    fig.update_yaxes(visible=False)
    extra = (f" · {info['beams'].shape[0]} beams × {info['beams'].shape[1]} → {len(tree)} nodes "
             f"(compression {info['compression']:.2f})") if beams else ""
    rows = max(sum(1 for k in tree.children() if not k), info["beams"].shape[0] if beams else 0)
    fig.update_layout(title=f"{label} step {record.step}: {len(tree)} nodes, {record.accepted} accepted{extra}",
                      **{**LAYOUT, "height": min(max(380, 100 + 16 * rows), 1400)})  # one readable row per leaf
    deepest = max(tree.max_depth, info["beams"].shape[1] if beams else 0)
    fig.update_xaxes(title_text="depth", range=[-0.3, deepest + 0.8], dtick=1)  # room for the deepest labels
    return fig


def _tree_traces(tree, accepted: set[int], decode) -> list[go.Scatter]:
    kids = tree.children()
    y = [0.0] * (len(tree) + 1)
    leaves = [0]

    def place(node: int) -> float:  # leaves get consecutive rows, parents sit at their children's mean
        if not kids[node]:
            y[node] = leaves[0]
            leaves[0] += 1
        else:
            y[node] = sum(place(c) for c in kids[node]) / len(kids[node])
        return y[node]

    place(0)
    depth = [0] + tree.depths.tolist()
    traces = []
    for on_path in (False, True):
        xs, ys = [], []
        for i, parent in enumerate(tree.parents.tolist(), start=1):
            if (i in accepted) == on_path:
                xs += [depth[parent], depth[i], None]
                ys += [y[parent], y[i], None]
        traces.append(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                 line=dict(color=COLOURS["accepted"] if on_path else "#cccccc",
                                           width=3 if on_path else 1)))
    text = ["root"] + [visible(decode([int(t)])) for t in tree.tokens]
    parents = [-1] + tree.parents.tolist()
    # a node whose parent was kept but which was not is rejected (red); one below a rejected node was never reached
    fate = ["accepted" if i in accepted else "rejected" if parents[i] in accepted else "not reached"
            for i in range(len(tree) + 1)]
    fate[0] = "root"
    colour = [{"rejected": COLOURS["rejected"], "not reached": "#bbbbbb"}.get(f, COLOURS["accepted"]) for f in fate]
    traces.append(go.Scatter(x=depth, y=y, mode="markers+text", text=text, textposition="middle right",
                             marker=dict(color=colour, size=10), showlegend=False,
                             hovertext=[f"node {i} · depth {d} · {f}" for i, (d, f) in enumerate(zip(depth, fate))],
                             hoverinfo="text"))
    return traces


def _beam_traces(beams, beam_nodes, accepted: set[int], decode) -> list[go.Scatter]:
    """Each beam a row of its tokens; a token whose merged node was accepted is green."""
    width, length = beams.shape
    xs, ys, text, colour = [], [], [], []
    for w in range(width):
        for d in range(length):
            xs.append(d + 1)
            ys.append(w)
            text.append(visible(decode([int(beams[w, d])])))
            colour.append(COLOURS["accepted"] if int(beam_nodes[w, d]) in accepted else "#bbbbbb")
    rows = dict(x=[v for w in range(width) for v in (1, length, None)],
                y=[v for w in range(width) for v in (w, w, None)])
    return [go.Scatter(**rows, mode="lines", line=dict(color="#dddddd", width=1), hoverinfo="skip", showlegend=False),
            go.Scatter(x=xs, y=ys, mode="markers+text", text=text, textposition="top center", showlegend=False,
                       marker=dict(color=colour, size=9), hovertext=[f"beam {y} · depth {x}" for x, y in zip(xs, ys)],
                       hoverinfo="text")]


def decisions_table(record: StepRecord, tok: list[str], greedy: bool) -> str:
    """The accept rule's decisions (``verify.Decision``) as a table a teacher can redo by hand. Greedy keeps a
    node iff its token is the target's top token; rejection sampling keeps it iff draw × draft p < target p,
    with target p the residual after the siblings rejected before it and draft p renormalised without them."""
    if greedy:
        head = "<th>node</th><th>token</th><th>the target's top token?</th><th></th>"
        rows = [f"<td>{d.node}</td><td><code>{html.escape(tok[d.node - 1])}</code></td>"
                f"<td>{'yes' if d.accepted else 'no'}</td><td>{'kept' if d.accepted else 'rejected'}</td>"
                for d in record.decisions]
    else:
        head = ("<th>node</th><th>token</th><th>target p (residual)</th><th>draft p</th><th>draw u</th>"
                "<th>u × draft p &lt; target p?</th>")
        rows = [f"<td>{d.node}</td><td><code>{html.escape(tok[d.node - 1])}</code></td><td>{_p(d.target_p)}</td>"
                f"<td>{_p(d.draft_p)}</td><td>{_p(d.draw)}</td>"
                + (f"<td>{d.draw * d.draft_p:.3f} {'&lt;' if d.accepted else '≥'} {d.target_p:.3f}: "
                   f"{'kept' if d.accepted else 'rejected'}</td>" if d.draw is not None else
                   "<td>draft p 0: rejected without a draw</td>")
                for d in record.decisions]
    body = "".join(f'<tr class="sv-{"accepted" if d.accepted else "rejected"}">{row}</tr>'
                   for d, row in zip(record.decisions, rows))
    return f'<table class="sv-nodes sv-decisions"><tr>{head}</tr>{body}</table>'
