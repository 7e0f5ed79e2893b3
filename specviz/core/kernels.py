"""Which CPU kernel runs a packed linear layer at each row count: measured on this machine, once, and cached.

Packed oneDNN weights (``core.packing``) are not faster at every row count on every CPU. On an AVX2 EPYC
they won from one row; on an AMX Xeon in fp32 PyTorch's default (MKL) kernels ran one to three rows
faster and the packed ones won from four. A rule chosen on one host is wrong on another, so it is
measured where the model runs:

- every packed layer of the model is called once per round, in order, at each row count in ``SIZES``, on
  its packed weight and on its dense one (the plain kernel: ``core.rows``' where it is built, else PyTorch's
  default), the two interleaved; so the weights stream from memory as in
  a forward, which a loop over one layer (its weight warm in the cache) would not show;
- a row count's time is the median of its rounds;
- ``plain_up_to`` is the largest measured row count up to which the plain kernel beats the packed ones
  at *every* measured count by at least ``MARGIN`` (noise must not flip a layer's kernel); 0 keeps every
  call packed. Counts between two measured ones go to the packed kernels.

The choice is cached under ``~/.cache/specviz/kernels``, keyed by the CPU, torch, the thread count and the
layers' shapes and dtypes, so a model is measured once per machine (a second or two); ``refresh`` measures
again. Greedy decoding stays exact in fp32: both kernels compute the same products, rounded apart only in
the last bits, as a one-token forward and a tree verify already are (near-ties, classified).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from . import rows
from .cpu import cpu_flags, cpuinfo
from .files import atomic_write, cache_dir, content_key
from .packing import packed_linear, packed_linears, packed_weight, set_plain_rows

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # the row counts decoding runs: AR, chains, small trees
MARGIN = 0.05
ROUNDS = 5
REVISION = 5  # bump when the measurement or a kernel's speed changes, so cached choices are measured again


@dataclass(frozen=True)
class KernelChoice:
    """Milliseconds of one call of every packed layer at each row count, both ways, and the rule they give."""

    sizes: tuple[int, ...]
    plain_ms: tuple[float, ...]  # the plain kernel on the dense weights
    packed_ms: tuple[float, ...]  # oneDNN on the packed weights
    plain_up_to: int  # calls of at most this many rows run on the plain kernel; 0: all packed
    plain: str = "default kernels"  # which plain kernel was measured: "the rows kernel" (``core.rows``) or PyTorch's

    def describe(self) -> str:
        if not self.plain_up_to:
            return "packed at every row count"
        count = "1 row" if self.plain_up_to == 1 else f"up to {self.plain_up_to} rows"
        return f"{self.plain} for {count}, packed above"


def crossover(sizes: tuple[int, ...], plain_ms: tuple[float, ...], packed_ms: tuple[float, ...],
              margin: float = MARGIN) -> int:
    """The largest of ``sizes`` (ascending) up to which ``plain_ms`` beats ``packed_ms`` by ``margin`` at every
    size; 0 where it does not at the smallest."""
    best = 0
    for size, plain, packed in zip(sizes, plain_ms, packed_ms):
        if plain > packed * (1 - margin):
            break
        best = size
    return best


def measure(model: torch.nn.Module, sizes: tuple[int, ...] = SIZES, rounds: int = ROUNDS) -> KernelChoice:
    """Time ``model``'s packed layers at each of ``sizes`` rows, both ways (the module docstring's rule)."""
    layers = packed_linears(model)
    if not layers:
        raise ValueError("the model has no packed linear layers to measure")
    times: dict[tuple[int, bool], list[float]] = {(s, p): [] for s in sizes for p in (True, False)}
    gen = torch.Generator().manual_seed(0)
    inputs = {s: [torch.randn(s, m.in_features, generator=gen).to(m.weight.dtype) for m in layers] for s in sizes}
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round warms up
            for size in sizes:
                for plain in ((True, False) if r % 2 else (False, True)):
                    start = time.perf_counter()
                    for m, x in zip(layers, inputs[size]):
                        if plain:
                            rows.linear(x, m.weight, m.bias)
                        else:
                            packed_linear(x, packed_weight(m), m.bias)
                    if r:
                        times[size, plain].append(1000 * (time.perf_counter() - start))
        plain = "the rows kernel" if rows.fits(inputs[sizes[0]][0], layers[0].weight) else "default kernels"
    plain_ms = tuple(round(statistics.median(times[s, True]), 3) for s in sizes)
    packed_ms = tuple(round(statistics.median(times[s, False]), 3) for s in sizes)
    return KernelChoice(tuple(sizes), plain_ms, packed_ms, crossover(tuple(sizes), plain_ms, packed_ms), plain)


def _key(model: torch.nn.Module) -> str:
    shapes = [(m.out_features, m.in_features, str(m.weight.dtype)) for m in packed_linears(model)]
    return content_key([REVISION, cpuinfo("model name"), sorted(cpu_flags()), os.cpu_count(), torch.__version__,
                        torch.get_num_threads(), shapes,
                        rows.unavailable() if any(d == str(torch.float32) for *_, d in shapes) else None])


def choose(model: torch.nn.Module, refresh: bool = False) -> KernelChoice | None:
    """This machine's ``KernelChoice`` for ``model``'s packed layers, applied to them; from the cache unless
    ``refresh`` or none is cached. None where the model has no packed layers."""
    if not packed_linears(model):
        return None
    path = cache_dir() / "kernels" / f"{_key(model)}.json"
    choice = None
    if path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
            choice = KernelChoice(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        except (OSError, ValueError, TypeError):
            choice = None  # unreadable: measured again and rewritten
    if choice is None:
        choice = measure(model)
        try:
            atomic_write(path, json.dumps(asdict(choice), indent=1))
        except OSError:
            pass  # a read-only cache: measured again next time
    set_plain_rows(model, choice.plain_up_to)
    return choice
