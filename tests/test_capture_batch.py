"""Batches on the compiled path (``core.capture``), in both layouts: a batch's verify forward runs through the
compiled graph with each row's cache writes planned outside it (``BatchSlabCache.planned``), or, in the
whole-buffer layout (CUDA graphs'), padded to buckets of rows and entries over whole buffers
(``BatchSlabCache.whole``). Every sequence's greedy output equals its own batch-1 decode and plain greedy
decoding, across rows of different lengths, trees of different sizes, sequences that end early and ones that
join; the forwards ran compiled; batch sizes and context lengths after the first few compile nothing more."""

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
from specviz.core.target import TargetModel, cache_kwarg

VOCAB = 64


LAYOUTS = ["live", "buffer"]


def compiled_in(tiny_llama, layout: str) -> TargetModel:
    """A tiny target prepared as ``load_target`` prepares one (grouped heads, packed layers), compiled in the
    live-rows layout (the CPU's) or the whole-buffer one (CUDA's, here without graphs)."""
    target = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=3, max_positions=320), pack=True))
    assert target.use_engine("compiled", layout=layout).path == "compiled"
    return target


@pytest.fixture(scope="module")
def live(tiny_llama):
    return compiled_in(tiny_llama, "live")


@pytest.fixture(scope="module")
def buffer(tiny_llama):
    return compiled_in(tiny_llama, "buffer")


@pytest.fixture
def compiled(request):
    """The module's target in the layout a test's parameter names (each compiled once for the module)."""
    return request.getfixturevalue(request.param)


def counting_compiled_calls(target: TargetModel) -> list[int]:
    """Wrap the compiled forward so each call is counted by its batch size (the list it returns grows)."""
    calls, run = [], target.captured.__call__

    class Counted(type(target.captured)):
        def __call__(self, keep, **kwargs):
            calls.append(kwargs["input_ids"].shape[0])
            return run(keep, **kwargs)

    target.captured.__class__ = Counted
    return calls


@pytest.mark.parametrize("compiled", LAYOUTS, indirect=True)
def test_a_compiled_batch_verify_equals_each_rows_own_forward(compiled):
    """Three rows of different contexts verify trees of 5, 1 and 9 nodes in one compiled forward; each row's
    logits are its own sequence's verify on a one-sequence cache (the eager path's), and a commit that moves
    entries keeps the row's cache equal to its own."""
    eager = compiled.eager_view()
    calls = counting_compiled_calls(compiled)
    trees = [random_tree(n, seed=n) for n in (5, 1, 9)]
    batch, singles, pasts, logits = batched_verify(compiled, trees)  # prefilled eager (a prefill always is)
    assert calls == ([3] if compiled.captured.layout == "live" else [4]) and batch.rows.plan is None  # 4: bucket
    for b, (tree, single, past) in enumerate(zip(trees, singles, pasts)):
        alone, _ = eager.verify(7, tree, single)
        torch.testing.assert_close(logits[b, : len(tree) + 1], alone, rtol=1e-4, atol=1e-4)
        keep = [0] + tree.paths()[-1]
        batch.keep(b, past, keep)
        eager.commit(single, past, keep)
        for mine, own in zip(batch.layers, single.layers):
            torch.testing.assert_close(mine.keys[b, :, : past + len(keep)], own.keys[0], rtol=1e-4, atol=1e-4)


# the whole-buffer layout with the trained drafters: trees padded to a bucket of entries as well as rows padded to
# one, and lanes that accept unevenly; AR and chains there add time, not cases
@pytest.mark.parametrize("compiled, method, settings", [
    ("live", "ar", {}), ("live", "skip", dict(layers=1, num_tokens=3)), ("live", "eagle2", {}),
    ("live", "redrafter", dict(width=3, length=3)), ("buffer", "eagle2", {}),
    ("buffer", "redrafter", dict(width=3, length=3))], indirect=["compiled"],
    ids=["live-ar", "live-skip", "live-eagle2", "live-redrafter", "buffer-eagle2", "buffer-redrafter"])
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
    assert max(calls) == (3 if compiled.captured.layout == "live" else 4) and sum(c > 1 for c in calls) > 10
    if method != "ar":  # drafts went through the graph as trees or chains of several rows per sequence
        assert sum(len(s.tree) for r in records for s in r) > 10
    if method in ("eagle2", "redrafter"):  # trained on this target: they accept, unevenly
        accepted = [sum(s.accepted for s in r) for r in records]
        assert sum(accepted) > 0 and len(set(accepted)) > 1, accepted


