"""Training an experiment's arms at its budget: where each arm's checkpoint comes from, several runs at once on
one device, and finished runs carried from the machine that trained them to the one that benches them.

Rules:
- A trained arm is a training run in the cache, named by ``run_key`` (data, settings, objective, network and the
  device it trained on), so the same command finds a finished run again and resumes a killed one.
- The ``shared`` budget is the shipped drafters' own: an arm that trains a shipped method there benches the
  shipped checkpoint, where its card says it was trained at that budget (data, epochs, dtypes, objective); only
  the variants are trained. Where a card says otherwise, the arm trains, and the reason is printed.
- ``jobs > 1`` prepares the data and features once here, then trains up to ``jobs`` runs at once, each in a
  process of its own (``python -m specviz.apps.experiment_train SPEC``: the experiment, budget and run as JSON)
  running ``train_arms`` for that run alone (an arm trained separately, or jointly at a lambda), so its run folder
  is the one a lone run would name. They share the cores and stop together (``side_by_side``), and only as many
  run at once as the machine's memory holds (``memory_gate``): each run's peak is kept in the cache
  (``experiments/peaks.json``), so the next session knows it before the run starts.
- ``trained_on``: the device the runs were trained on, when it is not the bench's (a GPU's runs benched on a
  CPU); a run that is missing is then an error, not a training run on the wrong device.
- A bf16 budget does not start training on a CPU without a bf16 matrix unit (``core.load.slow_bf16``): there its
  runs would take several times the hours they take elsewhere, with nothing said. It says so and stops, unless
  ``allow_slow_bf16`` (``experiment --allow-slow-bf16``); finished runs still bench.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from drafters import METHODS
from drafters.checkpoint import CARD
from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.files import atomic_write
from specviz.core.load import cache_dir, slow_bf16

from .experiments import Arm, Budget, Experiment
from .memory_gate import MemoryGate
from .side_by_side import run_side_by_side
from .training import data_recipe, prepare_data, run_folder, run_prefix, train_drafters, training_classes


def budget_recipe(exp: Experiment | None, budget: Budget, device: str):
    """The data recipe of ``budget``: self-distilled, unless ``exp`` trains on a domain slice's own answers."""
    domain = exp.domain if exp is not None else ""
    return data_recipe(budget.samples, not domain, budget.max_prompt_tokens, budget.answer_tokens, 32,
                       budget.prompts, budget.dtype, budget.dtype, device, domain)


def budget_config(budget: Budget, device: str):
    from drafters.training.config import TrainConfig

    return TrainConfig(epochs=budget.epochs, device=device, precision="bf16" if budget.dtype == "bfloat16" else "no",
                       save_every=50)


def shipped_mismatch(card: dict, cls, recipe_card: dict, feature_dtype: str, cfg) -> list[str]:
    """What in a shipped checkpoint's card differs from a run of ``cls`` at this recipe and config (the device
    aside): empty when the shipped checkpoint is that run."""
    from drafters.training.config import OUTSIDE_RUN_KEY

    data, training = card.get("data") or {}, card.get("training") or {}
    wrong = [f"data {k} {data.get(k)!r}, not {v!r}" for k, v in recipe_card.items() if data.get(k) != v]
    if data.get("feature_dtype", feature_dtype) != feature_dtype:
        wrong.append(f"features in {data.get('feature_dtype')}, not {feature_dtype}")
    wrong += [f"training {k} {training.get(k)!r}, not {v!r}" for k, v in asdict(cfg).items()
              if k not in OUTSIDE_RUN_KEY and k != "device" and training.get(k) != v]
    loss = getattr(cls, "loss", None)
    if loss is not None and card.get("objective") != asdict(loss):
        wrong.append("its objective not recorded" if card.get("objective") is None else "another objective")
    if (card.get("network") or {}) != (cls.network_kwargs or {}):
        wrong.append("another network")
    return wrong


def shipped_bases(names: list[str], budget: Budget, target, recipe, cfg, quiet: bool = False) -> dict[str, Path]:
    """The arms among ``names`` that bench a shipped checkpoint at this budget (see the module's rules); unless
    ``quiet``, says why a shipped one does not."""
    from drafters.checkpoint import default_path, read_card

    found = {}
    if not budget.shipped_bases:
        return found
    classes = training_classes([n for n in names if n in METHODS])
    for name, cls in classes.items():
        folder = default_path(name)
        if not (folder / CARD).exists():
            continue
        wrong = shipped_mismatch(read_card(folder), cls, recipe.card(target), budget.dtype, cfg)
        if wrong and not quiet:
            print(f"{name}: the shipped checkpoint was not trained at the {budget.name} budget ({'; '.join(wrong)}); "
                  "training it", flush=True)
        elif not wrong:
            found[name] = folder
    return found


