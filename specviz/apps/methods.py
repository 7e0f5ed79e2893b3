"""Method specs as the CLI and the bench take them: any drafter with its settings, or one of transformers' own
``generate`` baselines (``hf`` plain, ``hf-pld`` with its prompt lookup), which run outside the engine."""

from __future__ import annotations

from drafters import parse_spec

HF_BASELINES = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": 10}}


def parse_method(spec: str) -> tuple[str, dict]:
    """``"eagle2:depth=4"`` -> ``("eagle2", {"depth": 4})``; a SettingsError names what is wrong."""
    return parse_spec(spec, extra=HF_BASELINES)


def is_baseline(name: str) -> bool:
    """True for transformers' own generate: no drafter, no budget, no step records."""
    return name in HF_BASELINES
