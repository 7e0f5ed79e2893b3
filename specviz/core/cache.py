"""The target's KV cache: preallocated buffers where rollback rewinds a length and a commit moves only the
accepted rows (gpt-fast's static cache, with ml-recurrent-drafter's in-place commit).

transformers' ``DynamicCache`` grows by concatenation, which copies the whole context into a new tensor on
every forward, and a tree commit had to gather the whole context again. Here each layer has one buffer
``[batch, kv_heads, capacity, head_dim]`` per keys and values, allocated at the first write; in a shared cache (what
the target makes) these are slices of one store per keys and values, ``[layers, batch, kv_heads, capacity,
head_dim]``, which grows, commits and enters a compiled graph as one tensor:

- ``update`` (what attention calls) copies the new rows in at ``length`` and returns views of the first
  ``length + n`` rows: attention reads exactly the live context, as with a dynamic cache, so the masks
  transformers builds (from ``get_seq_length``) and ours (``DraftTree.attention_mask``) are unchanged;
- ``crop(-k)`` rewinds ``length`` by k, copying nothing;
- ``SlabCache.keep(past, rows)`` moves the verify rows that were accepted to ``past, past+1, ...``: O(accepted),
  whatever the context;
- a write past ``capacity`` doubles the buffer (amortised O(1) per row), so a decode that outgrows its
  estimate is slower once, never wrong;
- ``appending(n)`` (a compiled forward over the live rows: ``core.capture``) has every layer write at the cache's
  one span and change none of its attributes inside the graph; the lengths move after it.

**The whole-buffer layout** (``SlabCache.slots``, what a CUDA graph needs: ``core.capture``): while the cache holds
a slot tensor (``at``), ``update`` writes the new rows at those slots and returns the whole buffers, so every
tensor in the forward has a shape fixed by the capacity, not by the context; ``slots`` hands the forward its mask
padded to the capacity (every row past the live ones hidden), and the length moves once the forward is done.
Buffers start zeroed, so a hidden row is never NaN (a masked weight of zero times NaN is still NaN).

Invariant: rows ``[0, length)`` of every layer hold the keys and values of the committed sequence, in
order; rows at or after ``length`` are stale and never read.

Only plain full-attention layers are held this way; a model with sliding-window or linear-attention layers
gets transformers' own ``DynamicCache`` (``for_model``), and a tree commit there is refused by the target.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from . import pool
from .store import Store, keep_rows, mark_dynamic
from .transfer import to_device


@dataclass(frozen=True)
class Span:
    """Rows ``[start, end)`` one forward writes into every layer (``SlabCache.appending``)."""

    start: int
    end: int


class SlabLayer(DynamicLayer):
    """One decoder layer's keys and values in buffers of ``capacity`` rows, ``length`` of them live: its own, or
    its slices of the cache's store (``SlabCache(shared=True)``)."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._keys: torch.Tensor | None = None  # the buffers; ``keys``/``values`` are views of their live rows
        self._values: torch.Tensor | None = None
        self.static = False  # the buffers' addresses are fixed inputs of a CUDA graph (``SlabCache(static=True)``)
        self.index = 0  # the decoder layer's, which a static buffer is pooled under
        self._held: list = []  # a static layer's (pool key, buffer pair), its current pair last
        self.owner: weakref.ref | None = None  # the cache whose store may hold this layer's buffers
        self.shared = False  # the buffers are slices of the owner's store, which grows for every layer at once

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        owner = self.owner() if self.owner is not None else None
        slices = owner.share(self, key_states, value_states, key_states.shape[0]) if owner is not None else None
        if slices is None:
            self._keys, self._values = self._buffers(key_states, value_states, self.capacity)
            self._mark_dynamic()
        else:
            self._keys, self._values = slices
            self.shared = True
        self.is_initialized = True
        self._view()

    def _buffers(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed buffers of ``capacity`` rows shaped as ``keys`` and ``values``: new, or for a static cache the pair
        the pool holds for this layer (``core.pool``), which goes back there on growth or when the layer is gone."""
        def make():
            return (keys.new_zeros((*keys.shape[:2], capacity, keys.shape[-1])),
                    values.new_zeros((*values.shape[:2], capacity, values.shape[-1])))

        if not self.static:
            return make()
        return pool.pooled_pair(self, (self.index, tuple(keys.shape[:2]), capacity, keys.shape[-1], values.shape[-1],
                                       keys.dtype, keys.device), make)

    def _mark_dynamic(self) -> None:
        mark_dynamic((self._keys, self._values), (2,), self.static)

    def fit(self, store: Store) -> None:
        """Take the store's capacity (the layer's buffers are, or will be, its slices)."""
        self.capacity = store.capacity

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        if self.shared:
            self.owner().grow(needed)
            return
        capacity = max(needed, 2 * self.capacity)
        old = self._keys, self._values
        self._keys, self._values = self._buffers(*old, capacity)
        self._keys[:, :, : self.length] = old[0][:, :, : self.length]
        self._values[:, :, : self.length] = old[1][:, :, : self.length]
        if self.static:
            pool.give_back(self._held, keep_last=True)
        self.capacity = capacity
        self._mark_dynamic()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """An eager forward's write: the new rows at ``length``, which moves (a compiled forward writes through
        ``SlabCache.update`` instead, moving nothing)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._keys[:, :, self.length: end] = key_states
        self._values[:, :, self.length: end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-k)`` forgets the last k rows (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of rows to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._view()

    @torch.inference_mode()  # the buffers were made by a forward under inference mode
    def keep(self, past: int, index: torch.Tensor) -> None:
        """Keep the rows at ``index`` (absolute, on this layer's device) as ``past, past+1, ...``; drop the rest."""
        keep_rows((self._keys, self._values), 2, past, index)
        self.length = past + index.numel()
        self._view()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a SlabCache holds one sequence per batch row as allocated")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a SlabCache holds one sequence per batch row as allocated")


