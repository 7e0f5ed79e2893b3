"""One drafter object serves several decodes at once: each decode's state comes from ``drafter.start()``."""

from __future__ import annotations

import pytest
from test_engine import GREEDY_BUILDERS, NEW_TOKENS, PROMPTS, VOCAB

from drafters.ar import AutoregressiveDrafter
from specviz.core.engine import generate, run
from specviz.core.target import TargetModel


@pytest.fixture(scope="module")
def target(tiny_llama) -> TargetModel:
    return TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))  # test_engine's target: its trained drafters fit


@pytest.fixture(scope="module")
def ar_outputs(target) -> dict[int, list[int]]:
    return {i: run(target, AutoregressiveDrafter(), PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False).output_ids
            for i in (0, 5)}


@pytest.mark.parametrize("method", ["pld", "lookahead", "skip", "sps", "eagle2", "medusa", "redrafter"])
def test_one_drafter_object_serves_interleaved_decodes(method, target, ar_outputs):
    """Two decodes advanced in turn, step by step, by ONE drafter object (each with its own ``start()``
    state): each drafts, accepts and emits exactly what it does alone, and equals AR."""
    drafter = GREEDY_BUILDERS[method](target)
    a, b = 0, 5  # different prompts and lengths: one decode finishes while the other goes on
    alone = {i: run(target, drafter, PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False).records for i in (a, b)}
    steps = {i: generate(target, drafter, PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False) for i in (a, b)}
    got: dict[int, list] = {a: [], b: []}
    live = [a, b]
    while live:
        for i in list(live):
            record = next(steps[i], None)
            if record is None:
                live.remove(i)
            else:
                got[i].append(record)

    def trace(records):
        return [(r.tree.tokens.tolist(), r.tree.parents.tolist(), r.path, r.tokens) for r in records]

    for i in (a, b):
        assert [t for r in got[i] for t in r.tokens] == ar_outputs[i], f"prompt {i}: differs from AR"
        assert trace(got[i]) == trace(alone[i]), f"prompt {i}: interleaved differs from its run alone"
    assert sum(r.accepted for i in (a, b) for r in got[i]) > 0, f"{method} accepted nothing: the check is vacuous"
