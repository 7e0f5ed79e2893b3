"""EAGLE-3 checkpoints in their two published layouts: EAGLE-3's own (also SpecForge's) and ``speculators``.

One network, two files. EAGLE-3's ``cnets.py`` writes:

- ``config.json``: a Llama config (``LlamaForCausalLMEagle3``) with one layer and ``draft_vocab_size``;
- ``fc.weight`` [H, 3H] over the inputs of target layers 2, N/2 and N-3 (the order of their indices);
- ``midlayer.*``: one decoder layer whose attention reads ``cat(input_layernorm(embedding),
  hidden_norm(hidden))`` [2H]; the residual is the un-normed hidden state;
- ``norm.weight``, then ``lm_head.weight`` [V', H] over the draft vocabulary;
- ``d2t`` [V'] (target id = i + d2t[i]) and ``t2d`` [V] (a target id's membership); absent when V' = V.

The ``speculators`` layout (``Eagle3Speculator``) holds the same tensors with ``midlayer.`` renamed
``layers.0.``, and a config of its own: ``speculators_model_type: eagle3``, ``transformer_layer_config``,
``draft_vocab_size``, ``norm_before_residual`` (the residual is the normed hidden state when true),
``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (its verifier and proposal method).

specviz's ``FusedNet`` maps name for name: ``input_layernorm`` is its ``embed_norm``,
``post_attention_layernorm`` its ``post_norm`` and ``norm`` its ``out_norm``; the draft vocabulary is its
``vocab_map`` and ``lm_head`` replaces the target's frozen rows.
"""

from __future__ import annotations

import torch

from ..checkpoint import CheckpointError
from .llama import (
    check_taps,
    layer_config_dict,
    layer_shape,
    layer_weights,
    need,
    published_layer,
    target_embedding,
    target_facts,
    target_head,
)

METHODS = ("eagle3",)
NORMS = {"input_layernorm": "embed_norm", "hidden_norm": "hidden_norm"}
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # speculators' later variants, not EAGLE-3's network


def _read(prefix: str, layer_config: dict, state: dict, target, source, taps, norm_before_residual: bool):
    fc = need(state, "fc.weight")
    hidden = fc.shape[0]
    if fc.shape[1] % hidden or fc.shape[1] // hidden != len(taps):
        raise CheckpointError(f"{source}: fc.weight has shape {tuple(fc.shape)}, not (H, {len(taps)}H) for the "
                              f"{len(taps)} tapped layers {list(taps)}")
    native = {"fc.weight": fc, **layer_weights(state, prefix), "out_norm.weight": need(state, "norm.weight"),
              **{f"{ours}.weight": need(state, f"{prefix}{theirs}.weight") for theirs, ours in NORMS.items()}}
    head = need(state, "lm_head.weight")
    vocab = int(layer_config.get("vocab_size") or target.vocab_size)
    if "d2t" in state:
        d2t = state["d2t"].long()
        vocab_map = torch.arange(d2t.numel()) + d2t
        if "t2d" in state:
            vocab = int(state["t2d"].numel())
            if not bool(state["t2d"].bool()[vocab_map.clamp(0, vocab - 1)].all()):
                raise CheckpointError(f"{source}: d2t and t2d disagree on the draft vocabulary")
    elif head.shape[0] == vocab:
        vocab_map = torch.arange(vocab)
    else:
        raise CheckpointError(f"{source}: a draft vocabulary of {head.shape[0]} tokens without d2t")
    if head.shape[0] != vocab_map.numel():
        raise CheckpointError(f"{source}: lm_head has {head.shape[0]} rows for a draft vocabulary of "
                              f"{vocab_map.numel()}")
    native |= {"vocab_map": vocab_map, "lm_head": head}
    shape = layer_shape(layer_config, state, prefix) | {"taps": len(taps),
                                                        "norm_before_residual": bool(norm_before_residual)}
    card = {"target": target_facts(layer_config, hidden, vocab), "network": shape,
            "features": {"final_norm_output": True, "tapped_layer_inputs": check_taps(taps, target, source)}}
    return native, card


def _tensors(native: dict[str, torch.Tensor], target, prefix: str) -> dict[str, torch.Tensor]:
    vocab_map = native["vocab_map"].long()
    tensors = {"fc.weight": native["fc.weight"], **published_layer(native, prefix),
               **{f"{prefix}{theirs}.weight": native[f"{ours}.weight"] for theirs, ours in NORMS.items()},
               "norm.weight": native["out_norm.weight"],
               "lm_head.weight": native.get("lm_head", target_head(target)[vocab_map]),
               # the target's, as speculators itself saves it: a loader that shares the target's finds them equal
               "embed_tokens.weight": target_embedding(target)}
    if vocab_map.numel() != target.vocab_size:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[vocab_map] = True
        tensors |= {"d2t": vocab_map - torch.arange(vocab_map.numel()), "t2d": t2d}
    return tensors