class StoreOwner(Cache):
    """A cache whose layers may keep their buffers in one ``core.store.Store`` (``shared``), made at the first
    layer's first write and shaped after it; a layer whose entries do not fit it keeps buffers of its own, and the
    cache, then ``mixed``, writes layer by layer. Each layer has ``owner`` (a weak reference to this cache, where
    shared), ``shared``, ``index``, ``is_initialized``, its buffers ``_keys`` and ``_values``, and ``fit(store)``."""

    dynamic: tuple[int, ...] = (3,)  # the store's dimensions that vary between caches (``core.store.mark_dynamic``)

    def __init__(self, layers: list, static: bool, shared: bool):
        super().__init__(layers=layers)
        self.store: Store | None = None
        self.mixed = False  # a layer was refused a slice of the store: it has buffers of its own
        self.static = static
        for layer in self.layers:
            layer.owner = weakref.ref(self) if shared else None

    @property
    def stored(self) -> bool:
        """Whether every layer's buffers are slices of the store (so a compiled forward writes through it)."""
        return self.store is not None and not self.mixed

    def share(self, layer, keys: torch.Tensor, values: torch.Tensor, rows: int):
        """``layer``'s slices of the store (made here at the first layer's first write, ``rows`` rows at the layer's
        capacity), or None where its entries do not fit the store."""
        if self.store is None:
            self.store = Store(len(self.layers), keys, values, rows, layer.capacity, self.static, self.dynamic)
        if not self.store.fits(keys, values):
            self.mixed = True
            return None
        layer.fit(self.store)
        return self.store.layer(layer.index)

    def _regrown(self) -> None:
        """After the store grew: each sharing layer takes its new slices, and one yet to write the new sizes."""
        for layer in self.layers:
            if layer.shared or not layer.is_initialized:
                layer.fit(self.store)
            if layer.shared:
                layer._keys, layer._values = self.store.layer(layer.index)


