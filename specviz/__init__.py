"""specviz: one speculative-decoding engine behind an interactive comparison app.

Three floors, imports only downward: ``specviz.core`` (the engine), ``drafters`` (the methods and their
training), ``specviz.apps`` (CLI, benchmarks, the race, the web app).

The names below load on first use, so that importing a light module (the app's starting page) does not
import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DraftTree": ".core.tree", "RunResult": ".core.engine", "Sampling": ".core.verify",
    "SettingsError": ".core.errors", "SpecvizError": ".core.errors", "StepRecord": ".core.engine",
    "Timings": ".core.timing", "generate": ".core.engine", "run": ".core.engine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specviz' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
