"""The target model: prefill, verify a whole draft tree in one forward, commit the accepted path.

Only transformers' public API is used: a custom 4D additive mask, explicit ``position_ids`` and a KV
``Cache`` (``core.cache.SlabCache``: preallocated, rewound by a length) trimmed to the accepted path after
each verify. The cache belongs to the decode loop that uses it (``new_cache()``), so several decodes can
share one target.

The target only decodes. It runs the model as given (in eval mode) and changes nothing else on it:
running the head in fp32 and packing the linear layers is ``core.load.prepare``'s, done where the
model is built; text (chat template, EOS ids) is ``core.text.ChatText``'s, held here as ``text``; the
verify padding a machine prefers is measured by the caller and passed to ``verify``.

**Features** are the target's final-norm output at each position: the hidden state its LM head
reads, EAGLE's "feature". The engine hands drafters exactly this (``Commit.features``) and the
training pipeline stores exactly this; no drafter applies the norm again. The model is called as its decoder,
then its head (``core.capture.decoder_then_head``), so they are the decoder's last hidden state; a model whose
logits are more than its head's output (soft-capping) is called whole and a hook that lives for one forward only
catches them. A drafter that reads more layers (EAGLE-3) asks for them with
``tap``: their inputs then follow the final-norm output in the same tensor, ``[T, H * (1 + len(taps))]``.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import Cache

from . import rows
from .batch_cache import BatchSlabCache, bucket
from .cache import SlabCache
from .cache import for_model as cache_for_model
from .capture import (
    ENGINES,
    CapturedForward,
    EngineStatus,
    capture_unsupported,
    decoder_then_head,
    plain_causal_lm,
)
from .errors import SettingsError, SpecvizError
from .head import refined
from .packing import packed_count, plain_rows_of
from .text import ChatText
from .transfer import to_device
from .tree import DraftTree


class TargetError(SpecvizError):
    """The target cannot do what was asked (context overflow, unsupported cache...)."""


@functools.cache
def _cache_name(module_type: type) -> str:
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def graph_capacity(capacity: int) -> int:
    """A static cache's capacity: a power of two, 256 at least. A CUDA graph is recorded per capacity, so a few
    sizes serve every decode."""
    return max(256, bucket(capacity))


def cache_kwarg(module: torch.nn.Module, cache) -> dict:
    """``cache`` as the keyword ``module.forward`` takes: transformers 5.24 renamed ``past_key_values``
    to ``cache`` (the old name is dropped in 5.40, where a module taking ``**kwargs`` would ignore it)."""
    return {_cache_name(type(module)): cache}


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's final norm, whose output is the features."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    return None


@dataclass(frozen=True)
class VerifyPadding:
    """Verify n inputs as m > n where this machine's kernels do m rows faster, per shape (a chain keeps plain
    causal attention, a tree takes the 4D-mask path). Measured by the caller (``apps.tuning.machine_costs``,
    ``core.budget.padding``); empty pads nothing."""

    chain: dict[int, int] = field(default_factory=dict)
    tree: dict[int, int] = field(default_factory=dict)

    def size(self, n: int, chain: bool) -> int:
        return (self.chain if chain else self.tree).get(n, n)

    def as_dict(self) -> dict[str, dict[int, int]]:
        return {"chain": dict(self.chain), "tree": dict(self.tree)}


class TargetModel:
    """Wraps a causal LM for one sequence at a time, or rows of several (``forward_rows``, used by ``core.batch``);
    each decode brings its own cache.

    ``model`` runs as it is: prepare it first (``core.load.prepare``) for an fp32 head or packed kernels.
    ``tokenizer`` builds ``text``, the chat/EOS helper (``core.text.ChatText``)."""

    def __init__(self, model, tokenizer=None, name: str = "target"):
        self.model = model.eval()
        self.text = ChatText.for_model(model, tokenizer)
        self.name = name
        self.config = model.config
        self.taps: tuple[int, ...] = ()  # decoder layers whose inputs follow the features
        self._embeddings = model.get_input_embeddings()
        self.body_dtype = self._embeddings.weight.dtype  # the head may be fp32 (``prepare``)
        self.packed_linears = packed_count(model)
        self._norm = final_norm(model)
        # decoder then head: features without a hook (a hook on a shared module would see every thread's forwards)
        self._plain = decoder_then_head(model) if plain_causal_lm(model) else None
        self.captured: CapturedForward | None = None  # use_engine
        self._engine_note = ""

    # -- properties -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the input embeddings are, read each time (a model may be moved after it is wrapped); not
        ``next(model.parameters())``, which walks the module tree: tens of microseconds, several times a step."""
        return self._embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The body's dtype (the one drafters run in); the final norm and head may be fp32."""
        return self.body_dtype

    @property
    def plain_rows(self) -> int:
        """Calls of up to this many rows run on the plain kernel, not the packed ones (``core.kernels``)."""
        return plain_rows_of(self.model) if self.packed_linears else 0

    @property
    def kernels(self) -> str:
        """Which linear kernels the target runs on (speed depends on it)."""
        if not self.packed_linears:
            return "default"
        plain = f"; {rows.plain_name()} up to {self.plain_rows} rows" if self.plain_rows else ""
        head = "; bf16 head, exact in fp32 at the top" if refined(self.model) else ""
        return f"oneDNN packed ({self.packed_linears} layers{plain}{head})"

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def tap(self, layers) -> list[int]:
        """From now on, return the inputs of decoder ``layers`` after the features. Returns the column
        block of each (block 0 is the final-norm output), so several drafters can share one target."""
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(f"layer {bad[0]} does not exist: this target has {self.num_layers} decoder layers")
        added = tuple(i for i in dict.fromkeys(layers) if i not in self.taps)
        self.taps += added
        if added and self._plain is not None:
            self._plain = decoder_then_head(self.model, taps=self.taps)
        if added and self.captured is not None:
            # compiled before: that graph returns none of the new layers' inputs, and a target with taps would decode
            # every method eagerly; compile again with them (on a thread if the first one was)
            old = self.captured
            self.use_engine("compiled", background=old.started, layout=old.layout)
            if old.batches is not None:  # and the batch graphs the old one had (noted until the new one is ready)
                self.captured.warm_batches(self, *old.batches)
        return [1 + self.taps.index(i) for i in layers]

    # -- forward passes ---------------------------------------------------------------------
    def new_cache(self, capacity: int = 256, static: bool | None = None) -> Cache:
        """An empty KV cache for one decode, sized for ``capacity`` tokens (it grows past them if it must): a
        ``core.cache.SlabCache`` where every layer is full attention, else transformers' ``DynamicCache``.
        ``static`` (None: where this target's forwards replay as CUDA graphs): buffers at fixed addresses. Every
        layer's buffers are slices of one store (``SlabCache(shared=True)``) where the model is on one device."""
        if static is None:
            static = self.captured is not None and self.captured.graphs
        if static:
            capacity = graph_capacity(capacity)
        return cache_for_model(self.config, capacity, static, shared=self.one_device)

    def new_batch_cache(self, batch: int, capacity: int) -> BatchSlabCache:
        """An empty KV cache for ``batch`` sequences of up to ``capacity`` tokens each (``core.batch``). Where this
        target's forwards replay as CUDA graphs, its buffers are fixed addresses from the pool, of ``bucket`` rows
        and a power-of-two capacity: decodes of similar sizes then take the same buffers and replay the same graphs."""
        static = self.captured is not None and self.captured.graphs
        if self.captured is not None and self.captured.layout == "buffer":  # its forwards pad rows to a bucket
            batch = bucket(batch)
        if static:
            capacity = graph_capacity(capacity)
        return BatchSlabCache(self.num_layers, batch, capacity, static, shared=self.one_device)

    @property
    def one_device(self) -> bool:
        """Whether the model sits on one device, so its caches keep every layer in one store (split across devices,
        each device's layers would hold a slice of the store on the first)."""
        return len(set(getattr(self.model, "hf_device_map", {}).values())) <= 1

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache,
                 keep: int = 0):
        logits, feats = self.forward_rows(ids[None], positions, mask, cache, keep)
        return logits[0], feats[0]

    # -- the engine: eager, or captured forwards (core.capture) -------------------------------
    def use_engine(self, engine: str = "auto", background: bool = False, then=None,
                   layout: str | None = None) -> EngineStatus:
        """Run verify forwards ``engine``: "eager" (the model as it is), "compiled" (``core.capture``; this call
        compiles, or starts compiling on a thread with ``background``, serving eager until ready) or "auto"
        (compiled where this torch can compile, else eager with the reason). ``then()`` runs once the background
        compilation has ended, well or not. ``layout``: what a compiled forward's attention reads (``core.capture``)."""
        if engine not in ENGINES:
            raise SettingsError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.captured = None
        if engine == "eager":
            return self.engine
        reason = capture_unsupported(self.device)
        if reason:
            if engine == "compiled":
                raise SettingsError(f"the compiled engine cannot run here: {reason}")
            self._engine_note = reason
            return self.engine
        self.captured = CapturedForward(self.model, self._plain, layout, taps=self.taps)
        if background:
            self.captured.start(self, then)
        elif not self.captured.warm(self) and engine == "compiled":
            raise SettingsError(f"the compiled engine failed: {self.captured.error}")
        return self.engine

    @property
    def engine(self) -> EngineStatus:
        """The path verify forwards take now, and why."""
        if self.captured is None:
            return EngineStatus("eager", self._engine_note)
        return self.captured.status

    def warm_batches(self, rows: int = 2, capacity: int = 16) -> None:
        """Compile the graphs a batch decode meets now, where batches take the compiled path (``core.capture``), so
        a timed run compiles nothing; under CUDA graphs, also record those a batch of up to ``rows`` sequences of
        ``capacity`` tokens meets (``CapturedForward.warm_batches``)."""
        if self.captured is not None:
            self.captured.warm_batches(self, rows, capacity)

    def eager_view(self) -> "TargetModel":
        """This target on the eager path (the same model and weights): a baseline in the same process."""
        view = copy.copy(self)
        view.captured, view._engine_note = None, "baseline"
        return view

    def _captured_for(self, ids: torch.Tensor, cache: Cache, captured: CapturedForward | None):
        """The compiled forward to use for this call, or None: one sequence on a ``SlabCache``, or a batch on a
        ``BatchSlabCache``, whose buffers exist (a prefill allocates them, and it stays eager; see ``core.capture``)."""
        captured = captured or (self.captured if self.captured is not None and self.captured.ready else None)
        if captured is None or not cache.is_initialized:
            return None
        if not (ids.shape[0] == 1 and isinstance(cache, SlabCache) or isinstance(cache, BatchSlabCache)):
            return None
        if captured.taps != self.taps:  # compiled before a drafter asked for more layers: eager has them
            return None
        return captured

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache,
                     keep: int = 0, captured: CapturedForward | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``ids`` [B, n] at ``positions`` [B, n] after ``cache``, under ``mask`` (4D, additive;
        None: causal). Returns logits [B, n', V] (n' = ``keep`` last positions, 0: all) and features [B, n, H].
        ``captured``: compile and run this forward on it (``CapturedForward.warm``), ready or not."""
        device = self.device
        args = dict(input_ids=to_device(ids, device), position_ids=to_device(positions, device),
                    attention_mask=None if mask is None else to_device(mask, device), use_cache=True)
        run = self._captured_for(ids, cache, captured)
        if run is not None:
            past = cache.get_seq_length()
            try:
                return self._forward_captured(run, args, cache, keep)
            except Exception as e:  # noqa: BLE001 - whatever broke the graph: decode on eagerly, saying why
                if captured is not None:  # warming it: the warm-up keeps the failure
                    raise
                run.fail(e)
                if cache.get_seq_length() > past:
                    cache.crop(past - cache.get_seq_length())
        if self._plain is not None:
            logits, feats, tapped = self._plain(keep=keep, **args, **cache_kwarg(self._plain.decoder, cache))
            return logits, self._features(feats, tapped)
        args.update(cache_kwarg(self.model, cache), logits_to_keep=keep)
        captured_norm: list[torch.Tensor] = []
        hook = None if self._norm is None else self._norm.register_forward_hook(
            lambda _m, _args, output: captured_norm.append(output))
        try:
            out = self.model(**args, output_hidden_states=bool(self.taps) or hook is None)
        finally:
            if hook is not None:
                hook.remove()
        # transformers' last hidden state is normed; hidden_states[i] is the input of layer i (entry 0: the embeddings)
        feats = captured_norm[-1] if hook is not None else out.hidden_states[-1]
        return out.logits, self._features(feats, tuple(out.hidden_states[i] for i in self.taps))

    def _forward_captured(self, run: CapturedForward, args: dict, cache: Cache, keep: int):
        """``forward_rows`` on the compiled forward ``run``; ``args`` on the device. No hook inside a graph: the
        last hidden state is the final norm's output."""
        rows, n = args["input_ids"].shape
        device = args["input_ids"].device
        if isinstance(cache, BatchSlabCache) and run.layout == "buffer":  # padded to buckets, over whole buffers
            with cache.whole(args["input_ids"], args["position_ids"], args["attention_mask"], self.dtype) as padded:
                logits, feats, tapped = run(0, **{**args, **padded}, **cache_kwarg(run.module, cache))
            logits = logits[:rows, :n]
            return (logits[:, -keep:] if keep else logits), self._features(feats, tapped)[:rows, :n]
        if isinstance(cache, BatchSlabCache):  # the live rows, each row's writes planned outside the graph
            with cache.planned(n, device):
                logits, feats, tapped = run(keep, **args, **cache_kwarg(run.module, cache))
            return logits, self._features(feats, tapped)
        if run.layout != "buffer":
            with cache.appending(n):  # the layers' lengths move after the graph, not inside it
                logits, feats, tapped = run(keep, **args, **cache_kwarg(run.module, cache))
            return logits, self._features(feats, tapped)
        with cache.slots(n, args["attention_mask"], self.dtype, device) as mask:  # attention over the whole buffer
            logits, feats, tapped = run(keep, **{**args, "attention_mask": mask}, **cache_kwarg(run.module, cache))
        return logits, self._features(feats, tapped)

    @staticmethod
    def _features(feats: torch.Tensor, tapped: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The final-norm output, then the tapped layers' inputs (``tap``)."""
        return torch.cat([feats] + [t.to(feats.dtype) for t in tapped], dim=-1) if tapped else feats

    def prefill(self, ids: list[int] | torch.Tensor, cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill ``cache`` (emptied first) with ``ids``. Returns the last position's logits [V] and features [L, H]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() == 0:
            raise TargetError("the prompt is empty")
        if ids.numel() >= self.max_length:
            raise TargetError(f"the prompt has {ids.numel()} tokens; this target's context is {self.max_length}")
        if cache.get_seq_length():
            cache.crop(-cache.get_seq_length())
        logits, feats = self._forward(ids, torch.arange(ids.numel())[None], None, cache, keep=1)
        return logits[-1], feats

    def verify(self, root: int, tree: DraftTree, cache: Cache,
               padding: VerifyPadding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over root + tree after ``cache``. Returns logits [N+1, V] and features [N+1, H].

        A size that ``padding`` maps to a larger one is verified with filler nodes that no real node sees
        (they follow it); their outputs are dropped here and their cache entries by ``commit``."""
        past, n = cache.get_seq_length(), len(tree) + 1
        if past + tree.max_depth + 1 > self.max_length:
            raise TargetError(
                f"verifying {tree.max_depth + 1} positions after {past} exceeds the context of {self.max_length}")
        chain = tree.is_chain  # padding keeps a chain a chain and a tree a tree
        size = padding.size(n, chain) if padding is not None else n
        if size > n and past + tree.max_depth + 1 + (size - n) * chain <= self.max_length:
            tree = tree.padded(size - n)
        mask = None if chain else tree.attention_mask(past, self.dtype)  # a chain is plain causal
        logits, feats = self._forward(tree.input_ids(root), tree.positions(past), mask, cache)
        return logits[:n], feats[:n]

    def commit(self, cache: Cache, past: int, keep: list[int]) -> None:
        """Keep only the cache entries of verify-input indices ``keep`` (root first) after ``past``."""
        total = cache.get_seq_length()
        if keep == list(range(len(keep))):  # a prefix of the verify input: plain crop
            drop = total - past - len(keep)
            if drop > 0:
                cache.crop(-drop)
            return
        if isinstance(cache, SlabCache):  # in place: only the accepted rows move
            cache.keep(past, keep)
            return
        index = to_device(torch.cat([torch.arange(past), past + torch.tensor(keep)]), self.device)
        for layer in cache.layers:
            if not hasattr(layer, "keys") or getattr(layer, "sliding_window", None):
                raise TargetError(f"tree commit is not supported for cache layer {type(layer).__name__}")
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
