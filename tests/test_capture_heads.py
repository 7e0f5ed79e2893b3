"""drafters.captured.CapturedHeads: a hidden-state drafter's whole draft (Medusa's heads and top k; the beam search of
ReDrafter and semi-AR) compiled as one graph on a compiled target, where asked (``SPECVIZ_DRAFTER_ENGINE=compiled``).
One tiny target is compiled for the module; each drafter's graph is compiled when it is built."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from conftest import drafts_on_after_its_graph_breaks, session_checkpoint
from drafters import build_drafter
from specviz.core.engine import run
from specviz.core.load import prepare
from specviz.core.target import TargetModel

PROMPTS = [[3, 5, 7, 11, 13], [2, 9, 4, 4, 1, 30, 17, 8, 8, 21, 5]]
HEADS = [("medusa", dict(heads=3, top_k=3, total_tokens=8)), ("redrafter", dict(width=3, length=3)),
         ("semi-lstm", dict(width=1, length=4))]


@pytest.fixture(scope="module")
def compiled(tiny_llama) -> TargetModel:
    target = TargetModel(prepare(tiny_llama(vocab_size=64, seed=3, max_positions=320), pack=True))
    status = target.use_engine("compiled", layout="live")
    assert status.path == "compiled", status
    return target


@pytest.mark.parametrize("method,settings", HEADS, ids=[m for m, _ in HEADS])
def test_compiled_heads_draft_through_their_graph_and_the_output_is_the_targets(method, settings, compiled,
                                                                                 ref_greedy, monkeypatch):
    """Built on a compiled target where asked, the drafter compiles its draft before its first decode; its drafts
    went through the graph (no graph compiled while decoding), and the output is still the target's own."""
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")
    checkpoint = str(session_checkpoint(compiled.eager_view(), method))
    drafter = build_drafter(method, compiled, checkpoint=checkpoint, **settings)
    assert drafter.capture is not None and drafter.capture.ready, drafter.capture.error
    graphs = counters["stats"]["unique_graphs"]
    for prompt in PROMPTS:
        result = run(compiled, drafter, prompt + prompt, 40, stop_on_eos=False)
        assert result.output_ids == ref_greedy(compiled.model, prompt + prompt, 40)
    assert drafter.capture.calls > 0 and sum(r.accepted for r in result.records) > 0
    assert counters["stats"]["unique_graphs"] == graphs
    again = build_drafter(method, compiled, checkpoint=checkpoint, **settings)
    assert again.capture is drafter.capture  # a drafter built again (the tuner's) takes the graph of the first


def test_heads_stay_eager_unless_asked(compiled, monkeypatch):
    """The default (``auto``) compiles feature drafters off the CPU but never the heads: their graphs, one per draft
    shape, have not yet been timed on a GPU."""
    monkeypatch.delenv("SPECVIZ_DRAFTER_ENGINE", raising=False)
    checkpoint = str(session_checkpoint(compiled.eager_view(), "medusa"))
    assert build_drafter("medusa", compiled, checkpoint=checkpoint).capture is None


def test_a_compiled_draft_that_breaks_drafts_on_eagerly(compiled, ref_greedy, monkeypatch):
    """A draft graph that breaks costs no output: the drafter drafts on eagerly and says why."""
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")
    checkpoint = str(session_checkpoint(compiled.eager_view(), "redrafter"))
    drafter = build_drafter("redrafter", compiled, checkpoint=checkpoint, width=2, length=2)
    drafts_on_after_its_graph_breaks(drafter, "draft", compiled, ref_greedy, monkeypatch)
