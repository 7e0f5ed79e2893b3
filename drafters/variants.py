"""Training variants: a trained method trained another way, under a name, for the papers' ablations.

A variant is a registry entry, not a fork of a method file: the base method's class with other loss options
(the EAGLE family's ``LossOptions``) or other network arguments. Its checkpoint's card says ``"method"``: the
base, ``"variant"``: its name and ``"network"``: its arguments, so the base method decodes it
(``fspad:checkpoint=FOLDER``), and its run folder is keyed apart from the base's (``training.config.run_key``).

Rules: a variant changes training only (decoding is the base's, so each is exact against AR as the base is);
``loss`` names ``LossOptions`` fields and is refused for a method without them; ``network`` names arguments
of the base's network constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from specviz.core.errors import SettingsError

from . import METHODS
from .trained import TrainedDrafter
from .training.losses import LossOptions


@dataclass(frozen=True)
class Variant:
    name: str
    base: str  # the trained method whose decoding it uses
    what: str  # one line: how it differs from the base
    loss: dict = field(default_factory=dict)  # LossOptions fields that differ
    network: dict = field(default_factory=dict)  # network constructor arguments that differ


def _hass(name: str, what: str, **loss) -> Variant:
    return Variant(name, "hass", what, loss=loss)


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    # HASS Table 5 / Fig. 6: the weight of aligned pass j is beta ** (j - 1)
    _hass("hass-beta0.25", "HASS with beta = 0.25 (later passes weigh less)", beta=0.25),
    _hass("hass-beta0.5", "HASS with beta = 0.5", beta=0.5),
    # HASS Table 4: the number of aligned passes (3 is the shipped one; 1 is EAGLE-2's training + Top-K)
    _hass("hass-passes1", "HASS with 1 pass (no context alignment)", passes=1),
    _hass("hass-passes2", "HASS with 2 aligned passes", passes=2),
    _hass("hass-passes4", "HASS with 4 aligned passes", passes=4),
    _hass("hass-passes5", "HASS with 5 aligned passes", passes=5),
    # HASS Fig. 4 / Table 7: the Top-K distillation term's K and weight w
    _hass("hass-topk0", "HASS without the Top-K term (context alignment only)", topk=0, topk_weight=0.0),
    _hass("hass-topk1", "HASS with K = 1", topk=1),
    _hass("hass-topk5", "HASS with K = 5", topk=5),
    _hass("hass-topk20", "HASS with K = 20", topk=20),
    _hass("hass-w0.5", "HASS with Top-K weight w = 0.5", topk_weight=0.5),
    _hass("hass-w2", "HASS with Top-K weight w = 2", topk_weight=2.0),
    # FSPAD Table 3: each component removed (both removed is EAGLE-2: FSPAD's loss is EAGLE's), and the paper's
    # sampler as its text describes it
    Variant("fspad-no-sampler", "fspad", "FSPAD without the feature sampler (PAD only)", network={"sampler": False}),
    Variant("fspad-no-pad", "fspad", "FSPAD without partial alignment (sampler only)", network={"split": False}),
    Variant("fspad-paper-sampler", "fspad", "FSPAD with the sampler replacing the fc connector (the paper's text)",
            network={"sampler": "gate"}),
    # ReDrafter Fig. 4: no RNN (U = W = I, f = identity), and 4 ResNet blocks instead of 2
    Variant("redrafter-no-rnn", "redrafter", "ReDrafter without the RNN: s_i = s_(i-1) + e_i",
            network={"recurrent": False}),
    Variant("redrafter-4blocks", "redrafter", "ReDrafter with 4 ResNet blocks", network={"blocks": 4}),
    # semi-AR Fig. 4: h_q from a 0-layer head (as Hydra's) up to an N-layer transformer
    Variant("semi-hq-last", "semi-attn", "h_q: the last drafted token alone (0 layers)", network={"hq": "last"}),
    Variant("semi-hq-tf1", "semi-attn", "h_q: a 1-layer causal transformer",
            network={"hq": "transformer", "layers": 1}),
    Variant("semi-hq-tf2", "semi-attn", "h_q: a 2-layer causal transformer",
            network={"hq": "transformer", "layers": 2}),
)}

_LOSS_FIELDS = {f.name for f in fields(LossOptions)}


def trained_names() -> list[str]:
    """Every name ``trained_class`` takes: the trained methods, then the variants."""
    return [n for n, (cls, _) in METHODS.items() if getattr(cls, "trained", False)] + list(VARIANTS)


def trained_class(name: str) -> type[TrainedDrafter]:
    """The class that trains ``name``: a trained method's own, or a variant's (its base with its loss and
    network arguments)."""
    if name in METHODS and getattr(METHODS[name][0], "trained", False):
        return METHODS[name][0]
    if name not in VARIANTS:
        raise SettingsError(f"{name!r} is neither a trained method nor a variant; choose from "
                            f"{', '.join(trained_names())}")
    v = VARIANTS[name]
    base = METHODS[v.base][0]
    attrs: dict = {"variant_name": v.name, "network_kwargs": {**base.network_kwargs, **v.network},
                   "title": f"{base.title} [variant {v.name}: {v.what}]"}
    if v.loss:
        wrong = sorted(set(v.loss) - _LOSS_FIELDS)
        if not isinstance(getattr(base, "loss", None), LossOptions) or wrong:
            raise SettingsError(f"variant {v.name}: {v.base} has no loss option {', '.join(wrong) or 'at all'}")
        attrs["loss"] = replace(base.loss, **v.loss)
    return type(f"{base.__name__}[{v.name}]", (base,), attrs)
