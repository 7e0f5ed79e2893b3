"""The target's KV cache: preallocated buffers where rollback rewinds a length and a commit moves only the
accepted rows (gpt-fast's static cache, with ml-recurrent-drafter's in-place commit).

transformers' ``DynamicCache`` grows by concatenation, which copies the whole context into a new tensor on
every forward, and a tree commit had to gather the whole context again. Here each layer owns one buffer
``[batch, kv_heads, capacity, head_dim]`` per keys and values, allocated at the first write:

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
a slot tensor, ``update`` writes the new rows at those slots and returns the whole buffers, so every tensor in the
forward has a shape fixed by the capacity, not by the context; ``slots`` hands the forward its mask padded to the
capacity (every row past the live ones hidden), and the length moves once the forward is done. Buffers start
zeroed, so a hidden row is never NaN (a masked weight of zero times NaN is still NaN).

Invariant: rows ``[0, length)`` of every layer hold the keys and values of the committed sequence, in
order; rows at or after ``length`` are stale and never read.

Only plain full-attention layers are held this way; a model with sliding-window or linear-attention layers
gets transformers' own ``DynamicCache`` (``for_model``), and a tree commit there is refused by the target.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from .transfer import to_device


@dataclass(frozen=True)
class Span:
    """Rows ``[start, end)`` one forward writes into every layer (``SlabCache.appending``)."""

    start: int
    end: int


class BufferPool:
    """The buffer pairs of static caches' layers that are gone or grew, kept for the next cache: the next decode's
    layer i takes the pair layer i held last, so CUDA graphs find their inputs at the addresses they recorded with
    and replay, rather than record anew at each decode (inductor records again on a new address, up to a limit, then
    stops replaying that graph). Decodes that run at the same time hold pairs of their own. Pairs are kept for the
    process: as many as the most static caches alive at once needed, per capacity."""

    def __init__(self):
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            free = self._free.get(key)
            pair = free.pop() if free else None
        if pair is None:
            return make()
        with torch.inference_mode():  # a pair made by a forward is an inference tensor
            for buffer in pair:
                buffer.zero_()
        return pair

    def give_back(self, held: list, keep_last: bool = False) -> None:
        """``held``: a layer's (key, pair) records, oldest first; each goes back (but the newest with ``keep_last``)."""
        with self._lock:
            while len(held) > keep_last:
                key, pair = held.pop(0)
                self._free.setdefault(key, []).append(pair)


POOL = BufferPool()


def pooled_pair(layer, key: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
    """A static layer's buffer pair for ``key`` from ``POOL`` (``make()`` where it holds none), recorded in the
    layer's ``_held`` list: every pair it held goes back when the layer is gone, and a growth gives the old pair
    back once its rows are copied (``POOL.give_back(layer._held, keep_last=True)``)."""
    pair = POOL.take(key, make)
    if not layer._held:  # the first pair: give back whatever this layer holds when it is gone
        weakref.finalize(layer, POOL.give_back, layer._held)
    layer._held.append((key, pair))
    return pair


class SlabLayer(DynamicLayer):
    """One decoder layer's keys and values in buffers of ``capacity`` rows, ``length`` of them live."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._keys: torch.Tensor | None = None  # the buffers; ``keys``/``values`` are views of their live rows
        self._values: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None  # set by ``SlabCache.slots``: the whole-buffer layout for one forward
        self.static = False  # the buffers' addresses are fixed inputs of a CUDA graph (``SlabCache(static=True)``)
        self.index = 0  # the decoder layer's, which a static buffer is pooled under
        self._held: list = []  # a static layer's (pool key, buffer pair), its current pair last

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys, self._values = self._buffers(key_states, value_states, self.capacity)
        self._mark_dynamic()
        self.is_initialized = True
        self._view()

    def _buffers(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed buffers of ``capacity`` rows shaped as ``keys`` and ``values``: new, or for a static cache the pair
        the pool holds for this layer (``POOL``), which goes back there on growth or when the layer is gone."""
        def make():
            return (keys.new_zeros((*keys.shape[:2], capacity, keys.shape[-1])),
                    values.new_zeros((*values.shape[:2], capacity, values.shape[-1])))

        if not self.static:
            return make()
        return pooled_pair(self, (self.index, tuple(keys.shape[:2]), capacity, keys.shape[-1], values.shape[-1],
                                  keys.dtype, keys.device), make)

    def _mark_dynamic(self) -> None:
        """The buffers' length varies between caches: a compiled forward (``core.capture``) keeps one graph for all.
        Static buffers are also marked as fixed addresses, so a CUDA graph writes them in place rather than refusing
        to capture a forward that mutates its inputs (a new buffer, after a growth, is recorded anew)."""
        for buffer in (self._keys, self._values):
            torch._dynamo.maybe_mark_dynamic(buffer, 2)
            if self.static:
                torch._dynamo.mark_static_address(buffer)

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        old = self._keys, self._values
        self._keys, self._values = self._buffers(*old, capacity)
        self._keys[:, :, : self.length] = old[0][:, :, : self.length]
        self._values[:, :, : self.length] = old[1][:, :, : self.length]
        if self.static:
            POOL.give_back(self._held, keep_last=True)
        self.capacity = capacity
        self._mark_dynamic()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.slots is not None:  # the whole-buffer layout: written at tensor slots, the length moves after
            self._keys.index_copy_(2, self.slots, key_states)
            self._values.index_copy_(2, self.slots, value_states)
            return self._keys, self._values
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._keys[:, :, self.length: end] = key_states
        self._values[:, :, self.length: end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, span: "Span"):
        """``update`` inside ``SlabCache.appending``: the new rows at ``span``, views to its end, no attribute set."""
        self._keys[:, :, span.start: span.end] = key_states
        self._values[:, :, span.start: span.end] = value_states
        return self._keys[:, :, : span.end], self._values[:, :, : span.end]

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
        n = index.numel()
        for buffer in (self._keys, self._values):
            buffer[:, :, past: past + n] = buffer.index_select(2, index)  # gathered first: sources may overlap
        self.length = past + n
        self._view()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a SlabCache holds one sequence per batch row as allocated")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a SlabCache holds one sequence per batch row as allocated")


