"""A bench's finished prompts, appended to a file as they finish, so that a killed run can resume.
Each prompt is logged as slim as the bench's figures allow (``pack``), xz-compressed: an MT-bench
prompt of 16 methods takes about 100 kB."""

from __future__ import annotations

import lzma
import os
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

    def __init__(self, path: Path, settings: dict, ignore: tuple[str, ...] = ()):
        self.path, self.settings, self.ignore = path, settings, ignore  # ignore: settings a resume may change

    def start(self, exclusive: bool = False) -> None:
        """Write the settings (``exclusive``: unless another process has written this log first; the log
        appears whole, so a process that finds it never reads it half-written)."""
        if not exclusive:
            with self.path.open("wb") as f:
                pickle.dump(self.settings, f)
            return
        draft = self.path.with_name(f"{self.path.name}.{os.getpid()}.new")
        draft.write_bytes(pickle.dumps(self.settings))
        try:
            os.link(draft, self.path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()

    def _read_settings(self, f) -> dict:
        try:
            settings = pickle.load(f)
        except Exception as e:
            raise SettingsError(f"{self.path} is not a bench run log ({e})") from None
        if "budgets" in settings:  # logs before 2026-11-25 kept each budget's settings alone
            settings["budgets"] = {label: b if "settings" in b else {"settings": b}
                                   for label, b in settings["budgets"].items()}
        if "machine" in self.settings:  # logs before 2026-11-25 did not name their machine
            settings.setdefault("machine", self.settings["machine"])
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

    def check(self, settings: dict, but: tuple[str, ...] = (), source: Path | None = None) -> None:
        """Refuse a logged run whose ``settings`` differ from this run's (but for the keys ``but``)."""
        changed = sorted(k for k in settings.keys() | self.settings.keys()
                         if k not in but + self.ignore and settings.get(k) != self.settings.get(k))
        if changed == ["machine"]:
            raise SettingsError(f"{source or self.path} ran on {settings.get('machine')}, not on this machine "
                                f"({self.settings.get('machine')}): its speed figures would mix machines; run "
                                "without --resume to start again, or with --any-machine for a τ-only run")
        if changed:
            raise SettingsError(f"{source or self.path} was a run with other {', '.join(changed)}; "
                                "run without --resume to start again")

    def on_file(self) -> tuple[dict, list[bytes]]:
        """The settings and each whole prompt's compressed pickle, as the file holds them now."""
        return self._prompts(truncate=False)

    def _prompts(self, truncate: bool = True) -> tuple[dict, list[bytes]]:
        """The settings and each whole prompt's compressed pickle; a torn last prompt is cut off the file."""
        prompts = []
        with self._open() as f:
            settings = self._read_settings(f)
            good = f.tell()
            while True:
                try:
                    prompts.append(pickle.load(f))
                except Exception:  # the end, or the prompt being written when the run was killed
                    break
                good = f.tell()
        if truncate:
            with self.path.open("r+b") as f:
                f.truncate(good)
        return settings, prompts

    def resume(self) -> dict[str, list[PromptRun]]:
        settings, prompts = self._prompts()
        self.check(settings)
        runs: dict[str, list[PromptRun]] = {}
        for prompt in prompts:
            for label, prompt_run in pickle.loads(lzma.decompress(prompt)).items():
                runs.setdefault(label, []).append(unpack(prompt_run))
        return runs

    def absorb(self, parts: list[Path]) -> list[Path]:
        """Append the prompts of finished part runs (``bench --part``) that carry on where this log stops, in
        question order; returns the parts taken. A part must have this run's settings but for its questions."""
        if not parts:
            return []
        settings, prompts = self._prompts()
        self.check(settings)
        questions, done, taken = self.settings["questions"], len(prompts), []
        pending = {}
        for path in parts:
            part = RunLog(path, self.settings, self.ignore)
            part_settings, part_prompts = part.on_file()  # a part still running is only read
            part.check(part_settings, but=("questions",))
            if len(part_prompts) == len(part_settings["questions"]):  # unfinished parts wait
                pending[tuple(part_settings["questions"])] = (path, part_prompts)
        while True:
            nxt = next((k for k in pending if list(k) == questions[done : done + len(k)]), None)
            if nxt is None:
                return taken
            path, part_prompts = pending.pop(nxt)
            with self.path.open("ab") as f:
                for prompt in part_prompts:
                    pickle.dump(prompt, f)
            done += len(nxt)
            taken.append(path)

    def append(self, prompt: dict[str, PromptRun]) -> None:
        with self.path.open("ab") as f:
            pickle.dump(lzma.compress(pickle.dumps({label: pack(run) for label, run in prompt.items()})), f)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
