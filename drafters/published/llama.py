"""What the EAGLE-family layouts share: one Llama decoder layer's weights, its shape, and the target's facts.

specviz's feature drafters build their decoder layer from transformers' own modules
(``drafters.eagle2.layer_config``), so a published layer maps onto them name for name; only the
prefixes and the norms around the attention differ between layouts.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from ..checkpoint import CheckpointError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def layer_weights(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The attention and MLP weights under ``prefix`` (``layers.0.`` or ``midlayer.``) as specviz names them."""
    out = {}
    for name in ATTENTION:
        for kind in ("weight", "bias"):
            if (key := f"{prefix}self_attn.{name}.{kind}") in state:
                out[f"attn.{name}.{kind}"] = state[key]
    for name in MLP:
        for kind in ("weight", "bias"):
            if (key := f"{prefix}mlp.{name}.{kind}") in state:
                out[f"mlp.{name}.{kind}"] = state[key]
    out["post_norm.weight"] = need(state, f"{prefix}post_attention_layernorm.weight")
    return out


def published_layer(native: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of ``layer_weights``: specviz's attention, MLP and post-attention norm under ``prefix``."""
    out = {f"{prefix}self_attn.{k[len('attn.'):]}": v for k, v in native.items() if k.startswith("attn.")}
    out |= {f"{prefix}mlp.{k[len('mlp.'):]}": v for k, v in native.items() if k.startswith("mlp.")}
    out[f"{prefix}post_attention_layernorm.weight"] = native["post_norm.weight"]
    return out


def need(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise CheckpointError(f"the checkpoint has no {key!r} (keys: {sorted(state)[:6]} ...)")
    return state[key]


def layer_shape(config: dict, state: dict[str, torch.Tensor], prefix: str) -> dict:
    """The decoder layer's shape as ``layer_config`` takes it: read from the config, widths from the weights."""
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k in LlamaConfig().to_dict() or k.startswith("rope")})
    shape = {"intermediate_size": int(need(state, f"{prefix}mlp.gate_proj.weight").shape[0]),
             "num_attention_heads": int(cfg.num_attention_heads),
             "num_key_value_heads": int(cfg.num_key_value_heads or cfg.num_attention_heads),
             "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
             "rms_norm_eps": float(cfg.rms_norm_eps), "rope_parameters": dict(cfg.rope_parameters),
             "max_position_embeddings": int(cfg.max_position_embeddings)}
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            shape[flag] = True
    return shape


def layer_config_dict(target, shape: dict, **extra) -> dict:
    """A one-layer Llama config for an exported drafter: the target's widths, the drafter's shape."""
    c = target.config
    cfg = LlamaConfig(hidden_size=c.hidden_size, vocab_size=target.vocab_size, num_hidden_layers=1,
                      intermediate_size=shape.get("intermediate_size", c.intermediate_size),
                      num_attention_heads=shape.get("num_attention_heads", c.num_attention_heads),
                      num_key_value_heads=shape.get("num_key_value_heads", c.num_key_value_heads),
                      head_dim=shape.get("head_dim", getattr(c, "head_dim", None)),
                      rms_norm_eps=shape.get("rms_norm_eps", c.rms_norm_eps),
                      max_position_embeddings=shape.get("max_position_embeddings", c.max_position_embeddings),
                      rope_parameters=shape.get("rope_parameters", c.rope_parameters),
                      tie_word_embeddings=False, bos_token_id=getattr(c, "bos_token_id", None),
                      eos_token_id=getattr(c, "eos_token_id", None), pad_token_id=getattr(c, "pad_token_id", None))
    out = cfg.to_dict()
    rope = out.get("rope_parameters") or {}
    out["rope_theta"] = rope.get("rope_theta", 10000.0)  # older loaders read the flat field
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {k: v for k, v in out.items() if not k.startswith("_")} | extra


def target_facts(config: dict, hidden: int, vocab: int) -> dict:
    """What the checkpoint says of the target it was trained for (checked as a native card's ``target``)."""
    name = config.get("base_model_name_or_path") or config.get("_name_or_path") or "its target"
    return {"name": str(name), "hidden_size": int(hidden), "vocab_size": int(vocab)}


def check_taps(taps: list[int], target, source) -> list[int]:
    """The tapped layer inputs, each inside this target (a checkpoint for a deeper target is named plainly)."""
    taps = [int(t) for t in taps]
    if any(t < 0 or t >= target.num_layers for t in taps):
        raise CheckpointError(f"{source} reads the inputs of layers {taps}; this target ({target.name}) has "
                              f"{target.num_layers} decoder layers: it was made for another target")
    return taps


def target_head(target) -> torch.Tensor:
    return target.model.get_output_embeddings().weight.detach().float().cpu()


def target_embedding(target) -> torch.Tensor:
    return target.model.get_input_embeddings().weight.detach().float().cpu()
