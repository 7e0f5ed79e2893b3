"""A bench's finished prompts, appended to a file as they finish, so that a killed run can resume.

The log is JSON lines: the run's settings first (``{"settings": ...}``), then one line per finished prompt
(``{"prompt": {label: run}}``), each run as the bench's figures read it (``encode_run``). A line is appended
whole or cut short by a kill; a torn last line is dropped on loading. A log is read with ``json`` alone, so
nothing in it runs as code. ``--part K/N`` and ``--resume`` build on it (``open_bench_log``).
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import sys
import typing
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch

from specviz.core.engine import StepRecord
from specviz.core.errors import SettingsError
from specviz.core.files import atomic_write
from specviz.core.timing import Timings
from specviz.core.tree import DraftTree

from . import machine
from .bench import PromptRun, bench
from .results import BenchResult, MethodBudget

_HINTS = typing.get_type_hints(StepRecord)
DROPPED = {"decisions"}  # the accept rule's per-node numbers: only the app's step view reads them


def _holds(hint, cls: type) -> bool:
    return hint is cls or cls in typing.get_args(hint)


def encode_run(run: PromptRun) -> dict:
    """The run as plain lists: each step's tree as tokens and parents with its beams' compression; tensors
    (draft log-probs, child distributions, the target's probabilities of each node) and the accept rule's
    decisions stay out, as no figure reads them and they would make the log many times larger."""
    records = None
    if run.records is not None:
        records = []
        for r in run.records:
            step = {}
            for f in fields(r):
                value = getattr(r, f.name)
                if f.name in DROPPED:
                    continue
                if isinstance(value, DraftTree):
                    compression = value.info.get("compression")
                    step[f.name] = {"tokens": value.tokens.tolist(), "parents": value.parents.tolist(),
                                    **({} if compression is None else {"compression": float(compression)})}
                elif isinstance(value, Timings):
                    step[f.name] = asdict(value)
                elif not isinstance(value, torch.Tensor):
                    step[f.name] = value
            records.append(step)
    return {"output": run.output, "wall_s": run.wall_s, "records": records}


def decode_run(data: dict) -> PromptRun:
    if data["records"] is None:
        return PromptRun(data["output"], data["wall_s"])
    steps = []
    for step in data["records"]:
        kwargs = {}
        for name, hint in _HINTS.items():
            value = step.get(name)
            if name not in step:
                if _holds(hint, torch.Tensor):
                    kwargs[name] = torch.zeros(0)
            elif _holds(hint, DraftTree):
                info = {"compression": value["compression"]} if "compression" in value else {}
                kwargs[name] = DraftTree(torch.tensor(value["tokens"], dtype=torch.long),
                                         torch.tensor(value["parents"], dtype=torch.long), info=info)
            elif _holds(hint, Timings):
                kwargs[name] = Timings(**value)
            else:
                kwargs[name] = value
        steps.append(StepRecord(**kwargs))
    return PromptRun(data["output"], data["wall_s"], steps)


def _line(value: dict) -> bytes:
    return (json.dumps(value, separators=(",", ":")) + "\n").encode()


class RunLog:
    """One run's log file. ``settings`` are this run's (plain JSON data); ``ignore``: settings a resume may
    change (``--any-machine``: the machine). ``logged``: prompts this object has on file."""

    def __init__(self, path: Path, settings: dict, ignore: tuple[str, ...] = ()):
        self.path, self.settings, self.ignore = Path(path), settings, ignore
        self.logged = 0

    def start(self, exclusive: bool = False) -> None:
        """Write the settings (``exclusive``: unless another process has written this log first; the log
        appears whole, so a process that finds it never reads it half-written)."""
        self.logged = 0
        if not exclusive:
            atomic_write(self.path, _line({"settings": self.settings}))
            return
        draft = self.path.with_name(f"{self.path.name}.{os.getpid()}.new")
        draft.write_bytes(_line({"settings": self.settings}))
        try:
            os.link(draft, self.path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()

    def _read(self) -> tuple[dict, list[bytes], int]:
        """The settings, each whole prompt's line, and the offset where the whole lines end."""
        if not self.path.exists():
            raise SettingsError(f"nothing to resume: {self.path} does not exist (bench writes it while it runs and "
                                "removes it when the run is complete)")
        lines = self.path.read_bytes().split(b"\n")
        try:
            settings = json.loads(lines[0])["settings"]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise SettingsError(f"{self.path} is not a bench run log ({type(e).__name__}: {e})") from None
        if "budgets" in settings:  # as MethodBudget writes them (the earliest logs kept a budget's settings alone)
            settings["budgets"] = {label: MethodBudget.from_dict(b).to_dict()
                                   for label, b in settings["budgets"].items()}
        good, prompts = len(lines[0]) + 1, []
        for line in lines[1:-1]:  # the last piece follows the last newline: empty, or a prompt cut short
            try:
                json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                break  # a prompt being written when the run was killed
            prompts.append(line)
            good += len(line) + 1
        return settings, prompts, good

    def on_file(self) -> tuple[dict, list[bytes]]:
        """The settings and each whole prompt's line, as the file holds them now (read only)."""
        settings, prompts, _ = self._read()
        return settings, prompts

    def _prompts(self) -> tuple[dict, list[bytes]]:
        """The settings and each whole prompt's line; a torn last prompt is cut off the file."""
        settings, prompts, good = self._read()
        with self.path.open("r+b") as f:
            f.truncate(good)
        self.logged = len(prompts)
        return settings, prompts

    def budgets(self) -> dict[str, MethodBudget]:
        """The budgets the logged prompts ran at (label → ``tuning.resolved_budgets``' record)."""
        return {label: MethodBudget.from_dict(b) for label, b in self.on_file()[0].get("budgets", {}).items()}

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

    def resume(self) -> dict[str, list[PromptRun]]:
        settings, prompts = self._prompts()
        self.check(settings)
        runs: dict[str, list[PromptRun]] = {}
        for line in prompts:
            for label, data in json.loads(line)["prompt"].items():
                runs.setdefault(label, []).append(decode_run(data))
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
                f.writelines(line + b"\n" for line in part_prompts)
            done += len(nxt)
            self.logged = done
            taken.append(path)

    def append(self, prompt: dict[str, PromptRun]) -> None:
        with self.path.open("ab") as f:
            f.write(_line({"prompt": {label: encode_run(run) for label, run in prompt.items()}}))
        self.logged += 1

    def sync(self, runs: dict[str, list[PromptRun]]) -> None:
        """Append the prompts ``runs`` holds beyond those already on file."""
        for i in range(self.logged, len(runs.get("ar", []))):
            self.append({label: r[i] for label, r in runs.items()})

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def bench_settings(target, methods: list[str], questions: list, max_new_tokens: int, sampling, dtype: str) -> dict:
    """What a resume must share with the run it continues (``dtype`` as asked: "auto" may resolve otherwise on
    another machine, which the machine's name refuses anyway). The linear kernels change speed as a machine
    does, so they are part of the machine's name."""
    kernels = "" if target.kernels == "default" else "; packed linear weights"
    return {"methods": methods, "questions": [q.id for q in questions], "max new tokens": max_new_tokens,
            "sampling": [sampling.temperature, sampling.top_p, sampling.resolved_rule], "target": target.name,
            "dtype": dtype, "device": str(target.device), "machine": machine.machine_fingerprint() + kernels}


@dataclass
class BenchLog:
    """What a bench command runs: its log, its output file, its questions and the budgets they run at."""

    log: RunLog
    out: Path
    questions: list
    budgets: dict[str, MethodBudget]


def part_of(spec: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4); anything else is a SettingsError."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise SettingsError(f"--part takes K/N with 1 <= K <= N, got {spec!r}")
    return k, n


def run_log_path(out: Path) -> Path:
    """The run log beside results file ``out``: there while a bench runs, removed when it completes."""
    return out.with_name(out.name + ".runs")


def part_logs(out: Path) -> list[Path]:
    """The run logs of ``out``'s parts (``--part K/N``), in order."""
    return sorted(out.parent.glob(f"{glob.escape(out.name)}.part*-of-*.runs"))


def check_resumable(out: Path) -> None:
    """Refuse ``--resume`` at once (before a target loads or compiles) where no run of ``out`` was left to resume."""
    log = run_log_path(out)
    if not log.exists() and not part_logs(out):
        raise SettingsError(f"nothing to resume: {log} does not exist (bench writes it while it runs and removes it "
                            "when the run is complete); run without --resume to start")


def open_bench_log(out: Path, questions: list, settings: dict, resolve, part: str | None = None,
                   resume: bool = False, any_machine: bool = False, say=print) -> BenchLog:
    """This bench's run log, output, questions and budgets (``resolve()`` when no log fixes them), with its
    prompts read back when ``resume``. ``part="K/N"`` runs the K-th of N blocks of the questions the full run
    has not logged yet, in a log of its own at the full run's budgets; the full command with ``resume`` takes
    finished parts in (``RunLog.absorb``), so a τ bench can run one process per core."""
    ignore = ("machine",) if any_machine else ()
    log = RunLog(run_log_path(out), settings, ignore)
    if part:
        return _open_part(log, out, questions, settings, resolve, part_of(part), resume, ignore)
    if not resume:
        return BenchLog(log, out, questions, resolve())
    parts = part_logs(out)
    if parts and not log.path.exists():  # only parts ran: their budgets are the run's
        first = RunLog(parts[0], settings, ignore).on_file()[0]
        log.check(first, but=("questions", "budgets"), source=parts[0])
        log.settings["budgets"] = first["budgets"]
        log.start()
    log.settings["budgets"] = {label: b.to_dict() for label, b in log.budgets().items()}
    for taken in log.absorb(parts):
        taken.unlink()
        out.with_name(taken.name.removesuffix(".runs")).unlink(missing_ok=True)
        say(f"took in {taken.name}")
    return BenchLog(log, out, questions, log.budgets())


def _open_part(log: RunLog, out: Path, questions: list, settings: dict, resolve, kn: tuple[int, int], resume: bool,
               ignore: tuple[str, ...]) -> BenchLog:
    k, n = kn
    out = out.with_name(f"{out.name}.part{k}-of-{n}")
    part = RunLog(run_log_path(out), dict(settings), ignore)
    if resume:  # this part's own questions, however far the full run has got since
        ids = set(part.on_file()[0]["questions"])
        block, budgets = [q for q in questions if q.id in ids], part.budgets()
    else:
        if not log.path.exists():  # the first part to get here writes the full run's log: all run at its budgets
            log.settings["budgets"] = {label: b.to_dict() for label, b in resolve().items()}
            log.start(exclusive=True)
        done, budgets = len(log.on_file()[1]), log.budgets()
        size = -(-(len(questions) - done) // n)
        block = questions[done + (k - 1) * size : done + k * size]
        if not block:
            raise SettingsError(f"part {k} of {n} has no questions: {len(questions) - done} are left to run")
    part.settings["questions"] = [q.id for q in block]
    return BenchLog(part, out, block, budgets)


def _save(plan: BenchLog, runs: dict[str, list[PromptRun]], questions_name: str, watchdog_s: float,
          result: BenchResult) -> None:
    """After every prompt, so a killed run keeps what it finished: the results so far, the new prompts' runs."""
    result.questions = questions_name
    result.save(plan.out)
    plan.log.sync(runs)
    _watchdog(watchdog_s)


def _watchdog(seconds: float) -> None:
    """A prompt stuck past ``seconds`` prints where every thread is (and again every ``seconds``)."""
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.__stderr__)


def logged_bench(target, methods: list[str], plan: BenchLog, max_new_tokens: int, sampling, resume: bool,
                 questions_name: str, watchdog_s: float = 900, say=print) -> BenchResult:
    """``bench.bench`` on the plan's questions at its budgets, saving the results and logging every finished
    prompt as it goes; with ``resume``, the prompts the log holds are taken as run."""
    plan.log.settings["budgets"] = {label: b.to_dict() for label, b in plan.budgets.items()}
    runs = plan.log.resume() if resume else {}
    if resume:
        say(f"resuming: {len(runs.get('ar', []))} of {len(plan.questions)} prompts already done")
    else:
        plan.log.start()
    save = partial(_save, plan, runs, questions_name, watchdog_s)
    _watchdog(watchdog_s)
    try:
        result = bench(target, methods, plan.questions, max_new_tokens, sampling, on_prompt=save, runs=runs,
                       budgets=plan.budgets)
        save(result)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return result


def finish_bench_log(plan: BenchLog, result: BenchResult, part: str | None, say=print) -> None:
    """A complete run removes its log; an interrupted run or a part keeps it for ``--resume`` to go on from."""
    if result.interrupted:
        say(f"interrupted: kept the {len(result.per_prompt)} prompts every method finished; "
            "the same command with --resume goes on from there")
    elif part:
        say(f"part {part} done: the command without --part, with --resume, takes it in")
    else:
        plan.log.remove()
    say(f"wrote {plan.out}")