def train_arms(exp: Experiment, budget: Budget, target, device: str, trained_on: str | None = None,
               only: list[tuple[str, float | None]] | None = None, jobs: int = 1, target_spec: str | None = None,
               allow_slow_bf16: bool = False) -> dict[tuple[str, float | None], Path]:
    """Each trained arm's checkpoint at ``budget`` by (method or variant, joint lambda): shipped, found in the
    cache, or trained now (``only``: just these runs). ``specviz train`` with the same settings names the same runs."""
    from drafters.training.joint import JointOptions

    trained_on = trained_on or device
    recipe, cfg = budget_recipe(exp, budget, device), budget_config(budget, trained_on)
    names = [n for n in exp.trains if only is None or (n, None) in only]
    folders = {(name, None): f for name, f in shipped_bases(names, budget, target, recipe, cfg).items()}
    names = [n for n in names if (n, None) not in folders]
    joint = {lam: [n for n in ns if only is None or (n, lam) in only] for lam, ns in exp.joint.items()}
    if trained_on != device:  # only finished runs, carried here (``runs_archive``)
        runs = finished_runs(names, joint, target, recipe, cfg)
        missing = [name for name, folder in runs.items() if folder is None]
        if missing:
            raise SpecvizError(f"{', '.join(n for n, _ in missing)}: no finished run trained on {trained_on} at the "
                               f"{budget.name} budget in {cache_dir() / 'train' / 'runs'}; import them "
                               "(experiment --import) or train them there")
        return folders | runs
    if budget.dtype == "bfloat16" and slow_bf16(device) and not allow_slow_bf16:
        refuse_slow_bf16(budget, finished_runs(names, joint, target, recipe, cfg))
    if jobs > 1 and len(names) + sum(map(len, joint.values())) > 1:
        train_in_processes(exp, budget, names, joint, target, recipe, cfg, jobs, target_spec)
    if names:
        found = train_drafters(names, target, recipe, cfg, None, resume=True, ship=False)
        folders.update({(name, None): folder for name, folder in found.items()})
    for lam, ns in joint.items():
        if ns:
            found = train_drafters(ns, target, recipe, cfg, None, resume=True, ship=False, joint=JointOptions(lam))
            folders.update({(name, lam): folder for name, folder in found.items()})
    return folders


def refuse_slow_bf16(budget: Budget, runs: dict[tuple[str, float | None], Path | None]) -> None:
    """Raise, naming the runs left to train, where there are any (see the module's rules)."""
    todo = [run_label(name, lam, budget) for (name, lam), folder in runs.items() if folder is None]
    if todo:
        raise SettingsError(
            f"the {budget.name} budget extracts features and trains in bf16, and this CPU has no bf16 matrix "
            f"unit (AMX or AVX-512 BF16): its bf16 products take a slow path, several times fp32's time, so the "
            f"{len(todo)} run{'s' * (len(todo) > 1)} left ({', '.join(todo)}) would take several times their hours "
            "on a CPU that has one. Train them on a GPU (docs/gpu.md, its train step) or such a CPU and carry them "
            "here (--export, --import); --profile measures what a step costs here; --allow-slow-bf16 trains here "
            "anyway")


def finished_runs(names: list[str], joint: dict[float, list[str]], target, recipe, cfg,
                  ) -> dict[tuple[str, float | None], Path | None]:
    """Each arm's finished checkpoint folder in the cache, None where its run has not finished."""
    from drafters.training.joint import JointOptions

    found: dict[tuple[str, float | None], Path | None] = {}
    for name, lam in [(n, None) for n in names] + [(n, lam) for lam, ns in joint.items() for n in ns]:
        cls = training_classes([name], None if lam is None else JointOptions(lam))[name]
        folder = run_folder(name, cls, recipe.features_key(target), cfg) / "checkpoint"
        found[name, lam] = folder if (folder / CARD).exists() else None
    return found


