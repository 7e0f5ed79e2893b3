"""specviz: one speculative-decoding engine behind an interactive comparison app.

Three floors, imports only downward: ``specviz.core`` (the engine), ``drafters`` (the methods and their
training), ``specviz.apps`` (CLI, benchmarks, the race, the web app).
"""

from .core.engine import RunResult, StepRecord, generate, run
from .core.errors import SettingsError, SpecvizError
from .core.timing import Timings
from .core.tree import DraftTree
from .core.verify import Sampling

__all__ = ["DraftTree", "RunResult", "Sampling", "SettingsError", "SpecvizError", "StepRecord", "Timings",
           "generate", "run"]
