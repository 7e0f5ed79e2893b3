"""Captured target forwards: the target's verify forward compiled once per process (``torch.compile``), so a step
pays for the model's arithmetic rather than for Python and one kernel launch per operator.

- **CPU**: inductor around the packed linear layers (``core.packing``: each one an opaque operator, the eager
  path's own packed product), dynamic query length: one graph for a one-row forward (decode) and one for 2+ rows
  (a chain or a tree), whatever the context length, since the ``SlabCache`` is read as views of its live rows.
  Without freezing (weights as constants, which inductor's cache does not keep), a compiled graph is cached
  between processes: a second process only traces its graphs (dynamo keeps no cache), well under a minute
  where the first compile takes minutes. Each packed layer is a C++ operator where the rows extension loads
  (``core.packing.register``), else a Python one. The graph's wrapper is C++ too (``cpp_wrapper``).
- **CUDA**: inductor's fused kernels replayed as CUDA graphs, one launch a forward. A CUDA graph is recorded per
  shape, so the forward runs in the **whole-buffer layout** (gpt-fast's): the new rows are written at slot
  tensors and attention reads the cache's whole buffer under a mask that hides the rows past the live ones
  (``core.cache``), so a forward's shapes depend on its row count and the capacity, never on the context. The
  buffers are fixed addresses (``SlabCache(static=True)``); graph outputs are copied out, since the next replay
  overwrites them.

``layout`` chooses per target: "live" (attention over the live rows: the CPU's default, where attending to a
whole buffer would cost arithmetic and there are no graphs to keep) or "buffer" (CUDA's default; on the CPU it runs
without graphs, which is how the tests check it).

A feature drafter compiles its own network step and head the same way where that pays (off the CPU, or where
``SPECVIZ_DRAFTER_ENGINE=compiled``; ``drafters/captured.py``), when it is built.

A bf16 target's refined LM head (``core.head``: a bf16 product, exact in fp32 at the top) runs after the graph,
eagerly: the graph ends at the final norm. Inside a graph the head would be the plain fp32 product, which costs a
tree verify's rows several times more.

Which forwards go through it (``TargetModel.forward_rows`` decides, per call): one sequence on a ``SlabCache``
whose buffers exist, and a batch on a ``BatchSlabCache`` (``core.batch``), whose rows' writes are planned outside
the graph, so the batch size, the rows' lengths and their order compile nothing new after the first batch of each
shape (one row, several). In the live-rows layout the plan is the rows' positions (``BatchSlabCache.planned``); in
the whole-buffer layout the forward is also padded to a power of two of rows and of entries a row, and attention
reads every row's whole buffer (``BatchSlabCache.whole``), so CUDA graphs record one shape per pair of buckets, not
one per batch. The prefill (once per decode, of any length) and other caches run eager: a graph for each would
cost more compile time than it saves.

Compiling takes minutes on a small CPU the first time, so it happens in ``warm`` (on a scratch cache, every graph
the decode will ask for) and the target serves on the eager path until ``ready``; ``start`` runs ``warm`` on a
thread, for an app whose page must not wait. Inductor's own cache goes under ``~/.cache/specviz/inductor`` unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise.

Guards: dynamo checks before each call that the graph still applies. Checks on the modules' attributes are
off (hundreds of them, about a millisecond a forward), which is safe because each ``CapturedForward`` compiles a
function with a code object of its own, so its graphs, frozen with its model's weights, serve no other model.

Exactness: a compiled forward is a different program from the eager one (fused, reordered arithmetic), so its
logits differ from eager's in the last bits. Every method and AR on one target use the same path, so "identical
to AR" compares like with like; the tests check both paths against AR, and the captured path against the eager
one on greedy text.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import types
from dataclasses import dataclass

import torch
import torch._dynamo
from torch.utils._pytree import tree_map_only

from .batch_cache import bucket
from .collector import make_thread_safe
from .files import cache_dir
from .grouping import GroupPass
from .head import refined
from .packing import register

ENGINES = ("eager", "compiled", "auto")  # auto: compiled where torch.compile works here, else eager
LAYOUTS = ("live", "buffer")  # what attention reads in a compiled forward: the live rows, or the whole buffer
GRAPH_ENTRIES = 64  # a batch's entries a row up to which ``warm_batches`` records CUDA graphs (more: recorded on use)
REVISION = 12  # of the compiled path; a new one where its cost changes, so budgets tuned on the old are not reused


def capture_unsupported(device: torch.device) -> str:
    """Why forwards on ``device`` cannot be captured here ("" where they can)."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception:  # noqa: BLE001 - no C++ compiler, in whatever form this torch reports it
            return "inductor needs a C++ compiler on the CPU and none was found"
        return ""
    if device.type == "cuda":
        return ""
    return f"torch.compile is not set up for {device.type} here"