def exported_runs(exp: Experiment, budget: Budget, target, device: str) -> list[Path]:
    """The finished runs of ``exp``'s trained arms at ``budget`` on ``device`` (the shipped ones aside), to carry to
    another machine; the unfinished ones are named and left."""
    recipe, cfg = budget_recipe(exp, budget, device), budget_config(budget, device)
    names = [n for n in exp.trains if n not in shipped_bases(exp.trains, budget, target, recipe, cfg)]
    runs = finished_runs(names, exp.joint, target, recipe, cfg)
    for (name, lam), folder in runs.items():
        if folder is None:
            joint = "" if lam is None else f" jointly (lambda {lam:g})"
            print(f"{name}{joint}: not finished; not exported", flush=True)
    return [f for f in runs.values() if f is not None]


def train_in_processes(exp: Experiment, budget: Budget, names: list[str], joint: dict[float, list[str]], target,
                       recipe, cfg, jobs: int, target_spec: str | None) -> None:
    """Train the unfinished runs among ``names`` (separately) and ``joint`` up to ``jobs`` at a time, as memory
    allows, each in its own process; their output goes to logs in the cache. Raises, naming the logs, if any fails."""
    todo = [run for run, folder in finished_runs(names, joint, target, recipe, cfg).items() if folder is None]
    if len(todo) < 2:
        return
    separate = [name for name, lam in todo if lam is None]
    prepare_data(training_classes(separate).values(), target, recipe)  # once, before the processes that read them
    logs = cache_dir() / "experiments" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    label = {run: run_label(*run, budget) for run in todo}
    commands = {label[run]: [sys.executable, "-m", "specviz.apps.experiment_train", json.dumps(
        {"experiment": asdict(exp), "budget": asdict(budget), "arm": run[0], "lam": run[1], "device": cfg.device,
         "target": target_spec, "allow_slow_bf16": True})] for run in todo}  # this process decided
    named_logs = {label[run]: logs / f"{label[run]}.log" for run in todo}
    peaks_file = cache_dir() / "experiments" / "peaks.json"
    peaks = json.loads(peaks_file.read_text()) if peaks_file.exists() else {}
    gate = MemoryGate.for_machine({n: peaks[n] for n in commands if n in peaks})
    print(f"training {len(todo)} runs, up to {min(jobs, len(todo))} at a time as memory allows; logs in {logs}",
          flush=True)
    ready = {label[(name, None)]: wait for name, wait in after_prefixes(separate, target, recipe, cfg).items()}
    try:
        failed = run_side_by_side(commands, named_logs, jobs, cfg.device, ready=ready, gate=gate)
    finally:  # what each run held, for the next time it is scheduled
        atomic_write(peaks_file, json.dumps(peaks | {n: gate.own(n) for n in commands if gate.own(n)}, indent=1))
    if failed:
        raise SpecvizError(f"{', '.join(failed)} failed to train; see {', '.join(str(named_logs[n]) for n in failed)}")


def run_label(name: str, lam: float | None, budget: Budget) -> str:
    """A training run's name in logs and messages: the arm, how it trains, the budget."""
    return f"{name}-{budget.name}" if lam is None else f"{name}-joint{lam:g}-{budget.name}"


def after_prefixes(names: list[str], target, recipe, cfg) -> dict:
    """For each arm that shares a prefix (``drafters.training.prefix``) not yet written, but the first: wait
    until it is, so that the others start at its branch step instead of training the same steps alongside."""
    from drafters.training.state import saved_state

    classes, writers, ready = training_classes(names), set(), {}
    for name in names:
        folder = run_prefix(classes[name], recipe.features_key(target), cfg)
        if folder is None or saved_state(folder) is not None:
            continue
        if folder in writers:
            ready[name] = lambda folder=folder: saved_state(folder) is not None
        writers.add(folder)
    return ready


def _train_one(spec: str) -> None:
    """A ``train_in_processes`` worker: ``train_arms`` for the one run of the experiment and budget ``spec`` holds."""
    from specviz.core.load import load_target

    spec = json.loads(spec)
    exp = dict(spec["experiment"])
    exp = Experiment(**exp | {"arms": tuple(Arm(**a) for a in exp["arms"]), "temperatures": tuple(exp["temperatures"])})
    target = load_target(spec["target"], "float32", spec["device"])
    train_arms(exp, Budget(**spec["budget"]), target, spec["device"], only=[(spec["arm"], spec.get("lam"))],
               allow_slow_bf16=spec.get("allow_slow_bf16", False))


if __name__ == "__main__":
    try:
        _train_one(sys.argv[1])
    except KeyboardInterrupt:  # asked to stop: the run saved its state and said so in the log
        sys.exit(130)
