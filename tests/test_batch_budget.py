"""Budgets per batch size (``tuning.tune(batch=B)``): a batch's verify-cost curve, measured over B sequences and
priced per sequence, makes verified tokens dearer, so the chosen draft shrinks as the batch fills the machine."""

from __future__ import annotations

import pytest

from specviz.apps import tuning
from specviz.apps.profile import profile
from specviz.core.budget import Estimate
from specviz.core.load import load_target


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir), "float32", "cpu")


def test_a_batch_curve_times_every_sequence_in_one_forward(target):
    result = profile(target, 32, (1, 4), repeats=1, tree=True, batch=3)
    assert result["batch"] == 3 and [r["tokens"] for r in result["curve"]] == [1, 4]
    assert all(r["ms"] > 0 for r in result["curve"])


def test_the_budget_shrinks_when_a_full_batch_makes_tokens_dear(target, monkeypatch, tmp_path):
    """Synthetic costs: alone, a verify of n tokens costs 10 + 0.05 n ms (nearly free); in a batch of 8, 8 (2 + 4 n)
    ms for all, so 2 + 4 n per sequence. And a drafter whose draft at depth d is accepted with probability 0.6^d
    (the warm-up's replay says so): alone a long draft pays, in the full batch the shortest."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))

    def estimate(records, depth, size):
        k = min(depth, size)
        return Estimate(1.0 + sum(0.6 ** d for d in range(1, k + 1)), k)

    monkeypatch.setattr(tuning, "estimate", estimate)

    def fake_profile(target, context, sizes, repeats=5, tree=False, floor=False, batch=1):
        cost = (lambda n: 10 + 0.05 * n) if batch == 1 else (lambda n: batch * (2 + 4 * n))
        return {"curve": [{"tokens": n, "ms": cost(n)} for n in sizes]}

    priced = []
    real_choose = tuning.choose

    def choose(options, chain, ar_other_ms, tree):
        priced.append(chain(8))
        return real_choose(options, chain, ar_other_ms, tree)

    monkeypatch.setattr(tuning, "profile", fake_profile)
    monkeypatch.setattr(tuning, "choose", choose)
    alone, full = tuning.tune(target, "pld"), tuning.tune(target, "pld", batch=8)
    assert priced == [pytest.approx(10.4), pytest.approx(34.0)]  # 8 tokens: alone, and per sequence in the batch
    assert alone.settings["num_tokens"] >= 5 and full.settings["num_tokens"] == 1
    assert full.expected_speedup < alone.expected_speedup
    files = sorted(p.name for p in (tmp_path / "budgets").glob("*.json"))
    assert len([f for f in files if f.startswith("pld-")]) == 2 and any(f.endswith("-batch8.json") for f in files)
    assert tuning.resolve(target, "pld", {}, batch=8)[0] == full.settings  # read back, not measured again
    assert len(priced) == 2