@dataclass(frozen=True)
class EngineStatus:
    """Which path a target's forwards take now, and why: what a column header and a bench table show."""

    path: str  # "eager" | "compiled"
    detail: str = ""  # e.g. "compiling; eager until ready", the reason compilation failed, the compile time
    compiling: bool = False  # eager for now, compiled once a background compilation ends

    def __str__(self) -> str:
        return f"{self.path} ({self.detail})" if self.detail else self.path


def failure_text(error: Exception) -> str:
    """A failed compilation in one line: what a header or a bench table shows beside the eager path."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


def use_cache_folder() -> None:
    """Inductor's cache under ``~/.cache/specviz/inductor``: compiled graphs survive between processes there,
    and sessions, where the system's temporary folder (inductor's default) may not.

    Importing ``torch._dynamo`` already writes inductor's default folder into ``TORCHINDUCTOR_CACHE_DIR`` (it
    reads the variable again at every use), so a value equal to that default is replaced; one the user set to
    anything else is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def plain_causal_lm(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its output head over its decoder's last hidden state and nothing more (no
    logit soft-capping or scaling), so the two can be called apart: one graph without hidden-state hooks."""
    text = model.config.get_text_config()
    odd = any(getattr(text, name, None) not in (None, 1, 1.0)
              for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if odd or not callable(getattr(model, "get_decoder", None)) or model.get_output_embeddings() is None:
        return False
    decoder = model.get_decoder()
    return decoder is not None and decoder is not model


def decoder_then_head(model: torch.nn.Module, head_inside: bool = True, taps: tuple[int, ...] = ()):
    """The causal LM's forward as decoder, then head (``plain_causal_lm`` models): a function of the decoder's
    keyword arguments and ``keep`` that returns (logits, the last hidden state, i.e. the features, the inputs of
    decoder layers ``taps``). Its ``decoder`` attribute is the module those keywords are for, ``head`` the output
    head, ``taps`` the layers. Without ``head_inside`` it stops at the hidden state and returns None for the logits:
    the caller runs the head. Taps come from the decoder's own hidden states (its entry i is layer i's input), so a
    drafter reading layers (EAGLE-3) keeps the head outside a compiled graph like every other method."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def forward(keep: int = 0, **kwargs):
        out = decoder(**kwargs, output_hidden_states=True) if taps else decoder(**kwargs)
        hidden = out.last_hidden_state
        tapped = tuple(out.hidden_states[i] for i in taps)
        return (head(hidden[:, -keep:] if keep else hidden) if head_inside else None), hidden, tapped

    forward.decoder, forward.head, forward.taps = decoder, head, tuple(taps)
    return forward


def _own_code(fn):
    """``fn`` (a function or a bound method) with a code object of its own. Dynamo keeps compiled graphs per code
    object, and a graph names one model's packed layers (``core.packing``) and, with module guards off, trusts its
    modules unchecked: two targets in one process must never share one, which they would through
    ``decoder_then_head``'s closure or a model class's ``forward``."""
    func, owner = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn, None)
    code = func.__code__.replace(co_name=f"{func.__code__.co_name}_specviz{next(_CODES)}")
    own = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    own.__kwdefaults__, own.__dict__ = func.__kwdefaults__, dict(func.__dict__)
    return own if owner is None else types.MethodType(own, owner)


_CODES = itertools.count()


def default_layout(device: torch.device) -> str:
    """The whole buffer where CUDA graphs replay the forward, the live rows elsewhere (see the module's notes)."""
    return "buffer" if device.type == "cuda" else "live"


def run_graph(fn, graphs: bool, *args, **kwargs):
    """``fn(*args, **kwargs)``; where it replays as CUDA graphs (``graphs``), a new step is marked first and every
    output tensor is copied out, since a graph's outputs live in its memory pool and the next replay writes over
    them (the target's forward and a drafter's step and head alike)."""
    if not graphs:
        return fn(*args, **kwargs)
    torch.compiler.cudagraph_mark_step_begin()
    return tree_map_only(torch.Tensor, torch.clone, fn(*args, **kwargs))