@pytest.mark.parametrize("layout", ["live", "buffer"])
def test_warming_compiles_every_graph_a_batch_decode_meets(tiny_llama, ref_greedy, layout):
    """``warm_batches`` compiles a batch's graphs (several rows or one; one new entry a row or several); after it,
    batches of other sizes, contexts and drafts (rows at unequal lengths, chains and trees, the batch shrinking
    to one row as sequences end, a buffer that grows) compile nothing: the plan keeps the rows' lengths out of
    the graph, so they are not guarded on, and in the whole-buffer layout every bucket is one graph. Asked while
    the compilation runs on its thread, the warming is done when it ends; a drafter that taps layers afterwards
    (EAGLE-3) compiles the target again, and the new forward warms the batch graphs the old one had."""
    from torch._dynamo.utils import counters

    compiled = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=4, max_positions=320), pack=True))
    compiled.use_engine("compiled", layout=layout, background=True)
    compiled.warm_batches()
    assert compiled.captured.wait() and compiled.engine.path == "compiled", compiled.engine
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
    if layout == "live":  # the tap's second compilation, once
        compiled.tap([0])
        assert compiled.captured.wait() and compiled.engine.path == "compiled", compiled.engine
        before = counters["stats"]["unique_graphs"]
        records = run_batch(compiled, build_drafter("ar", compiled), texts, limits, batch_size=2, stop_on_eos=False)
        assert [output_ids(r) for r in records] == reference
        assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_a_whole_buffer_forward_is_padded_to_buckets_and_fillers_see_only_themselves(tiny_llama, shared):
    """``BatchSlabCache.whole``: 3 rows of 5 entries become 4 rows of 8 over the capacity; a real entry's mask is
    the one given, a filler's (a padding row's, a real row's padding entry) sees only the slot it is written to,
    after its row's live positions, so no live position changes."""
    target = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=3), pack=True))
    cache = BatchSlabCache(target.num_layers, 3, 32, shared=shared)
    for ids in prompts(3, seed=4):
        single = SlabCache(target.num_layers, 32)
        target.prefill(ids, single)
        cache.adopt(cache.add(), single)
    lengths, n = cache.lengths, 5
    before = [layer._keys.clone() for layer in cache.layers]
    mask = torch.randn(3, 1, n, max(lengths) + n)
    with cache.whole(torch.ones(3, n, dtype=torch.long), torch.ones(3, n, dtype=torch.long), mask,
                     torch.float32) as args:
        where = cache.rows.plan.where
        capacity = cache.layers[0].capacity
        assert args["input_ids"].shape == args["position_ids"].shape == where.shape == (4, 8)
        assert args["attention_mask"].shape == (4, 1, 8, capacity) and capacity > max(lengths) + 8
        full = args["attention_mask"][:, 0]
        torch.testing.assert_close(full[:3, :n, : mask.shape[-1]], mask[:, 0])
        for b in range(4):
            start = lengths[b] if b < 3 else 0
            assert where[b].tolist() == list(range(start, start + 8))
            for j in range(8 if b == 3 else n, 8):
                assert (full[b, j] == 0).nonzero().flatten().tolist() == [start + j]
        with torch.inference_mode():
            target.model(**args, **cache_kwarg(target.model, cache), use_cache=True)
    assert cache.rows.plan is None and cache.lengths == lengths
    for layer, old in zip(cache.layers, before):
        for b, length in enumerate(lengths):
            torch.testing.assert_close(layer._keys[b, :, :length], old[b, :, :length])


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_a_static_batch_cache_takes_the_buffers_the_last_one_of_its_shape_gave_back(tiny_llama, shared):
    """Under CUDA graphs the batch cache's buffers are fixed addresses: a cache that is gone gives them back to
    the pool, and the next cache of the same shape takes them (its graphs then replay), zeroed."""
    import gc

    target = TargetModel(prepare(tiny_llama(vocab_size=VOCAB, seed=3), pack=True))
    single = SlabCache(target.num_layers, 32)
    target.prefill([1, 2, 3], single)

    def filled():
        cache = BatchSlabCache(target.num_layers, 4, 64, static=True, shared=shared)
        cache.adopt(cache.add(), single)
        return cache

    cache = filled()
    addresses = [layer._keys.data_ptr() for layer in cache.layers]
    del cache
    gc.collect()
    again = filled()
    assert [layer._keys.data_ptr() for layer in again.layers] == addresses
    assert again.layers[0]._keys[0, :, 3:].abs().sum() == 0 and again.layers[0]._keys[1:].abs().sum() == 0
    other = BatchSlabCache(target.num_layers, 8, 64, static=True, shared=shared)  # another shape: buffers of its own
    other.adopt(other.add(), single)
    assert other.layers[0]._keys.data_ptr() not in addresses
