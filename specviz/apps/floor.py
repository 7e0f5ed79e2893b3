"""The machine's physical floor for one target forward: what no engine can beat, written beside what ours takes.

A forward over n tokens after ``context`` cached ones must at least read every weight it multiplies by and
the cached keys and values once, and do its matrix arithmetic. So its time is at least the larger of

    bytes read / memory bandwidth      and      flops / matrix rate,

with both rates measured here, on this device, in the target's dtype and at the thread count in use (a
long read-only reduction for the bandwidth, a large square matrix product for the rate). The floor leaves
out everything that is not weights, cache or matrix work: norms, rotary embeddings, softmax, Python,
kernel launches. That is the point: measured / floor says how much of a forward is engine, not model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specviz.core.target import TargetModel
from specviz.core.timing import now


@dataclass(frozen=True)
class Rates:
    """What this device sustains: bytes read per second and matrix flops per second in ``dtype``."""

    device: str
    dtype: str
    threads: int
    read_gb_s: float
    matmul_gflop_s: float


@dataclass(frozen=True)
class ForwardCost:
    """What one forward must move and compute at the least."""

    weight_bytes: int  # every matrix the forward multiplies by (the LM head included), read once
    cache_bytes: int  # the cached keys and values every layer reads
    flops: int  # 2 per multiply-add: the linear layers and attention's two products

    def floor_ms(self, rates: Rates) -> float:
        memory = (self.weight_bytes + self.cache_bytes) / (rates.read_gb_s * 1e9)
        compute = self.flops / (rates.matmul_gflop_s * 1e9)
        return 1000 * max(memory, compute)


def _best_of(fn, device: str, repeats: int = 5) -> float:
    fn()  # warm up (allocation, page faults, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        start = now(device)
        fn()
        best = min(best, now(device) - start)
    return best


@functools.cache
def measure_rates(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Rates:
    """This device's read bandwidth (a sum over 256 MiB, far beyond any cache) and matrix rate (a 2048² product
    in ``dtype``), best of five: the floor is a bound, so the fastest run is the right estimate."""
    with torch.inference_mode():
        big = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MiB
        read = _best_of(lambda: big.sum(), device)
        n = 2048
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        mm = _best_of(lambda: a @ b, device)
    return Rates(str(device), str(dtype).replace("torch.", ""), torch.get_num_threads(),
                 read_gb_s=big.numel() * big.element_size() / read / 1e9, matmul_gflop_s=2 * n ** 3 / mm / 1e9)


def forward_cost(target: TargetModel, tokens: int, context: int) -> ForwardCost:
    """The least one forward of ``tokens`` query rows after ``context`` cached positions must do on ``target``.
    Linear weights are counted in their own dtype (an fp32 head stays fp32); the embedding table is not read
    whole (only the rows looked up), so it counts only where it is also the head."""
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    weight_flops = 2 * tokens * sum(m.weight.numel() for m in linears)
    cfg = target.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    width = torch.finfo(target.dtype).bits // 8
    keys = context + tokens
    cache_bytes = 2 * target.num_layers * kv_heads * head_dim * context * width
    attention_flops = 2 * 2 * target.num_layers * heads * head_dim * tokens * keys  # q·k and p·v
    return ForwardCost(weight_bytes, cache_bytes, weight_flops + attention_flops)