def compile_forward(fn, device: torch.device, graphs: bool = False):
    """``fn`` compiled for ``device``; ``graphs``: replayed as CUDA graphs (the whole-buffer layout only)."""
    use_cache_folder()
    make_thread_safe()  # the app compiles on a thread while it serves eager forwards (``core.collector``)
    # a decode asks for three graphs (one row, a chain, a tree mask; ``SlabCache.reserve`` never fills a buffer
    # exactly, which would be a fourth); head room for a target whose forward specialises on more
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    # floats as constants: a model's float attributes (rotary scaling, norm eps) otherwise start as symbols that
    # inductor cannot keep, and dynamo traces every graph a second time to specialise them (two thirds of the time
    # a process takes to compile with inductor's cache warm)
    torch._dynamo.config.specialize_float = True
    # no guards on the modules' attributes: checking every module's hooks, types and flags costs about a millisecond
    # a forward on a 30-layer model, and a loaded target's modules do not change. Safe because each compiled
    # function has a code object, so a cache of graphs, of its own (``_own_code``)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    fn = _own_code(fn)
    if device.type == "cuda":  # "triton.cudagraphs" is what mode="reduce-overhead" sets, which excludes options
        return torch.compile(fn, dynamic=True, options={**options, "triton.cudagraphs": graphs})
    # no freezing: the linear layers reach their packed kernels through ``specviz::packed_linear`` (``core.packing``),
    # and a frozen graph (its weights inlined as constants) is one inductor's cache never keeps; layers reading one
    # input run as one product (``core.grouping``). The graph's wrapper (the code that allocates buffers and calls
    # each kernel and operator in turn) in C++ rather than Python: about a millisecond less a forward, the same
    # kernels, so the same numbers
    return torch.compile(fn, dynamic=True, options={**options, "post_grad_custom_post_pass": GroupPass(),
                                                    "cpp_wrapper": True})


