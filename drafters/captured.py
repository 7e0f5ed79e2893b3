"""Captured drafter forwards: a feature drafter's network step and its draft head compiled, as the target's verify
forward is (``core.capture``: the same guards, packed layers as opaque operators, code objects of their own).

A feature drafter (EAGLE-2/3, HASS, FSPAD) runs two small computations per tree depth: its one-layer network over
the frontier, then the draft head's log-probabilities and their top k. Eager, each costs a launch per operator and
Python around them, which on a CPU is most of a one-layer forward; compiled, each is one graph.

Where (``capture_drafters``): on a compiled target off the CPU, or wherever ``SPECVIZ_DRAFTER_ENGINE=compiled``.
Which calls go through them (``CapturedDraft.usable``): one lane on a ``SlabCache`` whose buffers exist, in the
target's layout (the whole buffer, as CUDA graphs replay it, on a GPU); several lanes (a stacked copy of their
caches) and the first feed (which allocates the buffers) run eager. The graphs are compiled in ``warm``, when the
drafter is built (``build_drafter``), so a bench or the tuner never times a compilation.

Exactness: a compiled draft may differ from the eager one in the last bits (another tree near a tie); the target
verifies either, so lossless methods still give the target's own output (``tests/test_capture.py``).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from specviz.core.cache import SlabCache
from specviz.core.capture import compile_forward, default_layout, failure_text, run_graph
from specviz.core.errors import SettingsError
from specviz.core.packing import register


def capture_drafters(target) -> bool:
    """Whether feature drafters compile their forwards for ``target``: only where the target itself runs compiled,
    and then as ``SPECVIZ_DRAFTER_ENGINE`` says: "compiled", "eager", or "auto" (the default: compiled off the
    CPU). On a CPU a compiled one-layer drafter measured slower than the eager one: dynamo's cost per call
    (guards, argument handling) outweighs the few operators a graph fuses (docs/engine.md)."""
    choice = os.environ.get("SPECVIZ_DRAFTER_ENGINE", "auto")
    if choice not in ("auto", "compiled", "eager"):
        raise SettingsError(f"SPECVIZ_DRAFTER_ENGINE is auto, compiled or eager, got {choice!r}")
    if target.engine.path != "compiled" or choice == "eager":
        return False
    return choice == "compiled" or target.device.type != "cpu"


def capture_heads(target) -> bool:
    """Whether hidden-state drafters (Medusa, ReDrafter, semi-AR) compile their drafts for ``target``: only where
    asked (``SPECVIZ_DRAFTER_ENGINE=compiled``) on a compiled target. Each draft shape is a graph of its own (a
    tuner's every width and length), which a GPU has not yet timed against the launches it saves."""
    return capture_drafters(target) and os.environ.get("SPECVIZ_DRAFTER_ENGINE") == "compiled"


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
CAPTURE_LOCK = threading.Lock()  # held while a drafter's graphs are looked up or compiled


def shared_captures(model: nn.Module) -> dict:
    """The captured drafters of one target ``model`` in this process, by the drafter's own key; forgotten with the
    model (a key holds no target alive, and a new model at a freed one's address finds nothing)."""
    return _SHARED.setdefault(model, {})


class _Head(nn.Module):
    """The draft head's weight as a module's buffer (shares the frozen head's storage): a graph input, multiplied
    as it is (on a CPU, where drafters compile only when asked to, without the eager head's packing)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class Captured:
    """What a drafter's compiled forwards share: ``ready`` once ``warm`` has compiled every graph a decode asks for,
    ``error`` where that failed (the drafter stays eager), ``calls`` that went through them, ``graphs``: replayed as
    CUDA graphs, whose outputs are copied out before the next replay."""

    def __init__(self, graphs: bool):
        self.graphs = graphs
        self.ready, self.error, self.compile_s = False, None, None
        self.calls = 0  # forwards that went through the graphs: what tests and the profile read

    def fail(self, error: Exception) -> None:
        """A graph broke: the drafter drafts eagerly from here on, and says why."""
        self.ready, self.error = False, f"failed while drafting: {failure_text(error)}"
        warnings.warn(f"the drafter's compiled forwards stopped: {self.error}", stacklevel=3)

    def warm(self, draft) -> bool:
        """Compile every graph a decode asks for by running ``draft()`` (the drafter's scratch decode) through them;
        then ready. Returns whether it is; a failure is kept as ``error`` and the drafter stays eager."""
        start = time.perf_counter()
        self.ready = True  # the scratch decode goes through the graphs
        try:
            with torch.inference_mode():  # as decoding runs: a graph compiled with autograd on would not be reused
                draft()
        except Exception as e:  # noqa: BLE001 - any failure means: stay eager, say why
            self.ready = False
            self.error = failure_text(e)
        if not self.ready:  # failed, here or inside a forward (``fail``)
            warnings.warn(f"the drafter's forwards stay eager: {self.error}", stacklevel=2)
            return False
        self.compile_s = time.perf_counter() - start
        self.calls = 0
        return True


class CapturedDraft(Captured):
    """A feature drafter's ``step`` (network over features and tokens) and ``top`` (head log-probabilities, top k)
    compiled. ``layout`` as its target's (``core.capture``): on a GPU the step reads its cache's whole buffer and both
    replay as CUDA graphs."""

    def __init__(self, net: nn.Module, frozen, device: torch.device, layout: str | None = None):
        self.layout = layout or default_layout(device)
        super().__init__(device.type == "cuda" and self.layout == "buffer")
        embed, head = frozen.embedding, _Head(frozen.head)

        def step(feats, tokens, positions, mask, cache):
            return net(feats, embed(tokens).detach(), positions, mask, cache)

        def top(head_in, k: int):
            return torch.log_softmax(head(head_in).float(), dim=-1).topk(k, dim=-1)

        if device.type == "cpu":
            register(net)  # its packed layers' calls in C++ where the rows extension loads (``core.packing``)
        self.step, self.top = compile_forward(step, device, self.graphs), compile_forward(top, device, self.graphs)

    def usable(self, feats: torch.Tensor, cache) -> bool:
        """Whether this network call may run compiled: one lane on a slab cache whose buffers exist."""
        return self.ready and feats.shape[0] == 1 and isinstance(cache, SlabCache) and cache.is_initialized

    def run_step(self, feats, tokens, positions, mask, cache):
        """``mask``: [1, 1, n, keys] over the live rows, as the eager network takes it. None where the graph broke
        (``fail``): the caller runs the eager network instead, on the cache as it was."""
        self.calls += 1
        # contiguous: a graph is kept per input layout, and the frontier's inputs are often expanded views
        feats, tokens, positions, mask = (t.contiguous() for t in (feats, tokens, positions, mask))
        past, n = cache.get_seq_length(), feats.shape[1]
        try:
            if self.layout != "buffer":
                with cache.appending(n):  # room made and lengths moved outside the graph, never in it
                    return self.step(feats, tokens, positions, mask, cache)
            with cache.slots(n, mask, mask.dtype, feats.device) as whole:
                return run_graph(self.step, self.graphs, feats, tokens, positions, whole, cache)
        except Exception as e:  # noqa: BLE001 - whatever broke the graph: draft on eagerly, saying why
            if cache.get_seq_length() > past:
                cache.crop(past - cache.get_seq_length())
            self.fail(e)
            return None

    def run_top(self, head_in: torch.Tensor, k: int):
        """As ``run_step``: None where the graph broke."""
        try:
            return run_graph(self.top, self.graphs, head_in.contiguous(), k)
        except Exception as e:  # noqa: BLE001 - as in run_step
            self.fail(e)
            return None


class CapturedHeads(Captured):
    """A hidden-state drafter's whole draft at its full length as one graph (``draft``: Medusa's heads and their top
    k; the beam search of ReDrafter and semi-AR, every depth's head, top k and step), for one lane. A shorter draft
    (near a decode's end) and a batch's lanes run eager."""

    def __init__(self, draft, net: nn.Module, device: torch.device):
        super().__init__(device.type == "cuda")
        if device.type == "cpu":
            register(net)
        self.draft = compile_forward(draft, device, self.graphs)

    def run(self, *args):
        """``draft(*args)``; None where the graph broke (``fail``): the caller drafts eagerly instead."""
        self.calls += 1
        try:
            return run_graph(self.draft, self.graphs, *args)
        except Exception as e:  # noqa: BLE001 - whatever broke the graph: draft on eagerly, saying why
            self.fail(e)
            return None
