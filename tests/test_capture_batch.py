"""Batches on the compiled path (``core.capture``, live-rows layout): a batch's verify forward runs through the
compiled graph with each row's cache writes planned outside it (``BatchSlabCache.planned``). Every sequence's
greedy output equals its own batch-1 decode and plain greedy decoding, across rows of different lengths, trees
of different sizes, sequences that end early and ones that join; the forwards ran compiled; batch sizes and
context lengths after the first few compile nothing more. The whole-buffer layout (CUDA graphs) keeps batches
eager."""

from __future__ import annotations

import pytest
import torch
from test_batch import batched_verify, prompts, random_tree
from test_engine import RandomTreeDrafter

from conftest import session_checkpoint
from drafters import build_drafter
from specviz.core.batch import run_batch
from specviz.core.batch_cache import BatchSlabCache
from specviz.core.cache import SlabCache
from specviz.core.engine import output_ids, run
from specviz.core.load import prepare
from specviz.core.target import TargetModel

VOCAB = 64


@pytest.fixture(scope="module")
def compiled(tiny_llama):
    """A tiny target prepared as ``load_target`` prepares one (grouped heads, packed layers), compiled in the
    live-rows layout, the CPU's."""
    target = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=3, max_positions=320), pack=True))
    assert target.use_engine("compiled", layout="live").path == "compiled"
    return target


def counting_compiled_calls(target: TargetModel) -> list[int]:
    """Wrap the compiled forward so each call is counted by its batch size (the list it returns grows)."""
    calls, run = [], target.captured.__call__

    class Counted(type(target.captured)):
        def __call__(self, keep, **kwargs):
            calls.append(kwargs["input_ids"].shape[0])
            return run(keep, **kwargs)

    target.captured.__class__ = Counted
    return calls


def test_a_compiled_batch_verify_equals_each_rows_own_forward(compiled):
    """Three rows of different contexts verify trees of 5, 1 and 9 nodes in one compiled forward; each row's
    logits are its own sequence's verify on a one-sequence cache (the eager path's), and a commit that moves
    entries keeps the row's cache equal to its own."""
    eager = compiled.eager_view()
    calls = counting_compiled_calls(compiled)
    trees = [random_tree(n, seed=n) for n in (5, 1, 9)]
    batch, singles, pasts, logits = batched_verify(compiled, trees)  # prefilled eager (a prefill always is)
    assert calls == [3] and batch.rows.plan is None
    for b, (tree, single, past) in enumerate(zip(trees, singles, pasts)):
        alone, _ = eager.verify(7, tree, single)
        torch.testing.assert_close(logits[b, : len(tree) + 1], alone, rtol=1e-4, atol=1e-4)
        keep = [0] + tree.paths()[-1]
        batch.keep(b, past, keep)
        eager.commit(single, past, keep)
        for mine, own in zip(batch.layers, single.layers):
            torch.testing.assert_close(mine.keys[b, :, : past + len(keep)], own.keys[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method, settings", [("ar", {}), ("skip", dict(layers=1, num_tokens=3)),
                                               ("eagle2", {}), ("redrafter", dict(width=3, length=3))],
                         ids=["ar", "skip", "eagle2", "redrafter"])
def test_every_sequence_of_a_compiled_batch_equals_its_own_decode(compiled, method, settings, ref_greedy):
    """As ``test_batch``'s exactness test, on the compiled path: sequences of different lengths and limits, ones
    ending early and others joining, each equal to its batch-1 decode and to plain greedy decoding; the
    batch's forwards went through the graph."""
    drafter = build_drafter(method, compiled, **settings) if method in ("ar", "skip") else build_drafter(
        method, compiled, checkpoint=str(session_checkpoint(compiled, method)), **settings)
    texts, limits = prompts(5, seed=2), [24, 5, 31, 1, 17]
    alone = [run(compiled, drafter, ids, n, stop_on_eos=False).output_ids for ids, n in zip(texts, limits)]
    assert alone == [ref_greedy(compiled.model, ids, n) for ids, n in zip(texts, limits)]
    calls = counting_compiled_calls(compiled)
    for batch_size in (2, 3):
        records = run_batch(compiled, drafter, texts, limits, batch_size=batch_size, stop_on_eos=False)
        assert [output_ids(r) for r in records] == alone, batch_size
    assert max(calls) == 3 and sum(c > 1 for c in calls) > 10
    if method != "ar":  # drafts went through the graph as trees or chains of several rows per sequence
        assert sum(len(s.tree) for r in records for s in r) > 10
    if method in ("eagle2", "redrafter"):  # trained on this target: they accept, unevenly
        accepted = [sum(s.accepted for s in r) for r in records]
        assert sum(accepted) > 0 and len(set(accepted)) > 1, accepted


def test_warming_compiles_every_graph_a_batch_decode_meets(tiny_llama, ref_greedy):
    """``warm_batches`` compiles a batch's graphs (several rows or one; one new entry a row or several); after it,
    batches of other sizes, contexts and drafts (rows at unequal lengths, chains and trees, the batch shrinking
    to one row as sequences end, a buffer that grows) compile nothing: the plan keeps the rows' lengths out of
    the graph, so they are not guarded on."""
    from torch._dynamo.utils import counters

    compiled = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=4, max_positions=320), pack=True))
    assert compiled.use_engine("compiled", layout="live").path == "compiled"
    compiled.warm_batches()
    before = counters["stats"]["unique_graphs"]
    texts = prompts(6, seed=7)
    limits = [20, 9, 14, 20, 3, 17]  # uneven: the batch shrinks to one row at the end
    reference = [ref_greedy(compiled.model, ids, n) for ids, n in zip(texts, limits)]
    tree = RandomTreeDrafter(texts[0], reference[0], seed=9, vocab=VOCAB)
    assert output_ids(run_batch(compiled, tree, texts[:1], limits[0], stop_on_eos=False)[0]) == reference[0]
    for batch_size in (2, 4, 5):
        for drafter in (build_drafter("ar", compiled), build_drafter("skip", compiled, layers=1, num_tokens=3)):
            records = run_batch(compiled, drafter, texts, limits, batch_size=batch_size, stop_on_eos=False)
            assert [output_ids(r) for r in records] == reference
    assert counters["stats"]["unique_graphs"] == before
    assert compiled.engine.path == "compiled", compiled.engine


def test_the_whole_buffer_layout_keeps_batches_eager(tiny_llama):
    """CUDA graphs record one shape each, and a batch's rows have lengths of their own: batches stay eager there,
    one sequence compiled."""
    target = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=3), pack=True))
    assert target.use_engine("compiled", layout="buffer").path == "compiled"
    batch = BatchSlabCache(target.num_layers, 2, 16)
    single = SlabCache(target.num_layers, 16)
    target.prefill([1, 2, 3], single)
    batch.adopt(batch.add(), single)
    assert target._captured_for(torch.ones(1, 2, dtype=torch.long), batch, None) is None
    assert target._captured_for(torch.ones(1, 2, dtype=torch.long), single, None) is target.captured
