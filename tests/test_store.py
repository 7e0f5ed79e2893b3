"""``core.store.Store``: every layer's keys and values in one pair of tensors. Each operation is checked against
what the same operation does layer by layer on plain tensors."""

from __future__ import annotations

import torch

from specviz.core.store import Store


def entries(rows: int, n: int, seed: int, heads: int = 2, dim: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, n, dim, generator=g), torch.randn(rows, heads, n, dim + 1, generator=g)


def filled(layers: int = 3, rows: int = 2, capacity: int = 6) -> tuple[Store, list]:
    """A store whose every layer holds 5 positions of random entries, and the same entries per layer."""
    keys, values = entries(rows, 5, seed=0)
    store = Store(layers, keys, values, rows, capacity)
    plain = []
    for i in range(layers):
        k, v = entries(rows, 5, seed=i + 1)
        store.put(i, torch.arange(5)[None], k, v)
        plain.append((k, v))
    return store, plain


def test_put_writes_each_layers_entries_at_their_positions_and_nothing_else():
    store, plain = filled()
    assert store.keys.shape == (3, 2, 2, 6, 3) and store.values.shape == (3, 2, 2, 6, 4)
    for i, (k, v) in enumerate(plain):
        keys, values = store.layer(i)
        assert torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, :5], v)
        assert keys[:, :, 5:].abs().sum() == 0  # zeros where nothing was written
    at = torch.tensor([[5], [2]])  # row 0 at position 5, row 1 at position 2
    k, v = entries(2, 1, seed=9)
    store.put(1, at, k, v)
    assert torch.equal(store.keys[1, 0, :, 5], k[0, :, 0]) and torch.equal(store.keys[1, 1, :, 2], k[1, :, 0])
    assert torch.equal(store.values[1, 1, :, 2], v[1, :, 0])
    assert torch.equal(store.keys[0, :, :, :5], plain[0][0]) and torch.equal(store.keys[2, :, :, :5], plain[2][0])


def test_growth_keeps_the_live_positions_of_every_row_and_layer():
    store, plain = filled()
    store.grow(4, 13, live=4)
    assert (store.rows, store.capacity) == (4, 13)
    for i, (k, _) in enumerate(plain):
        assert torch.equal(store.keys[i, :2, :, :4], k[:, :, :4])
        assert store.keys[i, :, :, 4:].abs().sum() == 0 and store.keys[i, 2:].abs().sum() == 0
    store.grow(4, 20)  # everything it held
    assert torch.equal(store.values[2, :2, :, :4], plain[2][1][:, :, :4])


def test_keep_moves_the_kept_positions_of_one_row_or_all():
    store, plain = filled()
    index = torch.tensor([3, 1, 4])  # overlaps its destination: gathered first
    store.keep(1, index, row=0)
    for i, (k, _) in enumerate(plain):
        assert torch.equal(store.keys[i, 0, :, 1:4], k[0][:, index]) and torch.equal(store.keys[i, 1, :, :5], k[1])
    store, plain = filled()
    store.keep(2, torch.tensor([4]))
    for i, (k, v) in enumerate(plain):
        assert torch.equal(store.keys[i, :, :, 2], k[:, :, 4]) and torch.equal(store.values[i, :, :, 2], v[:, :, 4])


def test_move_copies_a_row_in_every_layer():
    store, plain = filled()
    store.move(1, 0, 3)
    for i, (k, _) in enumerate(plain):
        assert torch.equal(store.keys[i, 0, :, :3], k[1, :, :3]) and torch.equal(store.keys[i, 0, :, 3:5], k[0, :, 3:])


def test_a_layer_fits_only_with_the_stores_heads_sizes_and_dtype():
    store, _ = filled()
    keys, values = entries(1, 2, seed=5)
    assert store.fits(keys, values)
    assert not store.fits(*entries(1, 2, seed=5, heads=1))
    assert not store.fits(keys, values[..., :2]) and not store.fits(keys.double(), values)
