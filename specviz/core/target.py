"""The target model: prefill, verify a whole draft tree in one forward, commit the accepted path.

Only transformers' public API is used: a custom 4D additive mask, explicit ``position_ids`` and a
``DynamicCache`` whose layers are trimmed to the accepted path after each verify. The cache belongs
to the decode loop that uses it (``new_cache()``), so several decodes can share one target.

**Features** are the target's final-norm output at each position: the hidden state its LM head
reads, EAGLE's "feature". The engine hands drafters exactly this (``Commit.features``) and the
training pipeline stores exactly this; no drafter applies the norm again. A drafter that reads
more layers (EAGLE-3) asks for them with ``tap``: their inputs then follow the final-norm output in
the same tensor, ``[T, H * (1 + len(taps))]``.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache

from .errors import SpecvizError
from .packing import pack_linears
from .tree import DraftTree


class TargetError(SpecvizError):
    """The target cannot do what was asked (context overflow, unsupported cache...)."""


@functools.cache
def _cache_name(module_type: type) -> str:
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


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


def fp32_head(model: torch.nn.Module) -> bool:
    """Run the final norm and the LM head of a bf16/fp16 model in fp32 (the body keeps its dtype).

    Logits straight out of a bf16 head move in steps of 0.125 at magnitudes 16-32, so exact ties are
    common and a tree verify and a one-token forward break them differently. In fp32 the logits rarely
    tie; what is left are true near-ties of the bf16 body. The head gets its own fp32 copy of a tied
    embedding. Returns False where the model has no recognisable final norm or head."""
    norm, head = final_norm(model), model.get_output_embeddings()
    if norm is None or head is None or not isinstance(head, torch.nn.Linear):
        return False
    norm.float()
    norm.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:]))
    head.weight = torch.nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)
    if head.bias is not None:
        head.bias = torch.nn.Parameter(head.bias.detach().float().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


class TargetModel:
    """Wraps a causal LM for one sequence at a time (batch size 1); each decode brings its own cache.

    A bf16/fp16 model runs its final norm and LM head in fp32 (``fp32_head``). With ``pack``, a CPU model's
    linear layers run on packed oneDNN weights (``core.packing``)."""

    def __init__(self, model, tokenizer=None, name: str = "target", pack: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self._features: torch.Tensor | None = None
        self.taps: tuple[int, ...] = ()  # decoder layers whose inputs follow the features
        # Verify n inputs as m > n where this machine's kernels do m rows faster ({"chain": {n: m}, "tree": ...}):
        # set from the measured verify-cost curves (``apps.tuning.machine_costs``, ``core.budget.padding``).
        self.padding: dict[str, dict[int, int]] = {}
        self.body_dtype = next(model.parameters()).dtype
        if self.body_dtype != torch.float32:
            fp32_head(model)
        self.packed_linears = pack_linears(model) if pack else 0  # after fp32_head: it replaces the head's weight
        norm = final_norm(model)
        self._hooked = norm is not None
        if norm is not None:
            norm.register_forward_hook(self._capture_features)

    # -- properties -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The body's dtype (the one drafters run in); the final norm and head may be fp32."""
        return self.body_dtype

    @property
    def kernels(self) -> str:
        """Which linear kernels the target runs on (speed depends on it)."""
        return f"oneDNN packed ({self.packed_linears} layers)" if self.packed_linears else "default"

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
        self.taps += tuple(i for i in dict.fromkeys(layers) if i not in self.taps)
        return [1 + self.taps.index(i) for i in layers]

    # -- text -------------------------------------------------------------------------------
    def encode_chat(self, prompt: str) -> list[int]:
        """Token ids of a single user turn, through the chat template when the tokenizer has one."""
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer; pass token ids instead of text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (a shell argument, a raw API body)
            raise TargetError("the prompt is not valid UTF-8 text") from None
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(prompt)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else " ".join(map(str, ids))

    @property
    def eos_token_ids(self) -> set[int]:
        config = self.config
        declared = (getattr(self.model.generation_config, "eos_token_id", None), getattr(config, "eos_token_id", None))
        ids = next((i for i in declared if i is not None), None)  # an id of 0 is a real id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    # -- forward passes ---------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        """An empty KV cache for one decode."""
        return DynamicCache(config=self.config)

    def _capture_features(self, _module, _args, output) -> None:
        self._features = output

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache,
                 keep: int = 0):
        self._features = None
        out = self.model(
            input_ids=ids.to(self.device)[None],
            position_ids=positions.to(self.device),
            attention_mask=None if mask is None else mask.to(self.device),
            **cache_kwarg(self.model, cache),
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=bool(self.taps) or not self._hooked,
        )
        feats = self._features if self._hooked else out.hidden_states[-1]  # transformers' last entry is normed
        if self.taps:  # hidden_states[i] is the input of layer i (entry 0: the embeddings)
            feats = torch.cat([feats] + [out.hidden_states[i].to(feats.dtype) for i in self.taps], dim=-1)
        return out.logits[0], feats[0]

    def prefill(self, ids: list[int] | torch.Tensor, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
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

    def verify(self, root: int, tree: DraftTree, cache: DynamicCache,
               pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over root + tree after ``cache``. Returns logits [N+1, V] and features [N+1, H].

        With ``pad``, a size in ``self.padding`` is verified with filler nodes that no real node sees
        (they follow it); their outputs are dropped here and their cache entries by ``commit``."""
        past, n = cache.get_seq_length(), len(tree) + 1
        if past + tree.max_depth + 1 > self.max_length:
            raise TargetError(
                f"verifying {tree.max_depth + 1} positions after {past} exceeds the context of {self.max_length}")
        chain = tree.is_chain  # padding keeps a chain a chain and a tree a tree
        size = self.padding.get("chain" if chain else "tree", {}).get(n, n) if pad else n
        if size > n and past + tree.max_depth + 1 + (size - n) * chain <= self.max_length:
            tree = tree.padded(size - n)
        mask = None if chain else tree.attention_mask(past, self.dtype)  # a chain is plain causal
        logits, feats = self._forward(tree.input_ids(root), tree.positions(past), mask, cache)
        return logits[:n], feats[:n]

    def commit(self, cache: DynamicCache, past: int, keep: list[int]) -> None:
        """Keep only the cache entries of verify-input indices ``keep`` (root first) after ``past``."""
        total = cache.get_seq_length()
        if keep == list(range(len(keep))):  # a prefix of the verify input: plain crop
            drop = total - past - len(keep)
            if drop > 0:
                cache.crop(-drop)
            return
        index = torch.cat([torch.arange(past), past + torch.tensor(keep)]).to(self.device)
        for layer in cache.layers:
            if not hasattr(layer, "keys") or getattr(layer, "sliding_window", None):
                raise TargetError(f"tree commit is not supported for cache layer {type(layer).__name__}")
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
