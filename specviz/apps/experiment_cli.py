"""The ``experiment`` command's arguments and handler (``cli`` registers them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specviz.core.errors import SettingsError
from specviz.core.load import cache_dir

from .experiment_results import SHIPPED
from .experiments import BUDGETS, EXPERIMENTS, Experiment, budget, experiment


def add_parser(sub) -> None:
    e = sub.add_parser("experiment", help="one paper's ablation or figure end to end: train its arms at a budget, "
                                          "bench them, write a results file, table and figure")
    e.add_argument("name", help=f"one of {', '.join(EXPERIMENTS)}; or list")
    e.add_argument("--budget", default="small", choices=list(BUDGETS),
                   help="; ".join(f"{b.name}: {b.note}" for b in BUDGETS.values()))
    e.add_argument("--questions", default="mt-bench", help="mt-bench, humaneval or a question.jsonl path")
    e.add_argument("--per-category", type=int, default=1, help="the first N questions of each category")
    e.add_argument("--limit", type=int, default=None, help="then at most this many questions")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--target", default=None)
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    e.add_argument("--out", default=None, help="results file (default: ~/.cache/specviz/experiments/NAME-BUDGET.json)")
    e.add_argument("--ship", action="store_true", help="write the results into assets/experiments instead")
    e.add_argument("--train-only", action="store_true",
                   help="train (or resume) the arms and stop: bench them later, on a quiet machine, with the same "
                        "command without this flag (NAME may list several experiments, comma-separated)")
    e.add_argument("--status", action="store_true",
                   help="say where each trained arm stands at the budget (shipped, finished, training, stopped at step "
                        "N, not started) and stop; NAME may list several")
    e.add_argument("--profile", action="store_true",
                   help="time a few real training steps of each arm the budget trains, on this device, and say how "
                        "long each whole run takes and what is left of it; then stop (NAME may list several)")
    e.add_argument("--steps", type=int, default=5, help="--profile: timed steps per arm (after one warm-up)")
    e.add_argument("--jobs", type=int, default=1,
                   help="train up to this many runs at once, each in its own process, as many as the machine's memory "
                        "holds (on a GPU: one GPU, many runs)")
    e.add_argument("--allow-slow-bf16", action="store_true",
                   help="train a bf16 budget's runs on a CPU without AMX or AVX-512 BF16, where bf16 products are "
                        "several times slower than fp32 (without it, such a run is refused with the reason)")
    e.add_argument("--export", metavar="DIR", default=None,
                   help="write the finished runs of the arms (NAME may list several) into tar parts in DIR, to carry "
                        "them to another machine, and stop")
    e.add_argument("--part-mb", type=int, default=15, help="--export: the largest part, in MiB")
    e.add_argument("--import", dest="import_paths", nargs="+", metavar="PART", default=None,
                   help="first put the runs in these parts (from --export) into the cache")
    e.add_argument("--trained-on", default=None, metavar="DEVICE",
                   help="bench runs trained on this device (cuda: carried from a GPU with --export/--import); a "
                        "missing one is an error, not trained here")


def unions(names: list[str]) -> list[Experiment]:
    """Several experiments' trained arms, as one experiment per training set (a domain slice is data of its own),
    each arm once, in the order the names first use each set: to train, profile or export together."""
    exps = [experiment(n) for n in names]
    out = []
    for domain in dict.fromkeys(e.domain for e in exps):
        group = [e for e in exps if e.domain == domain]
        arms = tuple(dict.fromkeys(a for e in group for a in e.arms if a.train))
        out.append(Experiment(",".join(e.name for e in group), "several", "", "", arms, domain=domain))
    return out


def cmd_experiment(args: argparse.Namespace) -> None:
    if args.name == "list":
        for e in EXPERIMENTS.values():
            trained = e.trains + [f"{n} jointly (lambda {lam:g})" for lam, names in e.joint.items() for n in names]
            trains = f"; trains {', '.join(trained)}" if trained else ""
            domain = f"; on the {e.domain} slice" if e.domain else ""
            print(f"{e.name:16} {e.paper}, {e.reproduces}: {e.question} ({len(e.arms)} arms{trains}{domain})")
        return
    import torch

    from .domain_eval import domain_questions
    from .experiment_run import run_experiment
    from .questions import load_questions

    chosen = budget(args.budget)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.jobs < 1 or args.part_mb < 1:
        raise SettingsError("--jobs and --part-mb must be at least 1")
    if args.import_paths:
        from .runs_archive import import_runs

        for folder in import_runs([Path(p) for p in args.import_paths]):
            print(f"imported {folder}")
    several = "," in args.name
    groups = unions(args.name.split(",")) if several else [experiment(args.name)]
    if args.status or args.profile or args.train_only or args.export:
        return _arms(groups, chosen, args, device)
    if several:
        raise SettingsError("bench one experiment at a time (several names are for --train-only, --status, "
                            "--profile and --export)")
    exp = groups[0]
    name = f"{exp.name}-{chosen.name}" if exp.trains else exp.name
    out = Path(args.out) if args.out else (SHIPPED if args.ship else cache_dir() / "experiments") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    references = None
    if exp.domain:  # its own held-out slice, with the answers its target's quality is measured against
        questions, references = domain_questions(exp.domain, args.limit or 8)
        chosen_set = f"ShareGPT {exp.domain} slice, held out"
    else:
        questions = load_questions(args.questions, args.limit, args.per_category)
        chosen_set = f"{args.questions} ({args.per_category} per category)" if args.per_category else args.questions
    result = run_experiment(exp, chosen, questions, chosen_set, args.max_new_tokens, out, args.target, device,
                            references=references, trained_on=args.trained_on, jobs=args.jobs,
                            allow_slow_bf16=args.allow_slow_bf16)
    table = out.with_suffix(".md")
    table.write_text(result.markdown() + "\n")
    print(f"wrote {out} and {table}\n\n{result.markdown()}")


def _arms(groups: list[Experiment], chosen, args: argparse.Namespace, device: str) -> None:
    """``--status``, ``--profile``, ``--train-only`` and ``--export``: for each group of trained arms on one training
    set in turn (``unions``); the exported runs of every group go into one set of parts."""
    from specviz.core.load import load_target

    from .experiment_status import arm_status
    from .experiment_train import exported_runs, train_arms

    if (args.train_only or args.export) and not any(e.trains or e.joint for e in groups):
        names = ",".join(e.name for e in groups)  # its arms are shipped drafters: nothing to load or train
        print(f"{names} trains no arms: bench it without --train-only")
        return
    target, runs = load_target(args.target, "float32", device), []
    for exp in groups:
        if args.status:
            for status in arm_status(exp, chosen, target, args.trained_on or device):
                print(status.line())
        elif args.profile:
            _profile(exp, chosen, target, args, device, len(groups) > 1)
        elif args.export:
            runs += exported_runs(exp, chosen, target, device)
        elif exp.trains or exp.joint:
            folders = train_arms(exp, chosen, target, device, args.trained_on, jobs=args.jobs,
                                 target_spec=args.target, allow_slow_bf16=args.allow_slow_bf16)
            for (name, lam), folder in folders.items():
                print(f"{name}{'' if lam is None else f' jointly (lambda {lam:g})'}: {folder}")
    if args.export:
        from .runs_archive import export_runs

        parts = export_runs(runs, Path(args.export), args.part_mb << 20)
        print(f"wrote {len(parts)} part{'s' * (len(parts) != 1)}: {', '.join(str(p) for p in parts)}")


def _profile(exp: Experiment, chosen, target, args: argparse.Namespace, device: str, grouped: bool) -> None:
    """``--profile``: each trained arm's step by phase at the budget, its whole run, and what is left of it."""
    from .experiment_status import arm_status, time_left
    from .train_profile import arm_classes, profile_training, shared_prefixes

    classes = arm_classes(exp, chosen, target, device)
    if not classes:
        print(f"{exp.name} trains no arms at the {chosen.name} budget: nothing to profile")
        return
    result = profile_training(target, classes, args.steps, budget=chosen.name, exp=exp)
    print(result.text())
    print("\n".join(time_left(arm_status(exp, chosen, target, device), result,
                               shared_prefixes(classes, exp, chosen, target, device, result.run_steps))))
    if args.out:  # one file a training set where several are profiled
        from specviz.core.files import atomic_write

        out = Path(args.out)
        out = out.with_name(f"{out.stem}-{exp.domain or 'all'}{out.suffix}") if grouped else out
        atomic_write(out, json.dumps(result.to_dict(), indent=1))
        print(f"wrote {out}")
