"""The target's KV cache for several sequences at once: ``SlabCache``'s buffers with one live length per row.

Each layer owns buffers ``[rows, kv_heads, capacity, head_dim]`` for keys and values. Row r holds one
sequence, its committed keys and values at positions ``[0, lengths[r])``. A forward over the batch writes
each row's n new entries at that row's own length, and attention reads positions ``[0, max(lengths) + n)``
of every live row, as views: the caller's 4D mask (``core.batch``) hides from each row what is not its own
(a shorter row's stale positions, its padding).

- ``add()`` gives a joining sequence the next free row, empty, and ``adopt(row, cache)`` fills it with what
  the sequence's own prefill wrote into a one-sequence cache;
- ``keep(row, past, rows)`` moves the verify entries a row accepted into place after ``past`` and sets
  its length: O(accepted), whatever the context (a prefix needs no move);
- ``drop(row)`` frees a finished sequence's row by moving the last live row into it (once, O(its context)),
  so the live rows stay a prefix ``[0, active)`` and attention never reads a gathered copy;
- ``planned(n, device)`` holds one forward's writes as data (each row's positions as a tensor, the rows attention
  reads as one length), room made first: a compiled forward (``core.capture``) then traces no Python list of
  lengths, whose every value and order it would otherwise guard on and compile again for;
- ``whole(ids, positions, mask)`` is the **whole-buffer layout** (what a CUDA graph needs, as ``SlabCache.slots``
  is for one sequence): the forward is padded to ``bucket(rows)`` rows of ``bucket(n)`` entries, attention reads
  every row's whole buffer under the mask padded to the capacity, so a forward's shapes depend on those two
  buckets and the capacity only, never on the rows' lengths. A filler entry (a padding row, or a padding entry
  of a real row) is written after its row's live positions, where nothing reads it, and sees only itself.

A ``static`` cache (the buffers' addresses are fixed inputs of CUDA graphs) takes its buffers from ``core.pool``, as
``SlabCache(static=True)`` does, so that the next decode of the same shape replays the graphs recorded for this one.

Invariant: rows ``[0, active)`` are live; row r's positions ``[0, lengths[r])`` are its committed sequence,
in order; everything else is stale and never read. The buffers start at the batch's row count and the
capacity asked for, and double when a write goes past it (slower once, never wrong).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from . import pool
from .cache import StoreOwner
from .store import Store, mark_dynamic
from .transfer import to_device


def bucket(n: int) -> int:
    """The power of two at or above ``n``: the rows and entries a whole-buffer forward is padded to, so that CUDA
    graphs are recorded for a few shapes (as vLLM records its batch sizes) and not one per batch."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class WritePlan:
    """One forward's writes into every layer: row b's n new entries go to ``where[b]``, and attention reads each
    live row's first ``end`` positions (the longest row's length plus n)."""

    where: torch.Tensor  # [rows, n], long, on the cache's device
    end: int | None  # None: every row's whole buffer (the whole-buffer layout)


class Rows:
    """What every layer of one ``BatchSlabCache`` shares: how many rows are live, each one's length, and the write
    plan of the forward under way where one was made (``BatchSlabCache.planned``)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._where: tuple | None = None  # (lengths, n, device, index): one forward's write positions
        self.plan: WritePlan | None = None

    @property
    def active(self) -> int:
        return len(self.lengths)

    def where(self, n: int, device: torch.device) -> torch.Tensor:
        """[rows, n] positions each row's n new entries go to; made once per forward, for all its layers."""
        key = (tuple(self.lengths), n, device)
        if self._where is None or self._where[:3] != key:
            index = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(n, device=device)
            self._where = (*key, index)
        return self._where[3]


class BatchSlabLayer(DynamicLayer):
    """One decoder layer's keys and values for every row of the batch."""

    def __init__(self, rows: Rows, batch: int, capacity: int, static: bool = False, index: int = 0):
        super().__init__()
        # two rows at least: a compiled forward specialises on a buffer of one row (a graph more to compile), and
        # a cache for one sequence is what ``SlabCache`` is for
        self.rows, self.batch, self.capacity = rows, max(2, batch), max(1, capacity)
        self.static, self.index = static, index  # fixed addresses, pooled under the decoder layer's index
        self._held: list = []  # a static layer's (pool key, buffer pair), its current pair last
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self.owner: weakref.ref | None = None  # the cache whose store may hold this layer's buffers
        self.shared = False  # the buffers are slices of the owner's store (``SlabLayer.shared``)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        owner = self.owner() if self.owner is not None else None
        slices = owner.share(self, key_states, value_states, self.batch) if owner is not None else None
        if slices is None:
            self._keys, self._values = self._buffers(key_states, self.batch, self.capacity)
            self._mark_dynamic()
        else:
            (self._keys, self._values), self.shared = slices, True
        self.is_initialized = True

    def _buffers(self, like: torch.Tensor, batch: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value buffers of ``batch`` rows and ``capacity`` positions (zeros: never NaN, even
        unread); a static layer's come from the pool."""
        shape = (batch, like.shape[1], capacity, like.shape[-1])

        def make():
            return like.new_zeros(shape), like.new_zeros(shape)

        if not self.static:
            return make()
        return pool.pooled_pair(self, ("batch", self.index, shape, like.dtype, like.device), make)

    def _mark_dynamic(self) -> None:
        mark_dynamic((self._keys, self._values), (0, 2), self.static)

    def fit(self, store: Store) -> None:
        """Take the store's rows and capacity (the layer's buffers are, or will be, its slices)."""
        self.batch, self.capacity = store.rows, store.capacity

    def _grow(self, batch: int, capacity: int) -> None:
        if self.shared:
            self.owner().grow(batch, capacity)
            return
        old = self._keys, self._values
        self._keys, self._values = self._buffers(old[0], batch, capacity)
        for new, before in zip((self._keys, self._values), old):
            new[: before.shape[0], :, : before.shape[2]] = before
        if self.static:
            pool.give_back(self._held, keep_last=True)
        self.batch, self.capacity = batch, capacity
        self._mark_dynamic()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write row b's n new entries at ``lengths[b]``; return every live row's ``[0, max(lengths) + n)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, n = key_states.shape[0], key_states.shape[2]
        plan = self.rows.plan
        if plan is not None:  # a planned forward: no lengths read, no growth (``BatchSlabCache.planned``)
            # every dimension indexed: the indices broadcast to [b, heads, n], the entries' own layout (no transpose)
            which = torch.arange(b, device=self.device)[:, None, None]
            heads = torch.arange(key_states.shape[1], device=self.device)[None, :, None]
            self._keys[which, heads, plan.where[:, None]] = key_states
            self._values[which, heads, plan.where[:, None]] = value_states
            # no attribute set here: inside a graph each would be replayed after every call (``SlabCache.appending``);
            # the plan's end sets the views
            if plan.end is None:  # the whole-buffer layout: every position, the mask hides what is not live
                return self._keys[:b], self._values[:b]
            return self._keys[:b, :, : plan.end], self._values[:b, :, : plan.end]
        if b != self.rows.active:
            raise ValueError(f"a forward of {b} rows over a cache with {self.rows.active} live ones")
        starts = self.rows.lengths
        end = max(starts) + n
        if end > self.capacity or b > self.batch:
            self._grow(max(b, self.batch), max(end, 2 * self.capacity))
        if len(set(starts)) == 1:  # aligned rows (always so at batch size 1): one slice
            self._keys[:b, :, starts[0]: end] = key_states
            self._values[:b, :, starts[0]: end] = value_states
        else:
            where = self.rows.where(n, self.device)
            which = torch.arange(b, device=self.device)[:, None]
            self._keys[which, :, where] = key_states.transpose(1, 2)  # indexed dims first: [b, n, heads, dim]
            self._values[which, :, where] = value_states.transpose(1, 2)
        self.keys, self.values = self._keys[:b, :, :end], self._values[:b, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return max(self.rows.lengths, default=0)

    @torch.inference_mode()  # the buffers were made by a forward under inference mode
    def keep(self, row: int, past: int, index: torch.Tensor) -> None:
        n = index.numel()
        for buffer in (self._keys, self._values):
            buffer[row, :, past: past + n] = buffer[row].index_select(1, index)  # gathered first: sources overlap

    @torch.inference_mode()
    def move(self, source: int, target: int, length: int) -> None:
        for buffer in (self._keys, self._values):
            buffer[target, :, :length] = buffer[source, :, :length]


class BatchSlabCache(StoreOwner):
    """A KV cache of ``BatchSlabLayer``s for up to ``batch`` sequences of ``capacity`` tokens each (both grow);
    ``static`` and ``shared`` as ``SlabCache``'s (a store's rows and capacity both vary between caches)."""

    dynamic = (1, 3)

    def __init__(self, num_layers: int, batch: int, capacity: int = 256, static: bool = False, shared: bool = False):
        self.rows = Rows()
        super().__init__([BatchSlabLayer(self.rows, batch, capacity, static, i) for i in range(num_layers)], static,
                         shared)

    def grow(self, batch: int, capacity: int) -> None:
        """The store grown to ``batch`` rows and ``capacity`` positions, all it held copied over (``Store.grow``)."""
        self.store.grow(batch, capacity)
        self._regrown()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``; a planned forward over a stored cache writes through the store (one
        ``index_put_`` per tensor: ``Store.put``), so a compiled forward takes two buffers as inputs."""
        plan = self.rows.plan
        if plan is None or not self.stored:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.store.put(layer_idx, plan.where, key_states, value_states)
        b = key_states.shape[0]
        keys, values = self.store.keys[layer_idx, :b], self.store.values[layer_idx, :b]
        if plan.end is None:  # the whole-buffer layout: every position, the mask hides what is not live
            return keys, values
        return keys[:, :, : plan.end], values[:, :, : plan.end]

    @property
    def lengths(self) -> list[int]:
        return list(self.rows.lengths)

    @property
    def active(self) -> int:
        return self.rows.active

    def add(self) -> int:
        """A row for a joining sequence, empty; returns its index (the last live row)."""
        self.rows.lengths.append(0)
        return self.rows.active - 1

    @torch.inference_mode()  # buffers made (or grown) by a forward are inference tensors
    def adopt(self, row: int, single: Cache) -> None:
        """Copy a one-sequence cache (a lone prefill's ``SlabCache``) into ``row``, which takes its length."""
        length = single.get_seq_length()
        for layer, source in zip(self.layers, single.layers):
            keys, values = source.keys[:, :, :length], source.values[:, :, :length]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            if length > layer.capacity or row >= layer.batch:
                layer._grow(max(row + 1, layer.batch), max(length, 2 * layer.capacity))
            layer._keys[row, :, :length] = keys[0]
            layer._values[row, :, :length] = values[0]
        self.rows.lengths[row] = length

    def keep(self, row: int, past: int, rows: list[int]) -> None:
        """Keep verify entries ``rows`` (indices after ``past``, in sequence order) of ``row`` as its positions
        ``past, past + 1, ...``; its length becomes ``past + len(rows)``."""
        if rows != list(range(len(rows))):  # a prefix is in place already
            index = past + torch.as_tensor(rows, dtype=torch.long)
            if self.stored:  # two gathers for every layer at once
                self.store.keep(past, to_device(index, self.store.keys.device), row)
            else:
                for layer in self.layers:
                    if layer.is_initialized:
                        layer.keep(row, past, to_device(index, layer.device))
        self.rows.lengths[row] = past + len(rows)

    def drop(self, row: int) -> int | None:
        """Free ``row``: the last live row moves into it. Returns the row that moved (None: it was the last)."""
        last = self.rows.active - 1
        if row != last:
            length = self.rows.lengths[last]
            if self.stored:
                self.store.move(last, row, length)
            else:
                for layer in self.layers:
                    if layer.is_initialized:
                        layer.move(last, row, length)
            self.rows.lengths[row] = length
        self.rows.lengths.pop()
        return last if row != last else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.rows.lengths, default=0)

    def _room(self, rows: int, end: int) -> None:
        """Every layer's buffers hold ``rows`` rows and ``end`` positions with one to spare (so a view of the live
        rows is never a whole buffer, which dynamo compiles apart), grown before a forward, never inside one."""
        if not self.is_initialized:
            raise ValueError("a planned forward needs buffers: the first rows arrive by adopt() or a forward")
        for layer in self.layers:
            if end >= layer.capacity or rows > layer.batch:
                layer._grow(max(rows, layer.batch), max(end + 1, 2 * layer.capacity))

    @contextlib.contextmanager
    def _plan(self, where: torch.Tensor, end: int | None):
        torch._dynamo.maybe_mark_dynamic(where, 0)  # as the buffers' (``BatchSlabLayer._mark_dynamic``)
        torch._dynamo.maybe_mark_dynamic(where, 1)
        self.rows.plan = WritePlan(where, end)
        try:
            yield
        finally:
            self.rows.plan = None
            live, reach = self.active, end if end is not None else self.get_seq_length() + where.shape[1]
            for layer in self.layers:  # as an eager forward leaves them: every live row, to the forward's end
                if layer.is_initialized:
                    layer.keys, layer.values = layer._keys[:live, :, :reach], layer._values[:live, :, :reach]

    @contextlib.contextmanager
    def planned(self, n: int, device: torch.device):
        """Inside the block, a forward of n new entries per live row writes by a plan made here (``WritePlan``):
        room made first (``_room``), then the positions are one tensor."""
        end = self.get_seq_length() + n
        self._room(self.active, end)
        with self._plan(self.rows.where(n, device), end):
            yield

    @contextlib.contextmanager
    def whole(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype):
        """The whole-buffer layout for one forward over every live row: ``ids`` and ``positions`` [rows, n] and the
        additive ``mask`` [rows, 1, n, w] (over each row's first w positions, as the live-rows layout takes it) come
        back padded to ``bucket(rows)`` rows of ``bucket(n)`` entries and the mask to the capacity, as the forward's
        keyword arguments; inside the block that forward writes by the plan and reads whole buffers. Its outputs'
        first ``rows`` rows and ``n`` entries are the real ones. Row b's entries go after its ``lengths[b]``; a
        filler row's after position 0, in a row of the buffer no sequence holds."""
        rows, n = ids.shape
        if rows != self.active:
            raise ValueError(f"a forward of {rows} rows over a cache with {self.active} live ones")
        if mask is None or mask.shape[-1] > self.get_seq_length() + n:
            raise ValueError("a batch's whole-buffer forward takes its 4D mask over the live rows and the new entries")
        padded, width, device = bucket(rows), bucket(n), ids.device
        self._room(padded, self.get_seq_length() + width)
        capacity = self.layers[0].capacity
        starts = torch.tensor(self.rows.lengths + [0] * (padded - rows), device=device)
        where = starts[:, None] + torch.arange(width, device=device)
        filler = torch.ones(padded, width, dtype=torch.bool)
        filler[:rows, :n] = False
        at = tuple(to_device(i, device) for i in filler.nonzero(as_tuple=True))  # found on the host: no sync
        full = torch.full((padded, 1, width, capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
        full[:rows, :, :n, : mask.shape[-1]] = mask.to(device=device, dtype=dtype)
        full[at[0], 0, at[1], where[at]] = 0  # a filler entry sees only itself: no softmax row is empty (NaN)
        args = dict(input_ids=ids.new_zeros(padded, width), position_ids=positions.new_zeros(padded, width),
                    attention_mask=full)
        args["input_ids"][:rows, :n] = ids
        args["position_ids"][:rows, :n] = positions
        with self._plan(where, None):
            yield args