class SlabCache(Cache):
    """A KV cache of ``SlabLayer``s: one per decoder layer, each ``capacity`` rows to start with. ``static``: the
    buffers are fixed addresses of a CUDA graph (the whole-buffer layout's compiled forward)."""

    def __init__(self, num_layers: int, capacity: int = 256, static: bool = False):
        super().__init__(layers=[SlabLayer(capacity) for _ in range(num_layers)])
        self.span: Span | None = None  # set by ``appending``: one forward's rows in every layer
        for i, layer in enumerate(self.layers):
            layer.static, layer.index = static, i

    @property
    def capacity(self) -> int:
        """Rows every layer holds now (the whole-buffer layout's key length)."""
        return min(layer.capacity for layer in self.layers)

    @contextlib.contextmanager
    def slots(self, n: int, mask: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        """The whole-buffer layout for one forward of ``n`` rows after the live ones: ``update`` writes them at
        ``length, ..., length+n-1`` and returns whole buffers; yields ``mask`` (over the live rows and the n, as a
        live-row forward takes it; None: causal) padded to the buffer (``buffer_mask``). The length moves by ``n``
        once the forward is done, not where it failed."""
        past = self.get_seq_length()
        self.reserve(n)  # no growth inside the forward: a graph's buffers keep their shape
        slots = torch.arange(past, past + n, device=device)
        for layer in self.layers:
            layer.slots = slots
        try:
            yield buffer_mask(mask, past, n, self.capacity, dtype, device)
        finally:
            for layer in self.layers:
                layer.slots = None
        for layer in self.layers:  # the forward ran: its rows are live
            layer.length = past + n
            layer._view()

    @contextlib.contextmanager
    def appending(self, n: int):
        """One forward of ``n`` rows after the live ones whose layers change no attribute while it runs: every layer
        writes them at the span this holds and returns views to its end, and the lengths move once the forward is
        done (not where it failed). Inside a compiled graph, an attribute set by a layer is replayed after every call
        (each layer's length and views: a hundred Python objects a forward), and each layer's own length is an input
        of its own; the cache's one span is one."""
        self.reserve(n)
        past = self.get_seq_length()
        self.span = span = Span(past, past + n)
        try:
            yield
        finally:
            self.span = None
        for layer in self.layers:
            layer.length = span.end
            layer._view()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``; inside ``appending`` every layer writes at the cache's one span (read
        from the cache, not from each layer: one number in a graph's inputs, not one per layer)."""
        if self.span is not None:
            return self.layers[layer_idx].write(key_states, value_states, self.span)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in every layer now, and one to spare, so a compiled forward never grows a
        buffer inside its graph (a growth there is a new graph: ``core.capture``) and its live rows are never the
        whole buffer (a view that is the whole buffer is contiguous, which dynamo compiles a graph of its own for)."""
        for layer in self.layers:
            if layer.is_initialized and layer.length + rows >= layer.capacity:
                layer._grow(layer.length + rows + 1)

    def keep(self, past: int, rows: list[int] | torch.Tensor) -> None:
        """Keep verify rows ``rows`` (indices after ``past``, in order of the sequence) as the rows after ``past``."""
        index = past + torch.as_tensor(rows, dtype=torch.long)
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


def for_model(config, capacity: int = 256, static: bool = False) -> Cache:
    """A ``SlabCache`` for a model whose layers are all full attention, else transformers' ``DynamicCache``."""
    if full_attention_only(config):
        return SlabCache(config.get_text_config(decoder=True).num_hidden_layers, capacity, static)
    return DynamicCache(config=config)
