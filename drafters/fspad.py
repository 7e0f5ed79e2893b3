"""FSPAD: EAGLE-2 with a Feature Sampler and Partial Alignment Distillation (Gui et al., 2024).

The Feature Sampler gates a projection of the fused input with the token embedding; the decoder
MLP outputs two halves, one for the LM head and one regressed to the target feature and fed
back. Loss: 0.1 * token loss + feature loss.
"""

from __future__ import annotations

from .eagle2 import Eagle2Drafter
from .training.losses import LossOptions


class FspadDrafter(Eagle2Drafter):
    name = "fspad"
    title = "FSPAD: feature sampler + partial alignment distillation, dynamic tree"
    variant = {"sampler": True, "split": True}
    loss = LossOptions(feature_weight=1.0, token_weight=0.1)
