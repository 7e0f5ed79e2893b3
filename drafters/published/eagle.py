"""EAGLE-1/2 and HASS checkpoints (EAGLE's ``cnets.py``): one Llama layer behind ``fc``, the target's head.

The layout, as EAGLE's ``Model`` writes it:

- ``config.json``: a Llama config with one layer and the target's widths, plus ``bias`` (``fc`` has one);
- ``fc.weight`` [H, 2H] over ``cat(embedding, feature)``, ``fc.bias`` when ``bias``;
- ``layers.0.self_attn.*``, ``layers.0.mlp.*``, ``layers.0.post_attention_layernorm.weight``; layer 0 has
  no input norm (``fc``'s output goes straight into the attention);
- ``embed_tokens.weight``: a copy of the target's, which specviz reads from the target instead;
- no LM head and no norm after the layer: the target's head reads the layer's output.

specviz's ``FeatureNet`` is the same network with ``fc``'s halves the other way round
(``cat(feature, embedding)``), so reading swaps them. The feature is the target's final-norm output in
both. EAGLE's layout has no draft vocabulary: a drafter read from it drafts over the whole vocabulary,
and one specviz trained on a reduced vocabulary is served over the whole one too (``export`` says so).
"""

from __future__ import annotations

import torch

from ..checkpoint import CheckpointError
from .llama import layer_config_dict, layer_shape, layer_weights, need, published_layer, target_embedding, target_facts


class Eagle:
    """EAGLE-1/2's layout, which HASS keeps."""

    NAME, METHODS, WEIGHTS = "eagle", ("eagle2", "hass"), "model.safetensors"
    TITLE = "EAGLE-1/2 or HASS (EAGLE's layout)"

    @staticmethod
    def matches(config: dict, keys: set[str]) -> bool:
        return "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) and "lm_head.weight" not in keys

    @staticmethod
    def read(config: dict, state: dict[str, torch.Tensor], target, source) -> tuple[dict, dict]:
        if int(config.get("num_hidden_layers", 1)) != 1 or "layers.1.mlp.gate_proj.weight" in state:
            raise CheckpointError(f"{source} has {config.get('num_hidden_layers')} decoder layers; specviz runs "
                                  "EAGLE drafters of one layer")
        if "layers.0.input_layernorm.weight" in state:
            raise CheckpointError(f"{source} has an input norm in layer 0, which EAGLE's layout does not: "
                                  "it is not an EAGLE-1/2 checkpoint")
        fc = need(state, "fc.weight")
        hidden = fc.shape[0]
        if fc.shape != (hidden, 2 * hidden):
            raise CheckpointError(f"{source}: fc.weight has shape {tuple(fc.shape)}, not (H, 2H) as EAGLE's")
        native = {"fuse.weight": torch.cat([fc[:, hidden:], fc[:, :hidden]], dim=1),
                  "fuse.bias": state.get("fc.bias", torch.zeros(hidden)), **layer_weights(state, "layers.0.")}
        vocab = int(config.get("vocab_size") or state.get("embed_tokens.weight", torch.empty(0)).shape[0])
        native["vocab_map"] = torch.arange(vocab)
        card = {"target": target_facts(config, hidden, vocab), "network": layer_shape(config, state, "layers.0."),
                "features": {"final_norm_output": True, "tapped_layer_inputs": []}}
        return native, card

    @staticmethod
    def write(native: dict[str, torch.Tensor], card: dict, target, base: str, server: str) -> tuple[dict, dict, list]:
        hidden = target.config.hidden_size
        fuse = native["fuse.weight"]
        tensors = {"fc.weight": torch.cat([fuse[:, hidden:], fuse[:, :hidden]], dim=1),
                   "fc.bias": native["fuse.bias"], **published_layer(native, "layers.0."),
                   "embed_tokens.weight": target_embedding(target)}
        # vLLM names the class itself (LlamaForCausalLM -> EagleLlamaForCausalLM); SGLang looks the name up as written.
        # No ``bias`` key: both servers read it as the attention's bias, which EAGLE's layer does not have.
        arch = "LlamaForCausalLMEagle" if server == "sglang" else "LlamaForCausalLM"
        config = layer_config_dict(target, card.get("network") or {}, architectures=[arch])
        notes = []
        if server == "vllm" and float(native["fuse.bias"].abs().max()) > 0:
            notes.append("vLLM's EAGLE has no bias on fc and drops fc.bias when it loads (SGLang keeps it): served "
                         f"by vLLM, this drafter runs without its bias (largest entry "
                         f"{float(native['fuse.bias'].abs().max()):.3g}), so it drafts a little differently")
        drafted = int(native["vocab_map"].numel())
        if drafted != target.vocab_size:
            notes.append(f"EAGLE's layout has no draft vocabulary: served from it, this drafter drafts over all "
                         f"{target.vocab_size} tokens with the target's head (it was trained on {drafted})")
        return config, tensors, notes
