"""A bench's finished prompts, appended to a file as they finish, so that a killed run can resume."""

from __future__ import annotations

import pickle
from pathlib import Path

from specviz.core.errors import SettingsError

from .bench import PromptRun


class RunLog:
    """The file holds the run's settings, then one pickle per finished prompt; a prompt cut short by
    the kill is dropped on loading. Only load logs this program wrote: pickle runs code from the file."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings

    def start(self) -> None:
        with self.path.open("wb") as f:
            pickle.dump(self.settings, f)

    def resume(self) -> dict[str, list[PromptRun]]:
        if not self.path.exists():
            raise SettingsError(f"nothing to resume: {self.path} does not exist (bench writes it while it runs and "
                                "removes it when the run is complete)")
        runs: dict[str, list[PromptRun]] = {}
        with self.path.open("rb") as f:
            try:
                settings = pickle.load(f)
            except Exception as e:
                raise SettingsError(f"{self.path} is not a bench run log ({e})") from None
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
                for label, prompt_run in prompt.items():
                    runs.setdefault(label, []).append(prompt_run)
                good = f.tell()
        with self.path.open("r+b") as f:
            f.truncate(good)
        return runs

    def append(self, prompt: dict[str, PromptRun]) -> None:
        with self.path.open("ab") as f:
            pickle.dump(prompt, f)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
