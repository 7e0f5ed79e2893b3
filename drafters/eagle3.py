"""EAGLE-3: multi-layer feature fusion and training-time test (Li et al., 2025).

Three changes from EAGLE-2, decoding otherwise shared with it (dynamic tree, cache, reranking):

- **Fusion.** The drafter reads the inputs of a low, a middle and a high decoder layer of the target
  (layers 2, L/2 and L-3), concatenated and projected to one hidden state (``fc``: 3H -> H), rather
  than the final-norm output only. The target returns them when asked (``TargetModel.tap``); in
  training they are computed on the fly, so no second feature cache is kept on disk.
- **Training-time test.** Training unrolls the drafter on its own outputs, each pass reading the
  hidden state the previous pass produced, with the attention a decoder drafting that deep would
  have (HASS's aligned passes), and the gradient flows back through the unrolled passes.
  The tokens fed are the data's: a deep draft only matters when every token before it was accepted,
  that is, equal to the target's own, which is what the self-distilled data holds.
- **Tokens only.** The loss is the soft cross-entropy against the target's distribution at every
  pass (weighted 0.8 ** pass); the drafter's hidden state is free to leave the target's feature
  space, so there is no feature regression. A trained norm sits before the frozen LM head.

The draft vocabulary's explicit map, EAGLE-3's ``d2t``, is ``FrozenTarget.vocab_map``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specviz.core.protocol import Commit
from specviz.core.target import cache_kwarg

from .eagle2 import Eagle2Drafter, layer_config
from .training.losses import LossOptions


def fusion_layers(num_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose inputs EAGLE-3 reads: 2, L/2 and L-3 (clamped for very shallow targets)."""
    last = num_layers - 1
    return min(2, last), min(num_layers // 2, last), max(num_layers - 3, 0)


class FusedNet(nn.Module):
    """fc(low, mid, high) -> one decoder layer over [norm(embedding), norm(hidden)] -> (head input, next hidden).

    ``norm_before_residual``: the residual is the normed hidden state rather than the raw one (a variant
    some published EAGLE-3 checkpoints use; the ``speculators`` config names it)."""

    def __init__(self, config: LlamaConfig, taps: int = 3, norm_before_residual: bool = False):
        super().__init__()
        h = config.hidden_size
        self.hidden, self.norm_before_residual = h, norm_before_residual
        self.fc = nn.Linear(taps * h, h, bias=False)
        self.embed_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads embedding and hidden side by side
            proj = getattr(self.attn, name)
            setattr(self.attn, name, nn.Linear(2 * h, proj.out_features, bias=proj.bias is not None))
        self.post_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.out_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def entry(self, features: torch.Tensor) -> torch.Tensor:
        """The first pass's hidden state: the tapped layers (after the final-norm block) fused by ``fc``."""
        return self.fc(features[..., self.hidden:])

    def forward(self, hidden, embeds, positions, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.embed_norm(embeds), normed], dim=-1)
        cos_sin = self.rotary(hidden, positions)
        attended = self.attn(x, position_embeddings=cos_sin, attention_mask=mask, **cache_kwarg(self.attn, cache))[0]
        h = (normed if self.norm_before_residual else hidden) + attended
        h = h + self.mlp(self.post_norm(h))
        return self.out_norm(h), h


class Eagle3Drafter(Eagle2Drafter):
    name = "eagle3"
    title = "EAGLE-3: fused low/mid/high features, training-time test, dynamic draft tree"
    # 5 unrolled passes (the reference code unrolls 7): a step's cost grows faster than the passes (every
    # pass attends to the keys of all the passes before it), so 5 keeps a step affordable on a CPU
    loss = LossOptions(feature_weight=0.0, token_weight=1.0, passes=5, beta=0.8, detach=False)

    def __init__(self, target, settings):
        super().__init__(target, settings)  # loads the checkpoint first: a missing one taps nothing
        taps = self.card.get("features", {}).get("tapped_layer_inputs") or self.tapped_layers(target.num_layers)
        self.columns = target.tap(taps)

    @classmethod
    def new_network(cls, target, taps: int = 3, norm_before_residual: bool = False, **shape) -> FusedNet:
        return FusedNet(layer_config(target.config, **shape), taps, norm_before_residual)

    @classmethod
    def tapped_layers(cls, num_layers: int) -> tuple[int, ...]:
        return fusion_layers(num_layers)

    def features(self, commit: Commit) -> torch.Tensor:
        """The fused hidden state at the committed positions (the target returns the tapped layers)."""
        h = self.hidden_size
        taps = torch.cat([commit.features[:, c * h:(c + 1) * h] for c in self.columns], dim=-1)
        return self.net.fc(taps.to(device=self.device, dtype=self.dtype))
