"""Command line: ``python -m specviz {generate,bench,profile,report,data,train,validate,tune,sweep,export,methods}``.

This module parses arguments and calls: each command's work is in the module named beside it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from drafters import METHODS, checkpoint_sources, with_checkpoints
from specviz.apps import experiment_cli, training_cli
from specviz.core.errors import SpecvizError
from specviz.core.files import atomic_write
from specviz.core.verify import RULES, Sampling

EMBEDDED_SOURCE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF was quantised from
EXPORT_FORMATS = ("eagle", "eagle3", "speculators", "medusa")
VLLM = ("vllm serve {base} --speculative-config "
        "'{{\"method\": \"%s\", \"model\": \"{out}\", \"num_speculative_tokens\": %d}}'")
SGLANG = ("python -m sglang.launch_server --model-path {base} --speculative-algorithm %s "
          "--speculative-draft-model-path {out}")
SERVE = {  # (format, server) -> the command that serves an export (docs/serving.md: the loaders it was checked against)
    ("eagle", "vllm"): VLLM % ("eagle", 3), ("eagle", "sglang"): SGLANG % "EAGLE",
    ("eagle3", "vllm"): VLLM % ("eagle3", 3), ("eagle3", "sglang"): SGLANG % "EAGLE3",
    ("speculators", "vllm"): VLLM % ("eagle3", 3),
    ("medusa", "vllm"): VLLM % ("medusa", 4) + "  (vLLM 0.32.0 or older)",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF model id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA and on CPUs fast at it (AMX, AVX-512 BF16), else float32 (exact)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    _kernels_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rule", default="auto", choices=["auto", *RULES], help="acceptance rule (typical is lossy)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=ID_OR_DIR",
                   help="METHOD's checkpoint: a folder or model-hub id, specviz's own or a published EAGLE-1/2, "
                        "HASS, EAGLE-3, speculators or Medusa one (repeatable)")


def _kernels_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-pack", action="store_true",
                   help="on the CPU, run the target's linear layers on PyTorch's default kernels instead of "
                        "packed oneDNN weights (slower; for comparison)")
    p.add_argument("--engine", default="eager", choices=["eager", "compiled", "auto"],
                   help="the target's verify forwards: eager, or compiled once per process with torch.compile "
                        "(around the packed linear layers on a CPU, minutes on a small one the first time, "
                        "then cached; inductor's kernels on a GPU); "
                        "auto: compiled where this machine can, else eager")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz",
                                     description="Speculative decoding, one engine, many drafters.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with one method, tokens coloured by origin")
    _common(g)
    g.add_argument("--method", default="ar", help="method, optionally with settings: skip:layers=12:num_tokens=3")
    g.add_argument("--prompt", required=True)
    g.add_argument("--color", choices=["auto", "always", "never"], default="auto")

    b = sub.add_parser("bench", help="methods on a question set; writes results.json")
    _common(b)
    b.add_argument("--questions", default="mt-bench", help="mt-bench, humaneval or a question.jsonl path")
    b.add_argument("--methods", default="ar,pld", help="comma-separated; also hf, hf-pld (transformers generate)")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--per-category", type=int, default=None, help="the first N questions of each category")
    b.add_argument("--out", default="results.json")
    b.add_argument("--update-cards", action="store_true", help="record the results in the shipped checkpoints' cards")
    b.add_argument("--watchdog", type=float, default=900,
                   help="seconds on one prompt before printing every thread's stack")
    b.add_argument("--resume", action="store_true", help="continue a killed run of the same command where it stopped")
    b.add_argument("--part", default=None, metavar="K/N",
                   help="run the K-th of N blocks of the questions not yet done, in a log of its own (one process "
                        "per core); the command without --part, with --resume, takes the finished parts in")
    b.add_argument("--any-machine", action="store_true",
                   help="let --resume continue a log from another machine (τ-only runs: the speed figures mix)")
    b.add_argument("--batch-sizes", "--batch-size", default=None, metavar="B[,B...]",
                   help="decode the questions B at a time (continuous batching), each method beside AR at every B: "
                        "throughput, one sequence's speed and τ per batch size (apps.batching)")

    pr = sub.add_parser("profile", help="verify-cost curve: ms per target forward vs tokens verified")
    pr.add_argument("--target", default=None)
    pr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    pr.add_argument("--device", default=None)
    _kernels_arg(pr)
    pr.add_argument("--context", type=int, default=256)
    pr.add_argument("--max-size", type=int, default=64)
    pr.add_argument("--repeats", type=int, default=7)
    pr.add_argument("--tree", action="store_true", help="verify trees (a 4D mask) instead of chains")
    pr.add_argument("--no-floor", action="store_true", help="skip measuring this machine's bandwidth and matrix rate")
    pr.add_argument("--ops", action="store_true",
                    help="also profile where each size's time goes: matrix kernels, attention, other operators, and "
                         "outside any operator (Python, guards, launches)")
    pr.add_argument("--batch", type=int, default=1,
                    help="verify in this many sequences at once (one forward; the curve budgets at that batch size "
                         "are priced at; no floor)")
    pr.add_argument("--kernels", action="store_true",
                    help="measure again which CPU kernel (packed oneDNN or PyTorch's default) runs each row count of "
                         "the target's linear layers on this machine, and print the timings (cached otherwise)")
    pr.add_argument("--train", default=None, metavar="METHODS",
                    help="instead, time real training steps of these trained methods or variants (or all) by phase, "
                         "on a sample of the shared budget's sequences, with a whole run's projected time "
                         "(apps.train_profile)")
    pr.add_argument("--steps", type=int, default=5, help="--train: timed steps per method (after one warm-up)")
    pr.add_argument("--precision", default=None, choices=["bf16", "no", "auto"],
                    help="--train: bf16 autocast or fp32 (default: the shared budget's, bf16)")
    pr.add_argument("--out", default=None)

    rep = sub.add_parser("report", help="a results.json from bench as Markdown tables; --docs: docs/results.md")
    rep.add_argument("results", nargs="*", help="one file, or several runs of the same prompts and settings "
                                                "to report as one (each method from the first run that has it)")
    rep.add_argument("--docs", action="store_true",
                     help="regenerate docs/results.md from every results file committed in assets/bench")

    training_cli.add_parsers(sub)

    sw = sub.add_parser("sweep", help="speed and output quality against temperature, per acceptance rule")
    _common(sw)
    sw.add_argument("--questions", default="mt-bench")
    sw.add_argument("--per-category", type=int, default=1)
    sw.add_argument("--methods", default="medusa,redrafter")
    sw.add_argument("--temperatures", default="0,0.5,1")
    sw.add_argument("--rules", default="rejection,typical")
    sw.add_argument("--out", default="sweep.json")

    tu = sub.add_parser("tune", help="choose each method's draft budget for this machine (cached)")
    tu.add_argument("--target", default=None)
    tu.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    tu.add_argument("--device", default=None)
    _kernels_arg(tu)
    tu.add_argument("--methods", default="all", help="comma-separated, or all")
    tu.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    tu.add_argument("--export", default=None, metavar="DIR",
                    help="also copy the budgets into DIR, for a Space to ship (read via SPECVIZ_BUDGETS)")

    ex = sub.add_parser("export", help="write a drafter trained here in the layout vLLM and SGLang load")
    ex.add_argument("method", help="eagle2 or hass (--format eagle), eagle3 (eagle3, speculators), medusa (medusa)")
    ex.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    ex.add_argument("--out", required=True, help="the folder to write (config.json and safetensors)")
    ex.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the shipped one)")
    ex.add_argument("--target", default=None, help="the target it was trained for (default: embedded)")
    ex.add_argument("--base", default=None,
                    help="the target as the exported config names it, for the server to load (default: --target, "
                         f"or {EMBEDDED_SOURCE} for the embedded one)")
    ex.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ex.add_argument("--server", default="vllm", choices=["vllm", "sglang"],
                    help="where the two read a layout differently (EAGLE's class name, EAGLE-3's explicit layer ids)")

    sub.add_parser("methods", help="list the methods and their settings")
    experiment_cli.add_parser(sub)
    return parser


def _with_drafters(args, specs: list[str]) -> list[str]:
    """The method specs with the checkpoints ``--drafter`` names."""
    return with_checkpoints(specs, checkpoint_sources(args.drafter))


def _sampling(args) -> Sampling:
    return Sampling(temperature=args.temperature, top_p=args.top_p, rule=args.rule, seed=args.seed)


def _target(args):
    from specviz.core.load import load_target

    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    if getattr(args, "engine", "eager") != "eager":
        print(f"target forwards: {target.use_engine(args.engine)}", flush=True)
    return target


def cmd_generate(args) -> None:  # apps.generate
    from .generate import generate_and_report

    sampling = _sampling(args)
    if not args.prompt.strip():
        raise SpecvizError("the prompt is empty")
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    method = _with_drafters(args, [args.method])[0]
    generate_and_report(_target(args), method, args.prompt, args.max_new_tokens, sampling, colour)


def cmd_bench(args) -> None:  # apps.bench (the loop) and apps.runlog (its log, --part and --resume)
    from .cards import record_benchmark
    from .questions import load_questions
    from .report import summary_table
    from .runlog import bench_settings, check_resumable, finish_bench_log, logged_bench, open_bench_log
    from .tuning import resolved_budgets

    sampling = _sampling(args)
    methods = _with_drafters(args, [m for m in args.methods.split(",") if m.strip()])
    questions = load_questions(args.questions, args.limit, args.per_category)
    if args.batch_sizes:
        return _bench_batches(args, methods, questions, sampling)
    if args.resume and not args.part:
        check_resumable(Path(args.out))
    target = _target(args)
    settings = bench_settings(target, methods, questions, args.max_new_tokens, sampling, args.dtype)
    # a resume runs at the budgets its log recorded, not at what the tuner (or a lost cache) would choose now
    plan = open_bench_log(Path(args.out), questions, settings, lambda: resolved_budgets(target, methods), args.part,
                          args.resume, args.any_machine)
    result = logged_bench(target, methods, plan, args.max_new_tokens, sampling, args.resume, args.questions,
                          args.watchdog)
    print(summary_table(result))
    finish_bench_log(plan, result, args.part)
    if args.update_cards and not result.interrupted and not args.part:
        for folder in record_benchmark(result, args.out):
            print(f"updated {folder / 'card.json'}")


def _bench_batches(args, methods: list[str], questions, sampling) -> None:  # apps.batching
    from .batch_results import BatchSweep
    from .batching import batch_sweep
    from .methods import is_baseline, parse_method

    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise SpecvizError(f"--batch-sizes takes whole numbers, e.g. 1,2,4,8; got {args.batch_sizes!r}") from None
    if args.part or args.update_cards or any(is_baseline(parse_method(m)[0]) for m in methods):
        raise SpecvizError("--batch-sizes runs engine methods in one go: no --part, --update-cards, hf")
    done = BatchSweep.load(Path(args.out)) if args.resume and Path(args.out).exists() else None
    target = _target(args)
    sweep = batch_sweep(target, methods, questions, sizes, args.max_new_tokens, sampling, args.questions,
                        on_point=lambda s: s.save(Path(args.out)), done=done)  # a killed sweep keeps its points
    print(sweep.markdown())
    print(f"wrote {args.out}")


def cmd_profile(args) -> None:  # apps.profile, and apps.train_profile with --train
    from .profile import curve_text, kernels_text, profile

    if args.train is not None:  # an empty list is an error there, not the verify-cost profile
        return _profile_training(args)
    sizes = [1]
    while sizes[-1] * 2 <= args.max_size:
        sizes.append(sizes[-1] * 2)
    target = _target(args)
    if args.kernels:
        from specviz.core.kernels import choose

        choice = choose(target.model, refresh=True)
        print(kernels_text(choice) if choice else "no packed linear layers on this target: nothing to choose")
    result = profile(target, args.context, sizes, args.repeats, tree=args.tree,
                     floor=not args.no_floor and args.batch == 1, batch=args.batch, ops=args.ops)
    if args.kernels and choice:
        result["kernel_choice"] = asdict(choice)
    print(curve_text(result))
    if args.out:
        atomic_write(Path(args.out), json.dumps(result, indent=1))


def _profile_training(args) -> None:
    from specviz.core.load import load_target

    from .train_profile import profile_training
    from .training import drafters_to_train, training_classes

    names = drafters_to_train(args.train)
    target = load_target(args.target, "float32", args.device)  # training's target: fp32, features in the budget's
    result = profile_training(target, training_classes(names), args.steps, precision=args.precision)
    print(result.text())
    if args.out:
        atomic_write(Path(args.out), json.dumps(result.to_dict(), indent=1))


def cmd_report(args) -> None:  # apps.report
    from .report import report, write_results_doc

    if not args.results and not args.docs:
        raise SpecvizError("report takes one or more results files, or --docs")
    if args.results:
        print(report(args.results))
    if args.docs:
        print(f"wrote {write_results_doc()}")


def cmd_sweep(args) -> None:  # apps.sweep
    from .questions import load_questions
    from .sweep import sweep_to_file

    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise SpecvizError(f"--temperatures must be numbers separated by commas, got {args.temperatures!r}") from None
    questions = load_questions(args.questions, per_category=args.per_category)
    methods = _with_drafters(args, args.methods.split(","))
    sweep_to_file(_target(args), methods, questions, temperatures, args.rules.split(","), args.max_new_tokens,
                  args.seed or 0, Path(args.out))
    print(f"wrote {args.out}")


def cmd_tune(args) -> None:  # apps.tuning
    from .tuning import tune_and_report

    names = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in names:
        if name not in METHODS:
            raise SpecvizError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    tune_and_report(_target(args), names, args.refresh, Path(args.export) if args.export else None)


def cmd_export(args) -> None:  # drafters.published
    from drafters.published import export
    from specviz.core.load import load_target

    target = load_target(args.target, "float32", "cpu", pack=False)  # read for its head, embedding and shape
    base = args.base or args.target or EMBEDDED_SOURCE
    done = export(args.method, args.checkpoint, args.format, Path(args.out), target, base, args.dtype, args.server)
    print(f"wrote {', '.join(done.files)} to {done.folder}")
    notes = list(done.notes)
    if not args.target and not args.base:
        notes.append(f"the embedded target is a Q4_1 GGUF of {EMBEDDED_SOURCE}, dequantized; the drafter was "
                     "trained on that, and serves best beside the same weights")
    for note in notes:
        print(f"note: {note}")
    print(f"serve it: {SERVE[args.format, args.server].format(out=done.folder, base=base)}")


def cmd_methods(_args) -> None:
    from dataclasses import fields

    for name, (cls, settings_cls) in METHODS.items():
        opts = ", ".join(f"{f.name}={f.default!r}" for f in fields(settings_cls))
        print(f"{name:10} {cls.title}" + (f"  [{opts}]" if opts else ""))


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "profile": cmd_profile, "report": cmd_report,
            "methods": cmd_methods, "tune": cmd_tune, "sweep": cmd_sweep, "export": cmd_export,
            "train": training_cli.cmd_train, "data": training_cli.cmd_data, "validate": training_cli.cmd_validate,
            "experiment": experiment_cli.cmd_experiment}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except SpecvizError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
