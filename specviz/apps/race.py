"""The fair race: several methods decode one prompt step by step, never two at the same moment.

Each step is timed alone, and the method furthest behind in its own measured time advances next,
so at any moment every column shows how far that method would have got running alone. All lanes
share the one target model; each decode keeps its own KV cache and drafter state, so no lane sees
another's, and several races may share drafter objects. Every step carries what the app shows
(``engine.DISPLAY``: the target's probabilities for hovers, the margins for near-tie badges).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from specviz.core.engine import DISPLAY, StepRecord, generate, output_ids
from specviz.core.errors import SpecvizError
from specviz.core.protocol import Drafter
from specviz.core.target import TargetModel, VerifyPadding
from specviz.core.verify import Sampling


@dataclass
class Lane:
    label: str
    drafter: Drafter
    records: list[StepRecord] = field(default_factory=list)
    clock: float = 0.0  # seconds of this method's own compute so far
    finished: bool = False
    error: str | None = None
    _steps: Iterator[StepRecord] | None = None

    @property
    def output_ids(self) -> list[int]:
        return output_ids(self.records)


def race(target: TargetModel, drafters: dict[str, Drafter], prompt_ids: list[int], max_new_tokens: int,
         sampling: Sampling | None = None, padding: VerifyPadding | None = None,
         targets: dict[str, TargetModel] | None = None) -> Iterator[Lane]:
    """Advance the lane with the least measured time, one step at a time; yield it after each step.

    A method that fails, with any exception, is stopped with its error on the lane; the others go on.
    ``padding``: the verify sizes this machine pads (``tuning.machine_costs``). ``targets``: the lanes that
    decode on another target of the same tokenizer and shape (a jointly trained one), by label.
    """
    lanes = [Lane(label, d) for label, d in drafters.items()]
    for lane in lanes:
        lane._steps = generate((targets or {}).get(lane.label, target), lane.drafter, prompt_ids, max_new_tokens,
                               sampling, observers=DISPLAY, padding=padding)
    while active := [lane for lane in lanes if not lane.finished]:
        lane = min(active, key=lambda x: x.clock)
        start = time.perf_counter()
        try:
            record = next(lane._steps)
        except StopIteration:
            lane.finished = True
            continue
        except Exception as e:  # noqa: BLE001 - one method's failure, whatever it is, ends only its own lane
            lane.finished = True
            lane.error = str(e) if isinstance(e, SpecvizError) else f"{type(e).__name__}: {e}"
            yield lane
            continue
        lane.clock += time.perf_counter() - start
        lane.records.append(record)
        lane.finished = record.finished is not None
        yield lane