class SlabCache(StoreOwner):
    """A KV cache of ``SlabLayer``s: one per decoder layer, each ``capacity`` rows to start with. ``static``: the
    buffers are fixed addresses of a CUDA graph (the whole-buffer layout's compiled forward). ``shared``: every
    layer's buffers are slices of one ``Store``, so a compiled forward takes two tensors and one capacity as inputs,
    not two and a capacity per layer (the target shares where its model sits on one device)."""

    def __init__(self, num_layers: int, capacity: int = 256, static: bool = False, shared: bool = False):
        super().__init__([SlabLayer(capacity) for _ in range(num_layers)], static, shared)
        self.span: Span | None = None  # set by ``appending``: one forward's rows in every layer
        self.at: torch.Tensor | None = None  # set by ``slots``: one forward's rows, as a tensor, in every layer
        for i, layer in enumerate(self.layers):
            layer.static, layer.index = static, i

    @property
    def capacity(self) -> int:
        """Rows every layer holds now (the whole-buffer layout's key length)."""
        return min(layer.capacity for layer in self.layers)

    def grow(self, needed: int) -> None:
        """The store grown to ``max(needed, 2 * capacity)`` rows, the live ones copied over (``Store.grow``)."""
        live = max(layer.length for layer in self.layers)
        self.store.grow(self.store.rows, max(needed, 2 * self.store.capacity), live)
        self._regrown()
        for layer in self.layers:
            if layer.shared:
                layer._view()

    @contextlib.contextmanager
    def slots(self, n: int, mask: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        """The whole-buffer layout for one forward of ``n`` rows after the live ones: ``update`` writes them at
        ``length, ..., length+n-1`` and returns whole buffers; yields ``mask`` (over the live rows and the n, as a
        live-row forward takes it; None: causal) padded to the buffer (``buffer_mask``). The length moves by ``n``
        once the forward is done, not where it failed."""
        past = self.get_seq_length()
        self.reserve(n)  # no growth inside the forward: a graph's buffers keep their shape
        self.at = torch.arange(past, past + n, device=device)
        try:
            yield buffer_mask(mask, past, n, self.capacity, dtype, device)
        finally:
            self.at = None
        self._moved(past + n)

    @contextlib.contextmanager
    def appending(self, n: int):
        """One forward of ``n`` rows after the live ones whose layers change no attribute while it runs: every layer
        writes them at the span this holds and returns views to its end, and the lengths move once the forward is
        done (not where it failed). Inside a compiled graph, an attribute set by a layer is replayed after every call
        (each layer's length and views: a hundred Python objects a forward), and each layer's own length is an input
        of its own; the cache's one span is one."""
        self.reserve(n)
        past = self.get_seq_length()
        self.span = Span(past, past + n)
        try:
            yield
        finally:
            self.span = None
        self._moved(past + n)

    def _moved(self, length: int) -> None:
        """After a forward under ``slots`` or ``appending`` that ran: its rows are live in every layer."""
        for layer in self.layers:
            layer.length = length
            layer._view()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``. Inside ``appending`` or ``slots`` (a compiled forward) the rows go where
        the cache says, read from the cache and not from each layer, through the store where every layer shares it:
        one span, or one slot tensor, and two buffers in a graph's inputs, not some per layer; no attribute is set."""
        if self.span is None and self.at is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.stored:
            return self._write_store(layer_idx, key_states, value_states)
        keys, values = self.layers[layer_idx]._keys, self.layers[layer_idx]._values
        if self.at is not None:  # the whole-buffer layout: whole buffers, the mask hides what is not live
            keys.index_copy_(2, self.at, key_states)
            values.index_copy_(2, self.at, value_states)
            return keys, values
        keys[:, :, self.span.start: self.span.end] = key_states
        values[:, :, self.span.start: self.span.end] = value_states
        return keys[:, :, : self.span.end], values[:, :, : self.span.end]

    def _write_store(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` through the store: one ``index_put_`` into each, every index a tensor. Compiled, a write into
        a slice of one layer's slice of the store rebuilds the whole store (functionalization writes the new rows
        into a copy of the base, and inductor does not write that copy back in place), while an ``index_put_`` on
        the store itself is written in place."""
        at = self.at
        if at is None:
            at = torch.arange(key_states.shape[2], device=key_states.device) + self.span.start
        self.store.put(layer, at[None], key_states, value_states)
        keys, values = self.store.keys, self.store.values
        if self.at is not None:  # the whole-buffer layout: whole buffers, the mask hides what is not live
            return keys[layer], values[layer]
        return keys[layer, :, :, : self.span.end], values[layer, :, :, : self.span.end]

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in every layer now, and one to spare, so a compiled forward never grows a
        buffer inside its graph (a growth there is a new graph: ``core.capture``) and its live rows are never the
        whole buffer (a view that is the whole buffer is contiguous, which dynamo compiles a graph of its own for)."""
        for layer in self.layers:
            if layer.is_initialized and layer.length + rows >= layer.capacity:
                layer._grow(layer.length + rows + 1)

    def keep(self, past: int, rows: list[int] | torch.Tensor) -> None:
        """Keep verify rows ``rows`` (indices after ``past``, in order of the sequence) as the rows after ``past``:
        in the store, two gathers for every layer at once."""
        index = past + torch.as_tensor(rows, dtype=torch.long)
        if self.stored:
            self.store.keep(past, to_device(index, self.store.keys.device))
            self._moved(past + index.numel())
            return
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy per device (a model may be split across several)
        for layer in self.layers:
            if layer.is_initialized:
                if layer.device not in on_device:
                    on_device[layer.device] = to_device(index, layer.device)
                layer.keep(past, on_device[layer.device])


def buffer_mask(mask: torch.Tensor | None, past: int, n: int, capacity: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The whole-buffer layout's mask, [1, 1, n, capacity], additive: ``mask`` over the live rows ([1, 1, n, past+n];
    None: causal) and every row after them hidden. Built on ``device``."""
    low = torch.finfo(dtype).min
    if mask is None:
        seen = torch.arange(capacity, device=device) <= past + torch.arange(n, device=device)[:, None]
        return torch.zeros(n, capacity, dtype=dtype, device=device).masked_fill_(~seen, low)[None, None]
    return torch.nn.functional.pad(mask.to(device=device, dtype=dtype), (0, capacity - mask.shape[-1]), value=low)


def full_attention_only(config) -> bool:
    """Whether every decoder layer of ``config`` is plain full attention (what a ``SlabCache`` holds), by the rule
    transformers' own ``DynamicCache`` uses to choose its layers."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return all(t == "full_attention" for t in layer_types)


def for_model(config, capacity: int = 256, static: bool = False, shared: bool = False) -> Cache:
    """A ``SlabCache`` for a model whose layers are all full attention, else transformers' ``DynamicCache``."""
    if full_attention_only(config):
        return SlabCache(config.get_text_config(decoder=True).num_hidden_layers, capacity, static, shared)
    return DynamicCache(config=config)
