"""Drafters (floor 2): one file per method behind ``specviz.core.protocol``, plus the training pipeline."""

from __future__ import annotations

from specviz.core.errors import SettingsError
from specviz.core.files import missing_folder
from specviz.core.protocol import Drafter, Settings

from .ar import AutoregressiveDrafter
from .captured import capture_drafters
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
    drafter = cls(target, settings_cls.build(**{**settings_cls.defaults(target), **settings}))
    if capture_drafters(target):
        drafter.capture_forwards(target)
    return drafter


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


def checkpoint_sources(pairs) -> dict[str, str]:
    """``["eagle3=DIR_OR_HUB_ID", ...]`` (the ``--drafter`` option) -> ``{"eagle3": "DIR_OR_HUB_ID"}``: the checkpoint
    each named trained method loads, specviz's own or a published one (``drafters.published``)."""
    sources = {}
    for pair in pairs or ():
        name, sep, source = str(pair).partition("=")
        name, source = name.strip(), source.strip()
        if not sep or not name or not source:
            raise SettingsError(f"bad --drafter {pair!r}: write METHOD=FOLDER_OR_HUB_ID, e.g. eagle3=./my-eagle3")
        _check_name(name)
        if not getattr(METHODS[name][0], "trained", False):
            trained = [m for m, (cls, _) in METHODS.items() if getattr(cls, "trained", False)]
            raise SettingsError(f"--drafter {pair!r}: {name} loads no checkpoint; trained methods: "
                                f"{', '.join(trained)}")
        if missing_folder(source):
            raise SettingsError(f"--drafter {pair!r}: no such folder")  # said before the target loads
        sources[name] = source
    return sources


def with_checkpoints(specs: list[str], sources: dict[str, str]) -> list[str]:
    """Method specs with ``checkpoint=`` added for the methods ``sources`` names (a spec's own wins)."""
    out = []
    for spec in specs:
        name, *pairs = spec.strip().split(":")
        own = any(pair.startswith("checkpoint=") for pair in pairs)
        out.append(spec if name not in sources or own else f"{spec.strip()}:checkpoint={sources[name]}")
    return out


__all__ = ["METHODS", "build_drafter", "checkpoint_sources", "parse_spec", "with_checkpoints"]
