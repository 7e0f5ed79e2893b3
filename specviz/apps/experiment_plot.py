"""An experiment's figure: τ per arm (and per temperature), and each arm's acceptance per depth beside it,
held-out agreement from training where the arms were trained, else the bench's acceptance."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .experiment_results import ExperimentResult
from .render import COMPACT_LEGEND

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def experiment_figure(result: ExperimentResult | None) -> go.Figure:
    if result is None or not result.arms:
        fig = go.Figure()
        fig.update_layout(title="no experiment results", height=360)
        return fig
    trained = any(a.training for a in result.arms)
    right = "held-out agreement per depth (training)" if trained else "acceptance per depth (bench, T = 0)"
    fig = make_subplots(1, 2, subplot_titles=("τ: tokens per target forward", right), horizontal_spacing=0.12)
    labels = list(dict.fromkeys(a.label for a in result.arms))
    for i, t in enumerate(result.temperatures):
        arms = {a.label: a for a in result.arms if a.temperature == t}
        fig.add_bar(x=labels, y=[arms[k].tau if k in arms else None for k in labels], name=f"T = {t:g}",
                    marker_color=PALETTE[i % len(PALETTE)], row=1, col=1,
                    hovertext=[f"{k}: {arms[k].speedup:.2f}× AR" if k in arms else "" for k in labels],
                    legendgroup="tau", showlegend=len(result.temperatures) > 1)
    for i, label in enumerate(labels):
        arm = next(a for a in result.arms if a.label == label and a.temperature == result.temperatures[0])
        if trained and arm.training:
            ys = [arm.training.agreement(d) for d in range(1, len(arm.training.val) + 1)]
        else:
            ys = list(arm.alpha or [])
        ys = [y for y in ys if y is not None]
        fig.add_scatter(x=list(range(1, len(ys) + 1)), y=ys, mode="lines+markers", name=label,
                        line={"color": PALETTE[i % len(PALETTE)]}, row=1, col=2)
    fig.update_xaxes(title_text="depth", dtick=1, row=1, col=2)
    fig.update_yaxes(title_text="τ", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(range=[0, 1], row=1, col=2)
    fig.update_layout(title=f"{result.name}: {result.paper}, {result.reproduces}", height=420,
                      barmode="group", legend=COMPACT_LEGEND)
    return fig
