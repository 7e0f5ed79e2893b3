"""specviz: one speculative-decoding engine behind an interactive comparison app."""

from .engine import RunResult, StepRecord, Timings, generate, run
from .errors import SettingsError, SpecvizError
from .tree import DraftTree
from .verify import Sampling

__all__ = ["DraftTree", "RunResult", "Sampling", "SettingsError", "SpecvizError", "StepRecord", "Timings", "generate", "run"]
