"""A bench's finished prompts, appended to a file as they finish, so that a killed run can resume.
Each prompt is logged as slim as the bench's figures allow (``pack``), xz-compressed: an MT-bench
prompt of 16 methods takes about 100 kB."""

from __future__ import annotations

import lzma
import pickle
from dataclasses import astuple
from pathlib import Path

import torch

from specviz.core.engine import StepRecord
from specviz.core.errors import SettingsError
from specviz.core.timing import Timings
from specviz.core.tree import DraftTree

from .bench import PromptRun

_NOTHING = torch.zeros(0)


def pack(run: PromptRun) -> tuple:
    """The run as the bench's figures read it (``metrics.compare``), in plain lists: each step's tree as
    tokens and parents with its beams' compression, not the draft log-probs, child distributions, other
    extras or hover probabilities (as pickled objects an MT-bench prompt of 16 methods took 6.5 MB)."""
    records = None if run.records is None else [
        (r.step, r.tree.tokens.tolist(), r.tree.parents.tolist(), r.tree.info.get("compression"), r.path, r.tokens,
         r.bonus, r.bonus_target_p, astuple(r.timings), r.finished, r.margins) for r in run.records]
    return run.output, run.wall_s, records


def unpack(packed: tuple) -> PromptRun:
    output, wall_s, records = packed
    if records is None:
        return PromptRun(output, wall_s)
    steps = []
    for step, tokens, parents, compression, path, emitted, bonus, bonus_p, timings, finished, margins in records:
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                         info={} if compression is None else {"compression": compression})
        steps.append(StepRecord(step, tree, path, emitted, bonus, _NOTHING, bonus_p, Timings(*timings), finished,
                                margins))
    return PromptRun(output, wall_s, steps)


class RunLog:
    """The file holds the run's settings, then one compressed pickle per finished prompt; a prompt cut short by
    the kill is dropped on loading. Only load logs this program wrote: pickle runs code from the file."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings

    def start(self) -> None:
        with self.path.open("wb") as f:
            pickle.dump(self.settings, f)

    def _read_settings(self, f) -> dict:
        try:
            settings = pickle.load(f)
        except Exception as e:
            raise SettingsError(f"{self.path} is not a bench run log ({e})") from None
        if "budgets" in settings:  # logs before 2026-11-25 kept each budget's settings alone
            settings["budgets"] = {label: b if "settings" in b else {"settings": b}
                                   for label, b in settings["budgets"].items()}
        return settings

    def _open(self):
        if not self.path.exists():
            raise SettingsError(f"nothing to resume: {self.path} does not exist (bench writes it while it runs and "
                                "removes it when the run is complete)")
        return self.path.open("rb")

    def budgets(self) -> dict[str, dict]:
        """The budgets the logged prompts ran at (label → ``bench.resolved_budgets``' record)."""
        with self._open() as f:
            return self._read_settings(f).get("budgets", {})

    def resume(self) -> dict[str, list[PromptRun]]:
        runs: dict[str, list[PromptRun]] = {}
        with self._open() as f:
            settings = self._read_settings(f)
            if settings != self.settings:
                changed = sorted(k for k in settings.keys() | self.settings.keys()
                                 if settings.get(k) != self.settings.get(k))
                raise SettingsError(f"{self.path} was a run with other {', '.join(changed)}; "
                                    "run without --resume to start again")
            good = f.tell()
            while True:
                try:
                    prompt = pickle.load(f)
                except Exception:  # the end, or the prompt being written when the run was killed
                    break
                for label, prompt_run in pickle.loads(lzma.decompress(prompt)).items():
                    runs.setdefault(label, []).append(unpack(prompt_run))
                good = f.tell()
        with self.path.open("r+b") as f:
            f.truncate(good)
        return runs

    def append(self, prompt: dict[str, PromptRun]) -> None:
        with self.path.open("ab") as f:
            pickle.dump(lzma.compress(pickle.dumps({label: pack(run) for label, run in prompt.items()})), f)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
