"""Drafters built at settings other than a method's defaults, kept for reuse, least recently used out first.

Each setting a visitor tries (eagle2 at depth 5, medusa at 40 nodes...) is another drafter, often another
copy of a network; kept without bound they grew the server's memory by a gigabyte in a sweep of forty
calls. Here they are bounded in count and in bytes: the bytes of the tensors a drafter owns (its modules'
parameters and buffers), not those it shares with the target (a tied embedding or head counts once, there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

from specviz.core.protocol import Drafter

MAX_COUNT = 32
MAX_BYTES = 1 << 30  # 1 GiB beyond the target and the default drafters


def _tensors(value, depth: int = 0):
    """The tensors ``value`` holds: a module's parameters and buffers, a tensor, or those inside a tuple, list or
    dict (one level: a drafter's frozen pieces)."""
    if isinstance(value, torch.nn.Module):
        yield from value.parameters()
        yield from value.buffers()
    elif isinstance(value, torch.Tensor):
        yield value
    elif depth == 0 and isinstance(value, (tuple, list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _tensors(item, 1)


def own_bytes(drafter: Drafter, shared: set[int]) -> int:
    """Bytes of the tensors ``drafter`` holds in its attributes, skipping storages in ``shared`` (the target's)
    and counting a storage several tensors view once."""
    seen, total = set(shared), 0
    for value in vars(drafter).values():
        for tensor in _tensors(value):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class BuiltDrafters:
    """An LRU of drafters by settings key, at most ``max_count`` of them and ``max_bytes`` of their own tensors.
    A drafter larger than the whole budget is still returned to its caller, just not kept."""

    def __init__(self, max_count: int = MAX_COUNT, max_bytes: int = MAX_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[Hashable, tuple[Drafter, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self._items.values())

    def get(self, key: Hashable) -> Drafter | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key][0]

    def put(self, key: Hashable, drafter: Drafter, size: int) -> None:
        self._items.pop(key, None)
        if size > self.max_bytes:
            return
        while self._items and (len(self._items) >= self.max_count or self.bytes + size > self.max_bytes):
            self._items.popitem(last=False)
        self._items[key] = (drafter, size)

    def clear(self) -> None:
        self._items.clear()