def default_taps(target) -> tuple[int, ...]:
    """EAGLE-3's layers 2, N/2 and N-3 (imported here: the drafters import this package while loading)."""
    from ..eagle3 import fusion_layers

    return fusion_layers(target.num_layers)


def _taps(card: dict, target) -> list[int]:
    return list(card.get("features", {}).get("tapped_layer_inputs") or default_taps(target))


class Original:
    """EAGLE-3's own layout (``midlayer.*``), as EAGLE-3 and SpecForge publish it."""

    NAME, METHODS, TITLE, WEIGHTS = "eagle3", METHODS, "EAGLE-3 (EAGLE-3's and SpecForge's layout)", "model.safetensors"

    @staticmethod
    def matches(config: dict, keys: set[str]) -> bool:
        return any(k.startswith("midlayer.") for k in keys) and "speculators_model_type" not in config

    @staticmethod
    def read(config: dict, state: dict, target, source) -> tuple[dict, dict]:
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return _read("midlayer.", config, state, target, source, aux or default_taps(target), False)

    @staticmethod
    def write(native: dict, card: dict, target, base: str, server: str) -> tuple[dict, dict, list[str]]:
        shape = card.get("network") or {}
        if shape.get("norm_before_residual"):
            raise CheckpointError("this drafter takes its residual after the hidden norm, which EAGLE-3's own "
                                  "layout cannot say (SGLang has no such option): export it with --format speculators")
        taps = _taps(card, target)
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": int(native["vocab_map"].numel()),
                 "eagle_aux_hidden_state_layer_ids": taps}  # vLLM reads them here, as layer inputs
        if server == "sglang" and tuple(taps) != default_taps(target):
            # SGLang reads them nested, as layer outputs: the input of layer L is the output of layer L-1
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps]}
        return layer_config_dict(target, shape, **extra), _tensors(native, target, "midlayer."), []


class Speculators:
    """The ``speculators`` package's ``Eagle3Speculator`` layout (``layers.0.*``), which vLLM reads directly."""

    NAME, METHODS, TITLE, WEIGHTS = "speculators", METHODS, "EAGLE-3 (the speculators layout)", "model.safetensors"

    @staticmethod
    def matches(config: dict, keys: set[str]) -> bool:
        return "speculators_model_type" in config

    @staticmethod
    def read(config: dict, state: dict, target, source) -> tuple[dict, dict]:
        kind = config.get("speculators_model_type")
        if kind != "eagle3":
            raise CheckpointError(f"{source} is a speculators {kind!r} model; specviz reads speculators' eagle3")
        if used := [flag for flag in UNSUPPORTED if config.get(flag)]:
            raise CheckpointError(f"{source} sets {', '.join(used)}: a later variant of EAGLE-3's network that "
                                  "specviz does not run")
        layer = dict(config.get("transformer_layer_config") or {})
        if layer.get("model_type", "llama") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
            raise CheckpointError(f"{source}: specviz runs a one-layer Llama EAGLE-3 drafter, not "
                                  f"{layer.get('num_hidden_layers', 1)} {layer.get('model_type')} layers")
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        layer.setdefault("base_model_name_or_path", verifier)
        aux = config.get("eagle_aux_hidden_state_layer_ids") or default_taps(target)
        return _read("layers.0.", layer, state, target, source, aux, config.get("norm_before_residual", False))

    @staticmethod
    def write(native: dict, card: dict, target, base: str, server: str) -> tuple[dict, dict, list[str]]:
        if server == "sglang":
            raise CheckpointError("SGLang does not read the speculators layout: export with --format eagle3")
        shape = card.get("network") or {}
        layer = layer_config_dict(target, shape, architectures=["LlamaForCausalLM"])
        config = {  # the fields speculators 0.9.0 writes; vLLM reads norm_before_residual as true when it is absent
            "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": int(native["vocab_map"].numel()),
            "norm_before_residual": bool(shape.get("norm_before_residual", False)), "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "target_hidden_size": None,
            "tie_word_embeddings": False, "eagle_aux_hidden_state_layer_ids": _taps(card, target),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": base,
                             "architectures": list(getattr(target.config, "architectures", None) or [])}},
        }
        return config, _tensors(native, target, "layers.0."), []
