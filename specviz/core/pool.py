"""Buffers at fixed addresses, kept for the next KV cache of the same shape.

A CUDA graph records the addresses of the buffers it writes; a static cache (``SlabCache(static=True)``,
``BatchSlabCache(static=True)``) takes its buffers from ``POOL``, so the next decode of the same shape finds them
where its graphs recorded and replays, rather than records anew (inductor records again on a new address, up to a
limit, then stops replaying that graph).

Rule: a holder (a ``core.store.Store``, or a cache layer with buffers of its own) records every buffer pair it
took in its ``_held`` list, its current pair last; the pairs go back when the holder is gone, and an older pair goes
back when the holder grows (``give_back(holder._held, keep_last=True)``). Holders alive at the same time never
share a pair.
"""

from __future__ import annotations

import threading
import weakref

import torch


class BufferPool:
    """The buffer pairs of static caches that are gone or grew, by key (what the pair is for: its shape, dtype,
    device and owner's place). Kept for the process: as many as the most holders alive at once needed."""

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
        """``held``: a holder's (key, pair) records, oldest first; all go back but, with ``keep_last``, the newest."""
        with self._lock:
            while len(held) > keep_last:
                key, pair = held.pop(0)
                self._free.setdefault(key, []).append(pair)


POOL = BufferPool()


def pooled_pair(holder, key: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer pair for ``key`` from ``POOL`` (``make()`` where it holds none), recorded in ``holder._held``: every
    pair it held goes back when the holder is gone."""
    pair = POOL.take(key, make)
    if not holder._held:  # the first pair: give back whatever this holder holds when it is gone
        weakref.finalize(holder, give_back, holder._held)
    holder._held.append((key, pair))
    return pair


def give_back(held: list, keep_last: bool = False) -> None:
    """``POOL.give_back``, through the module's pool at call time (tests replace it)."""
    POOL.give_back(held, keep_last)
