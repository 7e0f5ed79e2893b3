"""core.cache: the slab KV cache. A commit moves exactly the accepted rows (against a cache-free forward over
the committed sequence, at several context lengths and tree shapes, through buffer growth); a crop rewinds
a length; models with sliding-window layers keep transformers' dynamic cache."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers import DynamicCache

from specviz.core.cache import SlabCache, SlabLayer, for_model, full_attention_only
from specviz.core.tree import DraftTree


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    return DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.long),
                     torch.tensor([rng.randint(0, i) for i in range(n)], dtype=torch.long))


def random_path(rng: random.Random, tree: DraftTree) -> list[int]:
    node, path = rng.randint(0, len(tree)), []
    while node:
        path.append(node)
        node = int(tree.parents[node - 1])
    return path[::-1]


def commit_rounds(target, cache, rng: random.Random, context: int, ref_logits, rounds: int = 6) -> list[int]:
    """Prefill ``context`` random tokens, then ``rounds`` of a random tree verified and a random path of it
    committed, each verify's logits checked against a cache-free forward over the committed sequence. Returns
    the committed sequence (the cache holds it)."""
    vocab = target.vocab_size
    seq = [rng.randrange(vocab) for _ in range(context)]
    target.prefill(seq, cache)
    for _ in range(rounds):
        tree, root = random_tree(rng, rng.randint(0, 12), vocab), rng.randrange(vocab)
        past = cache.get_seq_length()
        logits, _ = target.verify(root, tree, cache)
        path = random_path(rng, tree)
        tokens = [int(tree.tokens[i - 1]) for i in path]
        expected = ref_logits(target.model, seq + [root] + tokens)
        torch.testing.assert_close(logits[[0] + path], expected[len(seq):], atol=1e-4, rtol=1e-4)
        target.commit(cache, past, [0] + path)
        seq += [root] + tokens
        assert cache.get_seq_length() == len(seq)
    return seq


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
@pytest.mark.parametrize("context,capacity", [(1, 256), (9, 4), (120, 16), (230, 256)])
def test_commits_keep_exactly_the_accepted_rows(context, capacity, shared, tiny_target, ref_logits):
    """Rounds of random trees and paths after ``context`` tokens, on a slab that starts at ``capacity`` rows
    (small ones grow during the decode), its layers' buffers slices of one store or their own: every verify's
    logits equal a cache-free forward over the committed sequence, and the cache's live rows equal those of a
    fresh prefill over it."""
    target = tiny_target(vocab_size=48, seed=context, max_positions=320)
    cache = for_model(target.config, capacity, shared=shared)
    assert isinstance(cache, SlabCache)
    seq = commit_rounds(target, cache, random.Random(context), context, ref_logits)
    fresh = DynamicCache(config=target.config)
    target.prefill(seq, fresh)
    for slab, dense in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(slab.keys, dense.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(slab.values, dense.values, atol=1e-5, rtol=1e-5)
    assert max(layer.capacity for layer in cache.layers) >= len(seq)
    assert cache.stored == shared and isinstance(target.new_cache(), SlabCache) and target.new_cache().layers[0].owner
    if shared:  # every layer's buffers are slices of the store, which grew with them
        assert all(layer._keys.data_ptr() == cache.store.keys[i].data_ptr() for i, layer in enumerate(cache.layers))


def test_a_layer_unlike_the_first_gets_buffers_of_its_own():
    """A shared cache whose second layer's entries are shaped otherwise (other heads, as in some models): that layer
    keeps buffers of its own, the cache writes layer by layer, and every layer still holds exactly its rows through
    a forward under ``appending`` and a commit."""
    cache = SlabCache(2, 4, shared=True)
    shapes = [(1, 2, 3, 4), (1, 1, 3, 8)]
    with torch.inference_mode():
        for i, shape in enumerate(shapes):
            cache.update(torch.full(shape, i + 1.0), torch.full(shape, -i - 1.0), i)
        assert cache.layers[0].shared and not cache.layers[1].shared and not cache.stored
        with cache.appending(2):
            for i, shape in enumerate(shapes):
                new = torch.arange(2.0).view(1, 1, 2, 1).expand(*shape[:2], 2, shape[-1]) + 10 * (i + 1)
                keys, values = cache.update(new, -new, i)
                assert keys.shape[1:] == (shape[1], 5, shape[-1])
        cache.keep(3, [1])
    for i, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [i + 1.0] * 3 + [10 * (i + 1) + 1.0]
        assert layer.values[0, -1, :, -1].tolist() == [-i - 1.0] * 3 + [-10 * (i + 1) - 1.0]


def test_a_slab_and_a_dynamic_cache_decode_alike(tiny_target):
    """The same verify/commit rounds on both caches give the same logits."""
    rng = random.Random(7)
    target = tiny_target(vocab_size=48, seed=7)
    slab, dense = target.new_cache(8), DynamicCache(config=target.config)
    prompt = [rng.randrange(48) for _ in range(20)]
    target.prefill(prompt, slab), target.prefill(prompt, dense)
    for _ in range(5):
        tree, root = random_tree(rng, 9, 48), rng.randrange(48)
        past = slab.get_seq_length()
        a, _ = target.verify(root, tree, slab)
        b, _ = target.verify(root, tree, dense)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        keep = [0] + random_path(rng, tree)
        target.commit(slab, past, keep), target.commit(dense, past, keep)


def test_crop_rewinds_a_length_and_keep_moves_only_the_rows_named():
    layer = SlabLayer(capacity=4)
    rows = torch.arange(6, dtype=torch.float).view(1, 1, 6, 1)
    with torch.inference_mode():
        keys, _ = layer.update(rows, rows + 100)
    assert keys.shape[-2] == 6 and layer.capacity >= 6  # grew past its start
    buffer = layer._keys
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer.keys.flatten().tolist() == [0, 1, 2, 3]
    assert layer._keys is buffer  # nothing reallocated or copied
    layer.keep(1, torch.tensor([1, 3]))  # rows 1 and 3 stay, as rows 1 and 2
    assert layer.keys.flatten().tolist() == [0, 1, 3]
    assert layer.values.flatten().tolist() == [100, 101, 103]
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    layer.crop(-10)
    assert layer.get_seq_length() == 0


def test_the_prefill_of_a_reused_cache_starts_over(tiny_target, ref_logits):
    target = tiny_target(vocab_size=48, seed=3)
    cache = target.new_cache(4)
    target.prefill(list(range(30)), cache)
    logits, _ = target.prefill([5, 6, 7], cache)
    assert cache.get_seq_length() == 3
    torch.testing.assert_close(logits, ref_logits(target.model, [5, 6, 7])[-1], atol=1e-4, rtol=1e-4)


def sliding_config(**extra) -> transformers.PretrainedConfig:
    return transformers.MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, **extra)


def test_models_with_sliding_window_layers_keep_the_dynamic_cache():
    assert not full_attention_only(sliding_config(sliding_window=16))
    assert isinstance(for_model(sliding_config(sliding_window=16)), DynamicCache)
    assert full_attention_only(sliding_config(sliding_window=None))
    assert isinstance(for_model(sliding_config(sliding_window=None)), SlabCache)


class EagerBuffer:
    """The whole-buffer layout without compiling: the forward ``core.capture`` compiles, run eagerly, so the layout's
    own rules (slots, the padded mask, the length moved after) are checked quickly and apart from the compiler."""

    layout, split, ready, graphs = "buffer", True, True, False

    def __init__(self, target):
        self.module, self._fn, self.taps = target._plain.decoder, target._plain, target._plain.taps

    def __call__(self, keep: int, **kwargs):
        return self._fn(keep=keep, **kwargs)  # logits, features, the tapped layers' inputs


@pytest.mark.parametrize("context,capacity", [(1, 256), (9, 4), (120, 16)])
def test_the_whole_buffer_layout_commits_exactly_the_accepted_rows(context, capacity, tiny_target, ref_logits):
    """Attention over the whole buffer (rows written at slots, stale and unwritten rows hidden by the mask): every
    verify's logits equal a cache-free forward over the committed sequence, through growth, and the live rows equal
    a fresh prefill's."""
    target = tiny_target(vocab_size=48, seed=context + 1, max_positions=320)
    target.captured = EagerBuffer(target)
    cache = target.new_cache(capacity)
    seq = commit_rounds(target, cache, random.Random(context), context, ref_logits)
    fresh = DynamicCache(config=target.config)
    target.prefill(seq, fresh)
    for slab, dense in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(slab.keys, dense.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_slots_move_the_length_only_after_a_forward_that_ran(shared):
    """Inside ``slots`` the length stands still, ``update`` returns whole buffers and the mask handed to the forward
    covers the whole buffer, hiding every row past the live ones and the new; the length moves by n after, not when
    the forward fails."""
    cpu, low = torch.device("cpu"), torch.finfo(torch.float32).min
    cache = SlabCache(1, 8, shared=shared)
    cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    with cache.slots(2, None, torch.float32, cpu) as mask:
        keys, _ = cache.update(torch.full((1, 1, 2, 2), 5.0), torch.zeros(1, 1, 2, 2), 0)
        assert keys.shape[2] == mask.shape[3] == cache.capacity and cache.get_seq_length() == 3
        assert (mask[0, 0] == 0).tolist() == [[True] * 4 + [False] * (cache.capacity - 4),
                                              [True] * 5 + [False] * (cache.capacity - 5)]  # causal after 3 rows
    assert cache.get_seq_length() == 5 and cache.layers[0].keys[0, 0, :, 0].tolist() == [1, 1, 1, 5, 5]
    tree = torch.tensor([[0.0] * 5 + [low, 0.0]])[None, None]  # one new row that skips the last live one
    with pytest.raises(RuntimeError), cache.slots(2, torch.cat([tree, tree], 2), torch.float32, cpu) as mask:
        assert mask.shape == (1, 1, 2, cache.capacity) and bool((mask[..., 7:] == low).all())
        assert mask[0, 0, 0, :7].tolist() == tree[0, 0, 0].tolist()
        raise RuntimeError("the forward failed")
    assert cache.get_seq_length() == 5 and cache.at is None


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_appending_moves_nothing_inside_the_forward_and_the_lengths_after_it(shared):
    """Inside ``appending`` every layer writes at the cache's one span and returns views to its end (of the store,
    where the layers share one), while no attribute of a layer or of the cache changes (a compiled graph would
    replay each after every call); the lengths and views move after a forward that ran, not after one that failed;
    the buffer has room before the forward, never in it."""
    cache = SlabCache(2, 4, shared=shared)
    for i in range(2):
        cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), i)
    before = [dict(vars(layer)) for layer in cache.layers]
    with cache.appending(2):
        assert cache.capacity > 5  # grown before the forward (with one to spare)
        grown = [dict(vars(layer)) for layer in cache.layers]
        owned = dict(vars(cache))
        for i, layer in enumerate(cache.layers):
            keys, values = cache.update(torch.full((1, 1, 2, 2), 5.0 + i), torch.zeros(1, 1, 2, 2), i)
            assert keys.shape[2] == values.shape[2] == 5
            assert all(vars(layer)[k] is v for k, v in grown[i].items())  # not one attribute set
            assert all(vars(cache)[k] is v for k, v in owned.items())
            base = cache.store.keys if shared else layer._keys
            assert keys.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert cache.get_seq_length() == 3
    for i, layer in enumerate(cache.layers):
        assert layer.length == 5 and cache.span is None and layer.keys[0, 0, :, 0].tolist() == [1, 1, 1, 5 + i, 5 + i]
    with pytest.raises(RuntimeError), cache.appending(1):
        cache.update(torch.full((1, 1, 1, 2), 9.0), torch.zeros(1, 1, 1, 2), 0)
        raise RuntimeError("the forward failed")
    assert cache.get_seq_length() == 5 and cache.span is None
    assert before[0]["_keys"] is not cache.layers[0]._keys  # it grew once, outside


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_static_caches_take_the_buffers_of_those_gone_layer_by_layer(shared, monkeypatch):
    """What keeps CUDA graphs replaying across decodes: a static cache's layer takes the buffers its index held last
    in a cache that grew or is gone (zeroed; a shared cache takes the whole store), so its buffers sit at the
    addresses a graph recorded; a cache alive keeps its own, and a cache that is not static never pools."""
    import specviz.core.pool as pool

    monkeypatch.setattr(pool, "POOL", pool.BufferPool())

    def fill(cache, rows):
        for i in range(len(cache.layers)):
            cache.update(torch.full((1, 2, rows, 4), i + 1.0), torch.ones(1, 2, rows, 4), i)
        return [layer._keys.data_ptr() for layer in cache.layers]

    first = SlabCache(2, 8, static=True, shared=shared)
    small = fill(first, 3)
    grown = fill(first, 7)  # 10 rows: each layer grows to 16, and its 8-row pair goes back
    assert grown != small and first.layers[1].keys[0, 0, :, 0].tolist() == [2.0] * 10
    second = SlabCache(2, 8, static=True, shared=shared)
    assert fill(second, 1) == small  # layer by layer, not swapped
    assert second.layers[1]._keys[:, :, 1:].abs().sum() == 0  # the last owner's rows are gone
    assert fill(SlabCache(2, 16, static=True, shared=shared), 1) != grown  # ``first`` is alive: its pairs are its own
    del first
    assert fill(SlabCache(2, 16, static=True, shared=shared), 1) == grown
    plain = SlabCache(2, 8, shared=shared)
    fill(plain, 1)
    assert (plain.store is None or not plain.store._held) and all(not layer._held for layer in plain.layers)
