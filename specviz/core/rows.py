"""The rows kernel: an fp32 product for the few rows decoding runs, built once per machine (``rows.cpp``).

Why: the default kernels and oneDNN's packed ones reach the memory floor at one row but cost a third to a half
more from four rows, so a small tree's verify pays for rows it barely computes on. ``rows.cpp`` reads each
weight row once for every input row, prefetching the next ones, and stays near the floor longer; each output's
arithmetic is the same whatever the row count, so a row's result does not depend on the rows beside it.

Rules:
- Built with torch's C++ extension loader (a C++ compiler and ninja; ``-march=native``, so the build is keyed
  by this CPU and torch) into ``~/.cache/specviz/kernels``, once per machine (seconds); loaded once a process.
- Where it cannot build or load, ``available()`` is False and ``unavailable()`` says why; every caller then
  runs the default kernels, so nothing breaks, it is only not faster.
- ``fits`` is the kernel's own rule: fp32, on the CPU, contiguous, the inner size a multiple of the vector
  width, no autograd. The kernel rule (``core.kernels``) measures where it beats the packed kernels.
- The same extension carries the packed layers' operators for compiled graphs (``layers.cpp``, registered by
  ``core.packing.register``): the kernel rule run in C++, so a graph's layer calls pay no Python.
"""

from __future__ import annotations

import functools
import platform
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .cpu import cpu_flags, cpuinfo
from .files import cache_dir, content_key

SOURCE = Path(__file__).with_name("rows.cpp")
# the extension's other sources: its headers, the packed layers' operators (``core.packing``) and the few-query
# attention (``attend.cpp``, ``core.attention``)
OTHERS = [Path(__file__).with_name(name) for name in ("rows.h", "simd.h", "layers.cpp", "attend.cpp")]
# of the kernel's speed, in the tuner's key (``apps.machine``): costs measured on an older kernel are measured
# again. Its results never change with it: every revision computes each output the same way
REVISION = 5  # 5: the refined head's rule in one call (``refine``)
_STATE: dict[str, object] = {}
_LOCK = threading.Lock()  # one build and load a process, whichever thread asks first
_width: int | None = None  # the kernel's vector width once loaded, 0 where it cannot be (``_load``)


def _build_folder() -> Path:
    key = content_key([SOURCE.read_text(), *(p.read_text() for p in OTHERS), torch.__version__,
                       cpuinfo("model name"), sorted(cpu_flags()), platform.python_version()])
    return cache_dir() / "kernels" / f"rows-{key}"


def _load() -> int:
    """Build (once per machine) and load the kernel; returns its vector width, or 0 where it cannot."""
    global _width
    if _width is None:  # the first call builds and loads; the later ones (every product's) read a number
        with _LOCK:
            if _width is None:
                _width = _build_and_load()
    return _width


def _build_and_load() -> int:
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        _STATE["reason"] = "the rows kernel needs an x86-64 CPU with AVX2 and FMA"
        return 0
    try:
        from torch.utils.cpp_extension import load

        folder = _build_folder()
        folder.mkdir(parents=True, exist_ok=True)
        load(f"specviz_rows_{folder.name[5:]}", [str(SOURCE), *(str(p) for p in OTHERS if p.suffix == ".cpp")],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], build_directory=str(folder), is_python_module=False,
             verbose=False)
        _register_fake()
        return int(torch.ops.specviz_rows.width())
    except Exception as e:  # no compiler, no ninja, a failed build: the default kernels serve
        _STATE["reason"] = f"the rows kernel did not build: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
        return 0


def _attend_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


@functools.cache
def _register_fake() -> None:
    """``attend``'s shape for compiled graphs (``core.attention``), once a process: a second load finds it there."""
    torch.library.register_fake("specviz_rows::attend", _attend_fake)


def available() -> bool:
    """Whether the rows kernel is built and loaded here (building it the first time on a machine)."""
    return _load() > 0


def loaded() -> bool:
    """Whether the extension is loaded already, without building or loading it (a compiled graph's question)."""
    return bool(_width)


def unavailable() -> str | None:
    """Why the rows kernel is not available, or None where it is."""
    return None if available() else str(_STATE.get("reason", "unknown"))


def plain_name() -> str:
    """What a packed layer's plain calls run on here (``core.packing``'s rule), as the column headers say it."""
    return "the rows kernel" if available() else "default kernels"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` may run on the rows kernel (the module docstring's rule)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return False  # before building: a bf16 or GPU target never needs the kernel
    width = _load()
    return width > 0 and x.shape[-1] % width == 0 and weight.is_contiguous() and not torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the rows kernel where it ``fits``, else on the default kernels."""
    if not fits(x, weight):
        return F.linear(x, weight, bias)
    out = torch.ops.specviz_rows.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out.add_(bias)
