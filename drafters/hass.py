"""HASS: EAGLE-2's network trained with harmonized objective distillation and context alignment.

Training differs, decoding does not: ``passes`` aligned passes in which the drafter reads its own
earlier features where a decoder drafting that deep would, and a Top-K distillation loss on the
target's distribution (Zhang et al., 2024). As in the reference recipe (40 epochs of aligned passes,
then 10 with the Top-K term), the Top-K term joins for the last fifth of the training.
"""

from __future__ import annotations

from .eagle2 import Eagle2Drafter
from .training.losses import LossOptions


class HassDrafter(Eagle2Drafter):
    name = "hass"
    title = "HASS: EAGLE-2 network + Top-K distillation + harmonized context alignment"
    loss = LossOptions(passes=3, topk=10, topk_weight=1.0, topk_after=0.8)
