"""Where an experiment's trained arms stand at a budget, read from the cache without touching a run.

An arm is shipped (its checkpoint in ``assets/drafters`` is its run at this budget), finished (a checkpoint in
its run folder), training (a process holds the run now: ``drafters.training.lock``), stopped (a saved state and
no process) or not started. A part-trained run says its step, the steps in all and when it last saved, so a
session that comes back to a long CPU job knows where it stands before it starts anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from drafters.checkpoint import CARD

from .experiment_train import budget_config, budget_recipe, shipped_bases
from .experiments import Budget, Experiment
from .training import run_folder, training_classes


@dataclass(frozen=True)
class ArmStatus:
    arm: str  # the method or variant, and its joint lambda where it trains jointly
    state: str  # shipped, finished, training, stopped or not started
    folder: Path | None  # the checkpoint (shipped, finished) or the run folder
    step: int = 0
    total: int = 0  # 0 where the saved state predates the record
    saved: float | None = None  # when the state was last saved (seconds since the epoch)
    pid: int | None = None  # the process training it now (-1: one that has not written its id yet)

    def line(self, now: float | None = None) -> str:
        where = f"{self.step:,} of {self.total:,} steps" if self.total else f"{self.step:,} steps"
        if self.saved is not None:
            where += f", saved {_ago((now or time.time()) - self.saved)}"
        detail = {"shipped": str(self.folder), "finished": str(self.folder), "not started": "",
                  "stopped": f"{where}; the same --train-only command resumes it",
                  "training": f"{where}, by process {self.pid}" if self.pid and self.pid > 0 else where}[self.state]
        return f"{self.arm:34} {self.state:12} {detail}".rstrip()


def _ago(seconds: float) -> str:
    minutes = max(0, int(seconds // 60))
    return f"{minutes} min ago" if minutes < 120 else f"{minutes / 60:.0f} h ago"


def arm_status(exp: Experiment, budget: Budget, target, device: str) -> list[ArmStatus]:
    """Every trained arm of ``exp`` at ``budget``, as trained on ``device``, in the experiment's order."""
    from drafters.training.joint import JointOptions
    from drafters.training.lock import holder
    from drafters.training.state import PROGRESS, Progress, saved_state

    recipe, cfg = budget_recipe(exp, budget, device), budget_config(budget, device)
    shipped = shipped_bases(exp.trains, budget, target, recipe, cfg, quiet=True)
    out = []
    for name, lam in exp.trained_runs:
        label = name if lam is None else f"{name} jointly (lambda {lam:g})"
        if lam is None and name in shipped:
            out.append(ArmStatus(label, "shipped", shipped[name]))
            continue
        cls = training_classes([name], None if lam is None else JointOptions(lam))[name]
        work = run_folder(name, cls, recipe.features_key(target), cfg)
        if (work / "checkpoint" / CARD).exists():
            out.append(ArmStatus(label, "finished", work / "checkpoint"))
            continue
        pid, state = holder(work), saved_state(work)
        progress = Progress.load(state) if state is not None else Progress()
        saved = (state / PROGRESS).stat().st_mtime if state is not None else None
        kind = "training" if pid is not None else "stopped" if state is not None else "not started"
        out.append(ArmStatus(label, kind, work, progress.step, progress.total, saved, pid))
    return out


def time_left(statuses: list[ArmStatus], profile, prefixes: list[tuple[Path, int, bool] | None] | None = None,
              ) -> list[str]:
    """Per arm that trains (``statuses`` without the shipped ones, in ``arm_classes``' order, as ``profile``'s rows
    are), the steps left and their time at the profiled mean step, alone on the profiled device; then the sum.

    ``prefixes``, one per such arm: (its shared prefix's folder, branch step, whether the prefix is written), or
    None where it shares none (``drafters.training.prefix``). An arm that will start from a prefix counts only the
    steps after the branch; of arms waiting on one unwritten prefix, the first counts the steps before it too."""
    training = [s for s in statuses if s.state != "shipped"]
    prefixes = prefixes or [None] * len(training)
    lines, hours, unknown, writers = [], 0.0, False, set()
    for status, row, prefix in zip(training, profile.rows, prefixes, strict=True):
        total = status.total or profile.run_steps or 0
        if not total and status.state != "finished":  # a fresh run over sequences not made here: no step count
            lines.append(f"  {status.arm:34} steps unknown: the budget's sequences are not made on this machine")
            unknown = True
            continue
        start, note = status.step, ""
        if prefix is not None and status.step < prefix[1]:
            folder, branch, written = prefix
            if written or folder in writers:
                start, note = branch, f" (from the shared prefix at step {branch:,})"
            writers.add(folder)
        left = 0 if status.state == "finished" else max(total - start, 0)
        h = left * row.ms["total"] / 3.6e6
        hours += h
        lines.append(f"  {status.arm:34} {left:>6,} of {total:,} steps left: {h:5.2f} h{note}")
    lines.append(f"  {'in all':34} {hours:5.2f} h{' and the unknown' if unknown else ''}, one arm at a time on this "
                 "device (--jobs shares its cores)")
    return lines
