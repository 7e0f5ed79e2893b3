"""Medusa-1 heads (Medusa's ``medusa_model.py``): K heads, each ResBlocks into its own LM head.

The layout, as ``MedusaModel`` saves ``medusa_head``:

- ``config.json``: ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``;
- ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``: head k is ``nn.Sequential([ResBlock] * L,
  Linear(H, V, bias=False))``, so its keys are ``{k}.{l}.linear.weight`` / ``.bias`` for l < L and
  ``{k}.{L}.weight`` [V, H]. ``[ResBlock] * L`` repeats one block L times (shared weights): a file may
  list it under every index or only under ``{k}.0``; both read as L applications of that block.

Each head reads the target's last (final-normed) hidden state, as specviz's ``MedusaHeads`` does. specviz
trains one ResBlock per head into the target's frozen head over a reduced vocabulary; exported, each head
gets the target's whole head (Medusa's layout has no draft vocabulary). Medusa's own acceptance is
typical acceptance, which is lossy; specviz verifies with the lossless rules unless ``--rule typical``.
"""

from __future__ import annotations

import re

import torch

from ..checkpoint import CheckpointError
from .llama import target_facts, target_head

KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


class Medusa:
    """Medusa-1's ``medusa_lm_head`` layout."""

    NAME, METHODS, WEIGHTS = "medusa", ("medusa",), "medusa_lm_head.safetensors"
    TITLE = "Medusa-1 (Medusa's medusa_lm_head layout)"

    @staticmethod
    def matches(config: dict, keys: set[str]) -> bool:
        return "medusa_num_heads" in config or any(KEY.match(k) for k in keys)

    @staticmethod
    def read(config: dict, state: dict[str, torch.Tensor], target, source) -> tuple[dict, dict]:
        found: dict[tuple[int, int, str], torch.Tensor] = {}
        for key in list(state):
            if m := KEY.match(key):
                found[(int(m[1]), int(m[2]), m[3])] = state[key]
        if not found:
            raise CheckpointError(f"{source} holds no Medusa head weights ({{head}}.{{layer}}.linear.weight)")
        heads = int(config.get("medusa_num_heads") or 1 + max(h for h, _, _ in found))
        layers = int(config.get("medusa_num_layers") or max(layer for _, layer, kind in found if kind == "weight"))
        native = {}
        for h in range(heads):
            out = found.get((h, layers, "weight"))
            if out is None:
                raise CheckpointError(f"{source}: head {h} has no LM head ({h}.{layers}.weight) for "
                                      f"medusa_num_layers={layers}")
            native[f"out.{h}.weight"] = out
            for layer in range(layers):
                for kind in ("weight", "bias"):
                    value = found.get((h, layer, f"linear.{kind}"), found.get((h, 0, f"linear.{kind}")))
                    if value is None:
                        raise CheckpointError(f"{source}: head {h} has no ResBlock {layer} ({h}.{layer}.linear.{kind})")
                    name = f"heads.{h}.linear.{kind}" if layers == 1 else f"heads.{h}.{layer}.linear.{kind}"
                    native[name] = value
        vocab, hidden = native["out.0.weight"].shape
        native["vocab_map"] = torch.arange(vocab)
        card = {"target": target_facts(config, hidden, vocab),
                "network": {"heads": heads, "layers": layers, "vocab": int(vocab)},
                "features": {"final_norm_output": True, "tapped_layer_inputs": []}}
        return native, card

    @staticmethod
    def write(native: dict[str, torch.Tensor], card: dict, target, base: str, server: str) -> tuple[dict, dict, list]:
        shape = card.get("network") or {}
        heads = 1 + max(int(k.split(".")[1]) for k in native if k.startswith("heads."))
        layers = int(shape.get("layers", 1))
        tensors = {}
        for h in range(heads):
            for layer in range(layers):
                ours = f"heads.{h}.linear" if layers == 1 else f"heads.{h}.{layer}.linear"
                tensors |= {f"{h}.{layer}.linear.{kind}": native[f"{ours}.{kind}"] for kind in ("weight", "bias")}
            tensors[f"{h}.{layers}.weight"] = native.get(f"out.{h}.weight", target_head(target))
        # medusa_fc_bias: vLLM drops the ResBlocks' biases without it; no other "num..heads" key (vLLM renames those)
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "medusa_num_heads": heads,
                  "medusa_num_layers": layers, "medusa_fc_bias": True, "base_model_name_or_path": base,
                  "hidden_size": int(target.config.hidden_size), "vocab_size": int(target.vocab_size)}
        notes = ["vLLM serves Medusa up to 0.32.0 (0.33.0 removed it); SGLang has no Medusa"]
        if server == "sglang":
            raise CheckpointError("SGLang has no Medusa drafter: export with --server vllm (vLLM 0.32.0 or older)")
        drafted = int(native["vocab_map"].numel())
        if "out.0.weight" not in native and drafted != target.vocab_size:
            notes.append(f"Medusa's layout has no draft vocabulary: each exported head carries the target's whole "
                         f"head and drafts over all {target.vocab_size} tokens (it was trained on {drafted})")
        return config, tensors, notes
