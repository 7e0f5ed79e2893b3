"""Runs that share their first steps: arms whose objectives differ only in a term that joins late.

HASS's Top-K term joins once ``topk_after`` of the training is done (HASS's recipe: the last fifth). Until then,
arms that differ only in that term's K or weight take the same steps: the same data plan, seed, schedule and
objective. The first of them to reach the branch step saves its state there, under a key that names everything
but the late term; the others start from that state. An arm started there ends bit for bit where it ends
alone (``tests/test_prefix.py``), and ``hass-topk``'s six arms cost one run and five fifths, not six runs.

Rules:
- The branch step B is the first step whose ``done = B / total`` reaches ``topk_after``: every step before B ran
  without the term. An objective whose term joins at the start, or never (``topk_after`` 0 or 1 and above),
  has no prefix.
- The key is the run key with the late term's K and weight set to 0 (``prefix_key``), so the settings, data,
  network and every other loss option still name it.
- A prefix is a training state like any other (``state.save_state``), in ``<cache>/train/prefixes/<key>``,
  written once, under that folder's lock, by the first run to pass B.
- A run that started from a prefix says so: its card's ``started_from`` names the key and the step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..trained import TrainedDrafter
from .config import TrainConfig, run_key


def branch_step(loss, total_steps: int) -> int | None:
    """The first step whose ``done`` reaches the late term's start, or None when the objective has none."""
    after = getattr(loss, "topk_after", 0.0)
    if not 0 < after < 1 or total_steps < 2:
        return None
    return next(s for s in range(total_steps + 1) if s / total_steps >= after)


def prefix_key(method: type[TrainedDrafter], features_key: str, cfg: TrainConfig) -> str:
    """The run key of ``method`` with the late term switched off: the same for every arm that shares the prefix."""
    early = type(method.__name__, (method,), {"loss": replace(method.loss, topk=0, topk_weight=0.0)})
    return "prefix-" + run_key(early, features_key, cfg)


def prefix_folder(method: type[TrainedDrafter], features_key: str, cfg: TrainConfig, root: Path) -> Path | None:
    """Where ``method``'s run finds or writes its shared prefix under ``root``; None when its objective has none."""
    if branch_step(getattr(method, "loss", None), 2) is None:
        return None
    return Path(root) / prefix_key(method, features_key, cfg)
