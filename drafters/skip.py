"""Skip-layer self-drafting (LayerSkip-style): the target's first N layers + final norm + LM head."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Settings

from .chain_lm import ChainLMDrafter


@dataclass
class SkipSettings(Settings):
    layers: int = 6  # first N target layers used as the draft model
    num_tokens: int = 4
    ranges = {"layers": (1, 1024), "num_tokens": (1, 32)}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("num_tokens")]

    @classmethod
    def limits(cls, target) -> dict[str, tuple]:
        """At most all but one of the target's layers."""
        return {**cls.ranges, "layers": (1, max(1, target.config.num_hidden_layers - 1))}


def truncated_view(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A model object sharing the target's modules but running only its first ``layers`` layers."""
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= layers < total:
        raise SettingsError(f"skip layers must be in [1, {total - 1}] for this {total}-layer target, got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    short = copy.copy(decoder)
    short._modules = dict(decoder._modules)
    short.layers = torch.nn.ModuleList(decoder.layers[:layers])
    short.config = config
    view = copy.copy(model)
    view._modules = {k: (short if m is decoder else m) for k, m in model._modules.items()}
    view.config = config
    return view


class SkipLayerDrafter(ChainLMDrafter):
    name = "skip"
    title = "Skip-layer self-draft (target's first N layers)"

    def __init__(self, target, settings: SkipSettings | None = None):
        self.settings = settings or SkipSettings()
        super().__init__(truncated_view(target.model, self.settings.layers), self.settings.num_tokens,
                         target.vocab_size)

    def num_parameters(self) -> int:
        return 0  # every weight is the target's own
