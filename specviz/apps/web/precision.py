"""The page's precision switch: exact (fp32, the default) or fast (bf16), each a copy of the target with its own
drafters and its own budgets; the copy the server did not start with is loaded the first time it is picked.

A lossless method gives the target's own text only where it computes what AR computes. In bf16 a verify over
many tokens rounds differently from AR's one token at a time, so where the target's top two tokens nearly tie
the two may part: the page would then seem to show that speculative decoding changes the answer. fp32 shows
the defining property; bf16 shows what a fast deployment runs, and the switch says which is which.
"""

from __future__ import annotations

import threading
import time

import torch

from specviz.core.errors import SettingsError
from specviz.core.load import EMBEDDED, fast_dtype, load_target

from . import tuner
from .joint import load_joint
from .state import AppState
from .views import warm_up

EXACT = "float32"


def dtype_name(state: AppState) -> str:
    return str(state.target.dtype).replace("torch.", "")


class Precisions:
    """The server's state and, once picked, its copy in the other precision, sharing the one engine thread."""

    def __init__(self, main: AppState):
        self.main, self.lock = main, threading.Lock()
        self.states: dict[str, AppState] = {dtype_name(main): main}
        started = dtype_name(main)
        self.fast = started if started != EXACT else "bfloat16"
        self.fast_here = fast_dtype(main.target.device) != torch.float32

    def choices(self) -> list[tuple[str, str]]:
        """(what the switch shows, the dtype): exact first."""
        return [("exact (fp32)", EXACT), (f"fast ({'bf16' if self.fast == 'bfloat16' else self.fast})", self.fast)]

    def trade(self) -> str:
        """One line on what the switch trades."""
        speed = ("faster here" if self.fast_here else
                 "this CPU has no bf16 matrix units, so here it is slower than fp32: pick it for the lesson")
        return (f"exact: every lossless method gives the target's own text. fast ({speed}): a lossless method may "
                "part from AR where the target's top two tokens nearly tie; its badge then says so.")

    def state(self, dtype: str | None) -> AppState:
        """The state for ``dtype`` (None: the server's own), loaded and warmed up on first use."""
        dtype = dtype or dtype_name(self.main)
        if dtype not in (EXACT, self.fast):
            raise SettingsError(f"precision must be {EXACT} or {self.fast}, got {str(dtype)[:40]!r}")
        with self.lock:  # two sessions picking it at once load it once
            if dtype not in self.states:
                self.states[dtype] = self._load(dtype)
            return self.states[dtype]

    def _load(self, dtype: str) -> AppState:
        main, start = self.main, time.perf_counter()
        spec = None if main.target.name == EMBEDDED else main.target.name
        model = main.on_engine(load_target, spec, dtype, str(main.target.device))
        state = AppState(model, configured=main.configured, engine=main.engine)
        state.on_engine(state.load_drafters)
        if main.joint:  # the jointly trained target too, in the same precision as the base one
            state.joint = load_joint(state, main.joint.folder)
        state.on_engine(warm_up, state)
        state.cold_start_s = time.perf_counter() - start
        tuner.log(f"specviz: loaded the target in {dtype} for the precision switch in {state.cold_start_s:.1f} s")
        if main.tuning.mode != "off":  # its budgets are its own: a bf16 forward costs what it costs
            tuner.start(state)
        return state

    def line(self) -> str:
        """The tuning status, with the other precision's once it is loaded."""
        lines = [self.main.tuning.line()]
        lines += [f"{dtype}: {state.tuning.line()}" for dtype, state in self.states.items() if state is not self.main]
        return "  \n".join(lines)

    @property
    def finished(self) -> bool:
        return all(state.tuning.finished for state in self.states.values())
