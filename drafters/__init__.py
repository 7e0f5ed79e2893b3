"""Drafters: one file per method behind the protocol in ``drafters.base``."""

from __future__ import annotations

from specviz.errors import SettingsError

from .ar import AutoregressiveDrafter
from .base import Commit, Drafter, DraftRequest, Settings
from .eagle2 import Eagle2Drafter, TreeSettings
from .fspad import FspadDrafter
from .hass import HassDrafter
from .medusa import MedusaDrafter, MedusaSettings
from .pld import PromptLookupDrafter, PromptLookupSettings
from .redrafter import RedrafterDrafter, RedrafterSettings
from .semi_ar import SemiAttnDrafter, SemiLstmDrafter, SemiSettings
from .skip import SkipLayerDrafter, SkipSettings
from .sps import AssistantDrafter, AssistantSettings

# name -> (class, settings class); every class is built as cls(target, settings)
METHODS = {
    "ar": (AutoregressiveDrafter, Settings),
    "pld": (PromptLookupDrafter, PromptLookupSettings),
    "skip": (SkipLayerDrafter, SkipSettings),
    "sps": (AssistantDrafter, AssistantSettings),
    "eagle2": (Eagle2Drafter, TreeSettings),
    "hass": (HassDrafter, TreeSettings),
    "fspad": (FspadDrafter, TreeSettings),
    "medusa": (MedusaDrafter, MedusaSettings),
    "redrafter": (RedrafterDrafter, RedrafterSettings),
    "semi-attn": (SemiAttnDrafter, SemiSettings),
    "semi-lstm": (SemiLstmDrafter, SemiSettings),
}


def build_drafter(name: str, target, **settings) -> Drafter:
    """Construct method ``name`` for ``target`` with validated settings."""
    if name not in METHODS:
        raise SettingsError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    cls, settings_cls = METHODS[name]
    return cls(target, settings_cls.build(**settings))


__all__ = ["METHODS", "Commit", "DraftRequest", "Drafter", "build_drafter"]
