"""The fair race: several methods decode one prompt step by step, never two at the same moment.

Each step is timed alone, and the method furthest behind in its own measured time advances next,
so at any moment every column shows how far that method would have got running alone (DESIGN §6).
All lanes share the one target model; each keeps its own KV cache, swapped in for its steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from drafters.base import Drafter

from .engine import StepRecord, generate
from .errors import SpecvizError
from .target import TargetModel
from .verify import Sampling


@dataclass
class Lane:
    label: str
    drafter: Drafter
    records: list[StepRecord] = field(default_factory=list)
    clock: float = 0.0  # seconds of this method's own compute so far
    finished: bool = False
    error: str | None = None
    _steps: Iterator[StepRecord] | None = None
    _cache: object = None

    @property
    def output_ids(self) -> list[int]:
        return [t for r in self.records for t in r.tokens]


def race(target: TargetModel, drafters: dict[str, Drafter], prompt_ids: list[int], max_new_tokens: int,
         sampling: Sampling | None = None) -> Iterator[Lane]:
    """Advance the lane with the least measured time, one step at a time; yield it after each step.

    A method that fails is stopped with its error on the lane; the others go on.
    """
    lanes = [Lane(label, d) for label, d in drafters.items()]
    for lane in lanes:
        lane._steps = generate(target, lane.drafter, prompt_ids, max_new_tokens, sampling)
    saved = target.cache
    try:
        while True:
            active = [lane for lane in lanes if not lane.finished]
            if not active:
                return
            lane = min(active, key=lambda x: x.clock)
            if lane._cache is not None:
                target.cache = lane._cache
            start = time.perf_counter()
            try:
                record = next(lane._steps)
            except StopIteration:
                lane.finished = True
                continue
            except SpecvizError as e:
                lane.finished, lane.error = True, str(e)
                yield lane
                continue
            lane.clock += time.perf_counter() - start
            lane._cache = target.cache
            lane.records.append(record)
            lane.finished = record.finished is not None
            yield lane
    finally:
        target.cache = saved
