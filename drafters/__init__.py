"""Drafters (floor 2): one file per method behind ``specviz.core.protocol``, plus the training pipeline."""

from __future__ import annotations

from specviz.core.errors import SettingsError
from specviz.core.protocol import Drafter, Settings

from .ar import AutoregressiveDrafter
from .eagle2 import Eagle2Drafter, TreeSettings
from .eagle3 import Eagle3Drafter
from .fspad import FspadDrafter
from .hass import HassDrafter
from .lookahead import LookaheadDrafter, LookaheadSettings
from .medusa import MedusaDrafter, MedusaSettings
from .pld import PromptLookupDrafter, PromptLookupSettings
from .redrafter import RedrafterDrafter, RedrafterSettings
from .semi_ar import SemiAttnDrafter, SemiLstmDrafter, SemiSettings
from .skip import SkipLayerDrafter, SkipSettings
from .sps import AssistantDrafter, AssistantSettings

# name -> (class, settings class); every class is built as cls(target, settings)
METHODS: dict[str, tuple[type[Drafter], type[Settings]]] = {
    "ar": (AutoregressiveDrafter, Settings),
    "pld": (PromptLookupDrafter, PromptLookupSettings),
    "lookahead": (LookaheadDrafter, LookaheadSettings),
    "skip": (SkipLayerDrafter, SkipSettings),
    "sps": (AssistantDrafter, AssistantSettings),
    "eagle2": (Eagle2Drafter, TreeSettings),
    "hass": (HassDrafter, TreeSettings),
    "fspad": (FspadDrafter, TreeSettings),
    "eagle3": (Eagle3Drafter, TreeSettings),
    "medusa": (MedusaDrafter, MedusaSettings),
    "redrafter": (RedrafterDrafter, RedrafterSettings),
    "semi-attn": (SemiAttnDrafter, SemiSettings),
    "semi-lstm": (SemiLstmDrafter, SemiSettings),
}


def _check_name(name: str, extra=()) -> None:
    if name not in METHODS and name not in extra:
        raise SettingsError(f"unknown method {name!r}; choose from {', '.join([*METHODS, *extra])}")


def build_drafter(name: str, target, **settings) -> Drafter:
    """Construct method ``name`` for ``target``: the target's defaults, then ``settings``, validated."""
    _check_name(name)
    cls, settings_cls = METHODS[name]
    return cls(target, settings_cls.build(**{**settings_cls.defaults(target), **settings}))


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str, extra=()) -> tuple[str, dict]:
    """'skip:layers=12:num_tokens=3' -> ('skip', {'layers': 12, 'num_tokens': 3}); ``extra`` names more methods."""
    name, *pairs = spec.strip().split(":")
    settings = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise SettingsError(f"bad setting {pair!r} in {spec!r}; write name:key=value:key=value")
        settings[key] = _value(val)
    _check_name(name, extra)
    return name, settings


__all__ = ["METHODS", "build_drafter", "parse_spec"]
