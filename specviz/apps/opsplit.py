"""Where one forward's time goes, by kind of operator: matrix kernels, attention, every other operator, and what
lies outside any operator (Python, dynamo's guards, launches). ``profile --ops`` prints it beside the verify-cost
curve, so "the engine's own cost" is a measured share, not an inference from the floor.

Operators are classified by name from ``torch.profiler``'s self times (a parent's time never counts twice); on a
GPU the kernels' own device times are classified the same way. The wall time is the curve's (measured without
the profiler); ``outside`` is the wall less the operators, never below zero. A graph whose wrapper inductor wrote
in C++ (``core.capture``, on the CPU) calls attention's kernel directly, not as an operator the profiler sees: its
time is then in "other" (the graph's own), and ``attention_ms`` is None rather than a zero that was not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
from torch.profiler import ProfilerActivity, profile

# CPU operator names (oneDNN, MKL and ATen) and GPU kernel-name fragments that are matrix products
MATRIX = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear",
          "specviz_rows::linear", "specviz_rows::layer", "specviz_rows::group",  # core.rows and its layers
          "gemm", "cutlass", "xmma", "matmul")
# attend: the few-query kernel (core.attention); the extension's refine (core.head) is an "other" operator
ATTENTION = ("scaled_dot_product", "flash", "fmha", "efficient_attention", "specviz_rows::attend")
# rows torch.compile's runtime adds around a graph: guards and argument handling, i.e. outside the operators
DISPATCH = ("cache lookup", "pregraph", "torch-compiled region", "aotdispatcher")


def kind(name: str) -> str:
    """"matrix", "attention", "other" or "outside" (torch.compile's own runtime) for a profiler row's name."""
    low = name.lower()
    if any(d in low for d in DISPATCH):
        return "outside"
    if any(m in low for m in MATRIX):
        return "matrix"
    if any(a in low for a in ATTENTION):
        return "attention"
    return "other"


@dataclass(frozen=True)
class OpSplit:
    """ms of one forward of ``tokens`` tokens, by kind; ``x_matrix`` is the wall over the matrix kernels alone."""

    tokens: int
    wall_ms: float
    matrix_ms: float
    attention_ms: float | None  # None: not visible as an operator (inside a compiled graph's own time)
    other_ms: float
    outside_ms: float

    @property
    def x_matrix(self) -> float:
        return self.wall_ms / self.matrix_ms if self.matrix_ms else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "x_matrix": self.x_matrix}

    @classmethod
    def from_dict(cls, row: dict) -> OpSplit:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


def split(forward: Callable[[], None], tokens: int, wall_ms: float, device: torch.device, repeats: int = 5) -> OpSplit:
    """``forward()`` (one verify, the cache rewound after it) profiled ``repeats`` times after one untimed call."""
    forward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    totals = {"matrix": 0.0, "attention": 0.0, "other": 0.0, "outside": 0.0}
    graphs = False  # whether a compiled graph ran (its attention may be hidden in its own time)
    for event in prof.key_averages():
        graphs = graphs or "compiledfxgraph" in event.key.lower()
        if device.type == "cuda":
            us = event.self_device_time_total  # kernels: the device's time; host operators launch them
        else:
            us = event.self_cpu_time_total
        totals[kind(event.key)] += us / 1000 / repeats
    inside = totals["matrix"] + totals["attention"] + totals["other"]
    attention = None if graphs and not totals["attention"] else totals["attention"]
    return OpSplit(tokens, wall_ms, totals["matrix"], attention, totals["other"], max(0.0, wall_ms - inside))


def split_text(rows: list[OpSplit]) -> str:
    lines = ["where one forward's time goes (operators' own times, profiled; outside = Python, guards, launches):"]
    for r in rows:
        attention = "    –" if r.attention_ms is None else f"{r.attention_ms:5.1f}"
        lines.append(f"  {r.tokens:3d} tokens: {r.wall_ms:7.1f} ms = matrix {r.matrix_ms:6.1f} + attention "
                     f"{attention} + other operators {r.other_ms:5.1f} + outside {r.outside_ms:5.1f}; "
                     f"{r.x_matrix:.2f}x the matrix kernels alone")
    if any(r.attention_ms is None for r in rows):
        lines.append("  (–: attention ran inside the compiled graph, whose C++ wrapper calls it directly: it is "
                     "counted in other operators)")
    return "\n".join(lines)
