"""Method specs as the CLI and the bench take them: any drafter with its settings, or one of transformers' own
``generate`` baselines (``hf`` plain, ``hf-pld`` with its prompt lookup), which run outside the engine."""

from __future__ import annotations

import re

from drafters import parse_spec
from specviz.core.errors import SettingsError

HF_BASELINES = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}


def parse_method(spec: str) -> tuple[str, dict]:
    """``"eagle2:depth=4"`` -> ``("eagle2", {"depth": 4})``; a SettingsError names what is wrong."""
    return parse_spec(spec, extra=HF_BASELINES)


def split_engine(label: str) -> tuple[str, str | None]:
    """``"ar:engine=eager"`` -> ``("ar", "eager")``: the method on the target's eager path (``TargetModel.eager_view``),
    a baseline in the same run as the compiled path; ``engine=compiled`` is the path the target is on."""
    parts = label.strip().split(":")
    engines = [p.split("=", 1)[1] for p in parts[1:] if p.startswith("engine=")]
    if not engines:
        return label.strip(), None
    if len(engines) > 1 or engines[0] not in ("eager", "compiled"):
        raise SettingsError(f"{label}: engine is given once, as eager or compiled")
    return ":".join(p for p in parts if not p.startswith("engine=")), engines[0]


def is_baseline(name: str) -> bool:
    """True for transformers' own generate: no drafter, no budget, no step records."""
    return name in HF_BASELINES


# A column's label: a method, or a method and a tag in brackets, so that one method can race twice at two settings
LABEL = re.compile(r"([a-z0-9-]+)(?: \(([A-Za-z0-9 _.,=+-]{1,24})\))?")


def split_label(label: str) -> tuple[str, str | None]:
    """``"eagle2 (paper)"`` -> ``("eagle2", "paper")``; a plain method name has no tag. The tag ``paper`` starts
    the column from the paper's setting and ``untuned`` from the settings class's own values; any other tag from
    this machine's budget, like the plain name, with the settings the call gives under the whole label."""
    match = LABEL.fullmatch(label)
    if match is None:
        raise SettingsError(f"{label[:40]!r}: unknown method; a label is a method's name, or a name and a tag of "
                            "up to 24 letters, digits or .,=+-_ in brackets (\"eagle2 (paper)\")")
    return match.group(1), match.group(2)
