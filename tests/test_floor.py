"""apps.floor: the least a forward must read and compute, counted by hand on a tiny target, and the floor as
the larger of the memory and the compute bound."""

from __future__ import annotations

import math

import pytest

from specviz.apps.floor import ForwardCost, Rates, forward_cost, measure_rates
from specviz.apps.profile import curve_text, profile


def test_forward_cost_counts_the_weights_cache_and_flops_by_hand(tiny_target):
    target = tiny_target(vocab_size=32)  # hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, fp32
    h, mlp, layers, heads, kv, d, vocab = 64, 128, 2, 4, 2, 16, 32
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * mlp  # q, k, v, o, gate/up/down
    params = layers * per_layer + vocab * h  # the head (tied to the embedding: one table, read once as the head)
    cost = forward_cost(target, tokens=3, context=10)
    assert cost.weight_bytes == 4 * params
    assert cost.cache_bytes == 2 * layers * kv * d * 10 * 4
    assert cost.flops == 2 * 3 * params + 4 * layers * heads * d * 3 * 13


def test_the_floor_is_the_larger_of_the_memory_and_the_compute_bound():
    rates = Rates("cpu", "float32", 1, read_gb_s=10.0, matmul_gflop_s=100.0)
    memory_bound = ForwardCost(weight_bytes=10**9, cache_bytes=10**9, flops=10**9)
    assert memory_bound.floor_ms(rates) == pytest.approx(200.0)  # 2 GB at 10 GB/s; 1 GFLOP takes 10 ms
    compute_bound = ForwardCost(weight_bytes=10**6, cache_bytes=0, flops=10**11)
    assert compute_bound.floor_ms(rates) == pytest.approx(1000.0)


def test_profile_writes_the_floor_beside_each_size(tiny_target):
    result = profile(tiny_target(vocab_size=32), context=8, sizes=(1, 4), repeats=1, floor=True)
    rates = result["rates"]
    assert rates["read_gb_s"] > 0 and rates["matmul_gflop_s"] > 0 and math.isfinite(rates["read_gb_s"])
    for row in result["curve"]:
        assert row["x_floor"] == pytest.approx(row["ms"] / row["floor_ms"]) and row["floor_ms"] > 0
    assert result["curve"][1]["floor_ms"] >= result["curve"][0]["floor_ms"]  # more rows: more flops and keys
    assert "x the floor" in curve_text(result) and "GB/s" in curve_text(result)
    assert measure_rates("cpu") is measure_rates("cpu")  # measured once per process