class CapturedForward:
    """A target's forward compiled, and whether it is ready: ``plain`` (``decoder_then_head``, one graph without the
    hooks transformers uses to collect hidden states) where given, else ``model.forward`` whole. ``taps``: the
    decoder layers whose inputs it returns (``plain.taps`` where split). ``layout``: what attention reads
    (``LAYOUTS``; None: ``default_layout``); ``graphs``: replayed as CUDA graphs."""

    def __init__(self, model: torch.nn.Module, plain=None, layout: str | None = None, taps: tuple[int, ...] = ()):
        device = next(model.parameters()).device
        self.layout = layout or default_layout(device)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        self.graphs = device.type == "cuda" and self.layout == "buffer"
        self.split = plain is not None
        self.taps = plain.taps if self.split else tuple(taps)
        self.module = plain.decoder if self.split else model  # what the keyword arguments are for
        # a refined head (``core.head``) runs after the graph, eager: inside one it would be the plain fp32 product,
        # which costs a tree verify's rows several times what the refined head does
        self.head = plain.head if self.split and refined(model) else None
        if self.head is not None:
            plain = decoder_then_head(model, head_inside=False, taps=self.taps)
        self._fn = compile_forward(plain if self.split else model.forward, device, self.graphs)
        self.ready = False
        self.error: str | None = None
        self.compile_s: float | None = None
        self._thread: threading.Thread | None = None
        # ``warm_batches``'s (rows, capacity): asked before the path is ready, ``warm`` compiles them too, so a timed
        # batch run still compiles nothing
        self.batches: tuple[int, int] | None = None
        self._lock = threading.Lock()  # ``warm`` on its thread marks the path ready, ``warm_batches`` notes sizes

    def __call__(self, keep: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(logits, final-norm features, the inputs of the layers ``taps``)`` for ``self.module``'s keyword
        arguments."""
        if self.split:
            logits, hidden, tapped = run_graph(self._fn, self.graphs, keep=keep, **kwargs)
            if self.head is not None:
                logits = self.head(hidden[:, -keep:] if keep else hidden)
            return logits, hidden, tapped
        out = run_graph(self._fn, self.graphs, **kwargs, logits_to_keep=keep, output_hidden_states=True)
        return out.logits, out.hidden_states[-1], tuple(out.hidden_states[i] for i in self.taps)

    def fail(self, error: Exception) -> None:
        """A compiled forward broke while decoding: the target goes back to the eager path, and says why."""
        self.ready, self.error = False, f"failed while decoding: {failure_text(error)}"

    @property
    def status(self) -> EngineStatus:
        if self.ready:
            how = "CUDA graphs, " if self.graphs else "whole buffer, " if self.layout == "buffer" else ""
            return EngineStatus("compiled", f"{how}compiled in {self.compile_s:.0f} s")
        if self.error is not None:
            how = "the compiled path " if self.error.startswith("failed while") else "compilation failed: "
            return EngineStatus("eager", how + self.error)
        return EngineStatus("eager", "compiling; eager until ready", compiling=True)

    def warm(self, target, sizes: tuple[int, ...] = (1, 2)) -> bool:
        """Compile every graph a decode uses (one row, several rows, a tree mask) on a scratch cache, then mark
        the path ready. Returns whether it is; a failure is kept as ``error`` and the target stays eager."""
        from .tree import DraftTree  # a tree's mask exactly as verify builds it

        start = time.perf_counter()
        try:
            if target.device.type == "cpu":  # before tracing, here (on the compile thread: a first build takes seconds)
                register(target.model)  # its packed layers' calls in C++ where the rows extension loads
            cache = target.new_cache(64, static=self.graphs)
            target.prefill(list(range(1, 9)), cache)  # eager: allocates the buffers the graphs write into
            for n in sizes:
                target.forward_rows(torch.arange(n)[None] + 1, torch.arange(8, 8 + n)[None], None, cache,
                                    captured=self)
                cache.crop(-n)
            tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]))  # two children, one grandchild
            past = cache.get_seq_length()
            target.forward_rows(tree.input_ids(1)[None], tree.positions(past),
                                tree.attention_mask(past, target.dtype), cache, captured=self)
        except Exception as e:  # noqa: BLE001 - any failure means: stay on the eager path, say why
            self.error = failure_text(e)
            return False
        self.compile_s = time.perf_counter() - start
        warmed = None
        while True:  # then the batch graphs asked for meanwhile, before the path is ready: none compiles in a decode
            with self._lock:
                todo = self.batches if self.batches != warmed else None
                if todo is None:
                    self.ready = True
                    return True
            try:
                self._warm_batches(target, *todo)
            except Exception as e:  # noqa: BLE001 - whatever broke it breaks a batch's forward too: eager, saying why
                self.error = f"a batch's forward: {failure_text(e)}"
                return False
            warmed = todo

    def warm_batches(self, target, rows: int = 2, capacity: int = 16) -> None:
        """Compile the graphs a batch decode meets, on a scratch batch cache, so that none compiles mid-run: one row or
        several (a size of 1 is a graph of its own), one new entry a row or several (a batch's forward always
        carries a mask, so chains and trees share one). Where forwards replay as CUDA graphs, one is recorded per
        shape, so every pair of buckets a batch of up to ``rows`` sequences meets (entries up to ``GRAPH_ENTRIES``)
        is recorded too, on the buffers a cache of ``capacity`` tokens takes from the pool next. Asked before the
        path is ready (compiling on its thread), they are noted and ``warm`` compiles them before it marks the path
        ready. A failure leaves the target eager, saying why."""
        with self._lock:
            self.batches = (rows, capacity)
            if not self.ready:
                return
        try:
            self._warm_batches(target, rows, capacity)
        except Exception as e:  # noqa: BLE001 - whatever broke it breaks a batch's forward too: eager, saying why
            self.ready, self.error = False, f"a batch's forward: {failure_text(e)}"

    def _warm_batches(self, target, rows: int, capacity: int) -> None:
        sizes = [(r, n) for r in (1, 2) for n in (1, 2)]
        if self.graphs:
            sizes = [(1 << i, 1 << j) for i in range(bucket(rows).bit_length())
                     for j in range(GRAPH_ENTRIES.bit_length())]
        single = target.new_cache(16)
        target.prefill(list(range(1, 9)), single)
        cache = target.new_batch_cache(max(rows, 2), capacity)
        for live, n in sizes:
            while cache.active < live:
                cache.adopt(cache.add(), single)
            cache.keep(0, 5, [])  # rows of unequal lengths, as a batch's are
            end = cache.get_seq_length() + n
            mask = torch.zeros(live, 1, n, end, dtype=target.dtype)
            positions = torch.tensor(cache.lengths)[:, None] + torch.arange(n)
            target.forward_rows(torch.ones(live, n, dtype=torch.long), positions, mask, cache, captured=self)

    def start(self, target, then=None) -> threading.Thread:
        """``warm`` on a daemon thread, then ``then()`` (compiled or not); the target serves eager meanwhile."""
        def work() -> None:
            self.warm(target)
            if then is not None:
                then()

        if self._thread is None:
            self._thread = threading.Thread(target=work, name="specviz-compile", daemon=True)
            self._thread.start()
        return self._thread

    @property
    def started(self) -> bool:
        """Whether it compiles (or compiled) on a thread of its own (``start``), not in the caller's."""
        return self._thread is not None

    def thread_alive(self) -> bool:
        """Whether a background compilation is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready
