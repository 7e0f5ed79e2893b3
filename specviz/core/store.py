"""One KV store for every layer of a cache: all layers' keys in one tensor ``[layers, rows, kv_heads, capacity,
head_dim]`` and all values in another, each layer's buffers being its slices.

Why one store: a compiled forward then takes two tensors and one capacity as inputs, not two and a capacity per
layer; the store grows as one (two copies, not two per layer); a commit or a row's move is one gather per tensor
for every layer at once.

Writes inside a compiled forward go through ``put`` (one ``index_put_`` on the store itself, every index a tensor):
a write into a slice of a layer's slice makes functionalization write the new rows into a copy of the whole store,
which inductor does not put back in place.

Rule: a ``static`` store (its addresses are fixed inputs of CUDA graphs) takes its pair from ``core.pool`` and is
itself the pool's holder: the pair goes back when the store is gone, an older pair when it grows.

Invariant: the keys and values have the same layers, rows and capacity; a cache using the store owns what each
row and position means (live lengths, the rows in use): the store copies, never decides.
"""

from __future__ import annotations

import torch
import torch._dynamo

from . import pool


class Store:
    """Keys and values for ``layers`` decoder layers, ``rows`` sequences of ``capacity`` positions, shaped after one
    layer's entries (``[rows, kv_heads, n, head_dim]``, keys and values each). ``dynamic``: the store's dimensions
    that vary between caches, so a compiled forward keeps one graph for all (``mark_dynamic``)."""

    def __init__(self, layers: int, keys: torch.Tensor, values: torch.Tensor, rows: int, capacity: int,
                 static: bool = False, dynamic: tuple[int, ...] = (3,)):
        self.static, self.dynamic = static, dynamic
        self._held: list = []  # a static store's (pool key, pair) records, its current pair last
        self.keys, self.values = self._make(layers, keys, values, rows, capacity)

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def _make(self, layers: int, keys: torch.Tensor, values: torch.Tensor, rows: int, capacity: int):
        """A zeroed pair (zeros: a row hidden by a mask is never NaN): new, or a static store's from the pool."""
        shapes = [(layers, rows, like.shape[1], capacity, like.shape[-1]) for like in (keys, values)]

        def make():
            return keys.new_zeros(shapes[0]), values.new_zeros(shapes[1])

        pair = make() if not self.static else pool.pooled_pair(
            self, ("store", self.dynamic, *shapes, keys.dtype, keys.device), make)
        mark_dynamic(pair, self.dynamic, self.static)
        return pair

    def fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether one layer's entries have the store's heads, head size, dtype and device (a model may have a layer
        unlike the others: that layer keeps buffers of its own)."""
        return all((like.shape[1], like.shape[-1], like.dtype, like.device)
                   == (mine.shape[2], mine.shape[-1], mine.dtype, mine.device)
                   for like, mine in ((keys, self.keys), (values, self.values)))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s buffers ``[rows, kv_heads, capacity, head_dim]``: views of the store."""
        return self.keys[index], self.values[index]

    def grow(self, rows: int, capacity: int, live: int | None = None) -> None:
        """A pair of ``rows`` rows and ``capacity`` positions, the first ``live`` positions (None: all) of every old
        row copied over. The old pair is held until the copy is done: for a moment three times the memory, where a
        growth layer by layer would hold one layer's extra."""
        old = self.keys, self.values
        self.keys, self.values = self._make(old[0].shape[0], old[0][0], old[1][0], rows, capacity)
        live = old[0].shape[3] if live is None else live
        for new, before in zip((self.keys, self.values), old):
            new[:, : before.shape[1], :, :live] = before[:, :, :, :live]
        if self.static:
            pool.give_back(self._held, keep_last=True)

    def put(self, layer: int, at: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One layer's new entries ``[rows, heads, n, dim]`` at positions ``at`` ([rows, n], or [1, n] for every row):
        one ``index_put_`` per tensor, every index a tensor, which inductor writes in place."""
        rows, heads = key_states.shape[:2]
        device = key_states.device
        index = (torch.full((1, 1, 1), layer, device=device), torch.arange(rows, device=device)[:, None, None],
                 torch.arange(heads, device=device)[None, :, None], at[:, None, :])
        self.keys.index_put_(index, key_states)
        self.values.index_put_(index, value_states)

    @torch.inference_mode()  # the store may have been made by a forward under inference mode
    def keep(self, past: int, index: torch.Tensor, row: int | None = None) -> None:
        """Positions ``index`` moved to ``past, past+1, ...`` in every layer: of every row, or of ``row`` alone."""
        pair = (self.keys, self.values) if row is None else (self.keys[:, row], self.values[:, row])
        keep_rows(pair, 3 if row is None else 2, past, index)

    @torch.inference_mode()
    def move(self, source: int, target: int, length: int) -> None:
        """Row ``source``'s first ``length`` positions copied to row ``target``, in every layer."""
        for tensor in (self.keys, self.values):
            tensor[:, target, :, :length] = tensor[:, source, :, :length]


def mark_dynamic(buffers, dims: tuple[int, ...], static: bool) -> None:
    """The buffers' ``dims`` (their capacity, a batch's rows) vary between caches: a compiled forward keeps one graph
    for all (a size it took as fixed would pass into every shape derived from it). Static buffers are also marked as
    fixed addresses, so a CUDA graph writes them in place rather than refusing to capture a forward that mutates its
    inputs (a new buffer, after a growth, is recorded anew)."""
    for buffer in buffers:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(buffer, dim)
        if static:
            torch._dynamo.mark_static_address(buffer)


def keep_rows(buffers, dim: int, past: int, index: torch.Tensor) -> None:
    """Positions ``index`` of each buffer along ``dim`` moved to ``past, past+1, ...``: gathered first, since the
    sources may overlap the destination."""
    for buffer in buffers:
        buffer.narrow(dim, past, index.numel()).copy_(buffer.index_select(dim, index))
