"""The batch-size figure (the Benchmark tab): each method's speedup over AR against batch size, and beside it
ReDrafter's throughput with its beams merged into one tree and kept apart, when both ran (its Fig. 6)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .batch_results import BatchPoint, BatchSweep
from .methods import parse_method
from .render import COMPACT_LEGEND, method_colour

APART = "tree_attention=0"  # the spec of ReDrafter's beams verified apart


def _dash(label: str) -> str:
    return "dash" if APART in label else "dot" if "preset=paper" in label else "solid"


def _hover(sweep: BatchSweep, p: BatchPoint) -> str:
    speedup = sweep.speedup(p)
    return (f"{p.method} · batch {p.batch_size}<br>{p.throughput:.1f} tok/s in all"
            + ("" if speedup is None else f" ({speedup:.2f}× AR)")
            + f"<br>{p.sequence_tok_s:.1f} tok/s per sequence · τ {p.tau:.2f}")


def batch_figure(sweep: BatchSweep | None) -> go.Figure:
    fig = make_subplots(1, 2, subplot_titles=("speedup vs AR at the same batch size",
                                              "ReDrafter: beams merged (tree attention) or apart"),
                        horizontal_spacing=0.12)
    points = sweep.points if sweep is not None else []
    sizes = sorted({p.batch_size for p in points}) or [1, 2, 4]
    for label in dict.fromkeys(p.method for p in points if p.method != "ar"):
        mine = sorted((p for p in points if p.method == label), key=lambda p: p.batch_size)
        speedups = [sweep.speedup(p) for p in mine]
        fig.add_trace(go.Scatter(x=[p.batch_size for p in mine], y=speedups, mode="lines+markers", name=label,
                                 line=dict(color=method_colour(label), dash=_dash(label)),
                                 hovertext=[_hover(sweep, p) for p in mine], hoverinfo="text"), 1, 1)
        if parse_method(label)[0] == "redrafter" and any(APART in p.method for p in points):
            fig.add_trace(go.Scatter(x=[p.batch_size for p in mine], y=[p.throughput for p in mine],
                                     mode="lines+markers", name=label, showlegend=False,
                                     line=dict(color=method_colour(label), dash=_dash(label)),
                                     hovertext=[_hover(sweep, p) for p in mine], hoverinfo="text"), 1, 2)
    fig.add_hline(y=1.0, line=dict(color="#999999", dash="dot", width=1), row=1, col=1)
    for col in (1, 2):
        fig.update_xaxes(title_text="batch size", type="log", tickvals=sizes, ticktext=[str(b) for b in sizes],
                         row=1, col=col)
    fig.update_yaxes(title_text="× AR (throughput)", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s, all sequences", row=1, col=2)
    fig.update_layout(height=380, margin=dict(l=50, r=20, t=40, b=40), legend=dict(orientation="h", y=-0.25,
                                                                                 **COMPACT_LEGEND))
    return fig
