"""Command line: ``python -m specviz {generate,bench,profile,report,data,train,validate,tune,sweep,methods}``."""

from __future__ import annotations

import argparse
import faulthandler
import glob
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from drafters import METHODS, build_drafter
from specviz.core.errors import SpecvizError
from specviz.core.verify import RULES, Sampling

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"


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


def _kernels_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-pack", action="store_true",
                   help="on the CPU, run the target's linear layers on PyTorch's default kernels instead of "
                        "packed oneDNN weights (slower; for comparison)")


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--samples", default="1000", help="ShareGPT prompts for training, or 'all'")
    p.add_argument("--prompts", default="first", choices=["first", "all"],
                   help="first: conversations opened by a human; all: every chunk's first human turn")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--answer-tokens", type=int, default=256, help="max tokens per training answer")
    p.add_argument("--no-self-distill", action="store_true", help="train on ShareGPT's answers, not the target's own")
    p.add_argument("--distill-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="precision the target writes its answers in (auto: bfloat16 where it is fast)")
    p.add_argument("--distill-batch", type=int, default=32, help="prompts per self-distillation batch")


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

    pr = sub.add_parser("profile", help="verify-cost curve: ms per target forward vs tokens verified")
    pr.add_argument("--target", default=None)
    pr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    pr.add_argument("--device", default=None)
    _kernels_arg(pr)
    pr.add_argument("--context", type=int, default=256)
    pr.add_argument("--max-size", type=int, default=64)
    pr.add_argument("--repeats", type=int, default=7)
    pr.add_argument("--tree", action="store_true", help="verify trees (a 4D mask) instead of chains")
    pr.add_argument("--out", default=None)

    rep = sub.add_parser("report", help="a results.json from bench as a Markdown table")
    rep.add_argument("results", nargs="+", help="one file, or several runs of the same prompts and settings "
                                                "to report as one (each method from the first run that has it)")

    d = sub.add_parser("data", help="build the training sequences (self-distilled in resumable shards)")
    _data_args(d)
    d.add_argument("--ship", action="store_true", help="also write them, compressed, into assets/data")

    t = sub.add_parser("train", help="train a drafter with the shared pipeline; writes a checkpoint + card")
    t.add_argument("--drafter", required=True,
                   help="a trained method, a comma-separated list, or all: "
                        + ", ".join(n for n, (c, _) in METHODS.items() if c.trained))
    _data_args(t)
    t.add_argument("--feature-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="the target's dtype while extracting features (auto: bf16 where the hardware is fast at it)")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0 = full)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--precision", default="no", choices=["no", "bf16", "auto"],
                   help="bf16 autocast, or fp32 (no); auto: bf16 where the hardware is fast at it")
    t.add_argument("--save-every", type=int, default=100, help="steps between saved training states")
    t.add_argument("--validate-every", type=int, default=0,
                   help="steps between validations within an epoch (0: after each epoch only)")
    t.add_argument("--resume", action="store_true",
                   help="continue each run from its last saved state (a finished run is reused, a new one starts)")
    t.add_argument("--out", default=None,
                   help="checkpoint folder (default: the run's folder in the cache)")
    t.add_argument("--ship", action="store_true",
                   help="then copy the final checkpoint into assets/drafters/NAME (weights xz-compressed)")

    v = sub.add_parser("validate", help="checkpoints' agreement per depth on the held-out split of a data recipe")
    v.add_argument("--drafter", required=True, help="a trained method, a comma-separated list, or all")
    _data_args(v)
    v.add_argument("--feature-dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    v.add_argument("--checkpoint", default=None, help="checkpoint folder (one drafter; default: the shipped one)")
    v.add_argument("--batch-tokens", type=int, default=4096)
    v.add_argument("--out", default=None, help="also write the figures to this JSON file")

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

    sub.add_parser("methods", help="list the methods and their settings")
    return parser


def _sampling(args) -> Sampling:
    return Sampling(temperature=args.temperature, top_p=args.top_p, rule=args.rule, seed=args.seed)


def stream_coloured(target, steps, enabled: bool, out=None) -> list:
    """Print each step's tokens as they arrive (accepted drafts green, target tokens yellow)."""
    out = out or sys.stdout
    records, ids, shown = [], [], ""
    try:
        for record in steps:
            records.append(record)
            for i, tok in enumerate(record.tokens):
                ids.append(tok)
                text = target.decode(ids)
                piece, shown = text[len(shown):] if text.startswith(shown) else target.decode([tok]), text
                colour = GREEN if i < record.accepted else YELLOW
                out.write(f"{colour}{piece}{RESET}" if enabled else piece)
            out.flush()
    except KeyboardInterrupt:  # keep what was generated and still report it
        out.write("\n[stopped]")
    out.write("\n")
    return records


def cmd_generate(args) -> None:
    from specviz.core.engine import check_request, generate
    from specviz.core.load import load_target
    from specviz.core.metrics import acceptance_by_depth, extra_memory_pct, summarize

    from .bench import parse_method
    from .tuning import resolve

    sampling = _sampling(args)
    if not args.prompt.strip():
        raise SpecvizError("the prompt is empty")
    name, settings = parse_method(args.method)
    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    settings, tuned = resolve(target, name, settings)
    if tuned is not None:
        print(f"budget for this machine: {tuned.describe()}", flush=True)
    drafter = build_drafter(name, target, **settings)
    ids = target.encode_chat(args.prompt)
    check_request(target, ids, args.max_new_tokens)
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    records = stream_coloured(target, generate(target, drafter, ids, args.max_new_tokens, sampling), colour)
    m = summarize(records)  # engine time only: printing is not charged to the method
    print()
    if colour:
        print(f"legend: {GREEN}accepted draft token{RESET}  {YELLOW}target token (bonus / correction){RESET}")
    print(f"method {args.method}: {m.new_tokens} tokens in {m.wall_s:.2f} s = {m.tokens_per_s:.1f} tok/s, "
          f"{m.steps} target forwards after prefill")
    print(f"tau (tokens per target forward, bonus included) = {m.tau:.2f}; mean draft tree size {m.mean_tree_size:.1f}"
          + ("" if m.mean_compression is None else f"; beam compression {m.mean_compression:.2f}"))
    print("latency per token (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in m.latency_ms.items()))
    rule = sampling.resolved_rule
    print(f"acceptance rule: {rule}"
          + ("" if sampling.lossless else " (LOSSY: the output distribution is not the target's)"))
    print(f"extra memory: {extra_memory_pct(drafter.num_parameters(), target.num_parameters):.1f}% "
          "of target parameters")
    for depth, (c, u) in enumerate(zip(*acceptance_by_depth(records)), start=1):
        print(f"  alpha depth {depth}: conditional {c:.3f} (accepted / steps reaching depth), "
              f"unconditional {u:.3f} (accepted / all steps)")


def _bench_log(args, out: Path, questions: list, settings: dict, resolve: Callable[[], dict]):
    """This bench's run log, output, questions and budgets (``resolve()`` when no log fixes them). ``--part K/N``
    runs the K-th of N blocks of the questions the full run has not logged yet, in a log of its own at the full
    run's budgets; the full command with ``--resume`` takes finished parts in (``RunLog.absorb``), so a τ bench
    can run one process per core."""
    from .runlog import RunLog

    ignore = ("machine",) if args.any_machine else ()
    log = RunLog(out.with_name(out.name + ".runs"), settings, ignore)
    if not args.part:
        if not args.resume:
            return log, out, questions, resolve()
        parts = sorted(out.parent.glob(f"{glob.escape(out.name)}.part*-of-*.runs"))
        if parts and not log.path.exists():  # only parts ran: their budgets are the run's
            first = RunLog(parts[0], settings, ignore).on_file()[0]
            log.check(first, but=("questions", "budgets"), source=parts[0])
            log.settings["budgets"] = first["budgets"]
            log.start()
        log.settings["budgets"] = log.budgets()
        for part in log.absorb(parts):
            part.unlink()
            out.with_name(part.name.removesuffix(".runs")).unlink(missing_ok=True)
            print(f"took in {part.name}")
        return log, out, questions, log.settings["budgets"]
    try:
        k, n = (int(x) for x in args.part.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise SpecvizError(f"--part takes K/N with 1 <= K <= N, got {args.part!r}") from None
    out = out.with_name(f"{out.name}.part{k}-of-{n}")
    part = RunLog(out.with_name(out.name + ".runs"), dict(settings), ignore)
    if args.resume:  # this part's own questions, however far the full run has got since
        ids = set(part.on_file()[0]["questions"])
        block, budgets = [q for q in questions if q.id in ids], part.budgets()
    else:
        if not log.path.exists():  # the first part to get here writes the full run's log: all run at its budgets
            log.settings["budgets"] = resolve()
            log.start(exclusive=True)
        done, budgets = len(log.on_file()[1]), log.budgets()
        size = -(-(len(questions) - done) // n)
        block = questions[done + (k - 1) * size : done + k * size]
        if not block:
            raise SpecvizError(f"part {k} of {n} has no questions: {len(questions) - done} are left to run")
    part.settings["questions"] = [q.id for q in block]
    return part, out, block, budgets


def cmd_bench(args) -> None:
    from specviz.core.load import load_target

    from .bench import bench, exactness_text, machine_fingerprint, record_benchmark, resolved_budgets, save_results
    from .questions import load_questions

    sampling = _sampling(args)
    methods = [m for m in args.methods.split(",") if m.strip()]
    questions = load_questions(args.questions, args.limit, args.per_category)
    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    out = Path(args.out)
    settings = {
        "methods": methods, "questions": [q.id for q in questions], "max new tokens": args.max_new_tokens,
        "sampling": [sampling.temperature, sampling.top_p, sampling.resolved_rule], "target": target.name,
        "dtype": args.dtype, "device": str(target.device), "machine": machine_fingerprint()
        + ("" if target.kernels == "default" else "; packed linear weights")}  # kernels change speed as a machine does
    # a resume runs at the budgets its log recorded, not at what the tuner (or a lost cache) would choose now
    log, out, questions, budgets = _bench_log(args, out, questions, settings, lambda: resolved_budgets(target, methods))
    log.settings["budgets"] = budgets
    runs = log.resume() if args.resume else {}
    if args.resume:
        print(f"resuming: {len(runs.get('ar', []))} of {len(questions)} prompts already done")
    else:
        log.start()

    logged = len(runs.get("ar", []))

    def save(results: dict) -> None:  # after every prompt, so a killed run keeps what it finished
        nonlocal logged
        results["questions"] = args.questions
        save_results(out, results)
        for i in range(logged, len(runs["ar"])):
            log.append({label: r[i] for label, r in runs.items()})
        logged = len(runs["ar"])
        watchdog()

    def watchdog() -> None:  # a prompt stuck past --watchdog seconds prints where every thread is
        faulthandler.dump_traceback_later(args.watchdog, repeat=True, file=sys.__stderr__)

    watchdog()
    try:
        results = bench(target, methods, questions, args.max_new_tokens, sampling, on_prompt=save, runs=runs,
                        budgets=budgets)
    finally:
        faulthandler.cancel_dump_traceback_later()
    save(results)
    faulthandler.cancel_dump_traceback_later()
    print(f"{'method':28} {'tau':>6} {'tok/s':>7} {'speedup':>8} {'identical':>10}")
    for label, m in results["methods"].items():
        tau = f"{m['tau']:.2f}" if "tau" in m else "-"
        print(f"{label:28} {tau:>6} {m['tokens_per_s']:7.1f} {m['speedup']:7.2f}x {exactness_text(m):>10}")
    if results["interrupted"]:
        print(f"interrupted: kept the {len(results['per_prompt'])} prompts every method finished; "
              "the same command with --resume goes on from there")
    elif args.part:
        print(f"part {args.part} done: the command without --part, with --resume, takes it in")
    else:
        log.remove()
    print(f"wrote {out}")
    if args.update_cards and not results["interrupted"] and not args.part:
        for folder in record_benchmark(results, args.out):
            print(f"updated {folder / 'card.json'}")


def cmd_profile(args) -> None:
    from specviz.core.load import load_target

    from .profile import profile

    sizes = [1]
    while sizes[-1] * 2 <= args.max_size:
        sizes.append(sizes[-1] * 2)
    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    result = profile(target, args.context, sizes, args.repeats, tree=args.tree)
    print(f"verify cost of a {result['shape']} on {result['machine']} ({result['dtype']}, "
          f"{args.context} cached tokens):")
    for row in result["curve"]:
        print(f"  {row['tokens']:3d} tokens: {row['ms']:7.1f} ms  ({row['relative_to_1']:.2f}x one token)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def markdown_table(results: dict) -> str:
    """τ, α, speed and equality per method, in the README's format."""
    from .bench import exactness_text, markdown_rows

    lines = []
    for label, m in results["methods"].items():
        tau = f"{m['tau']:.2f}" if "tau" in m else "–"
        cond = " / ".join(f"{a:.2f}" for a in m.get("alpha_conditional", [])[:4]) or "–"
        uncond = " / ".join(f"{a:.2f}" for a in m.get("alpha_unconditional", [])[:4]) or "–"
        lat = " · ".join(f"{v:.1f}" for v in m["latency_ms"].values()) if "latency_ms" in m else "–"
        lines.append(f"| `{label}` | {tau} | {cond} | {uncond} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}× "
                     f"| {exactness_text(m)} | {lat} |")
    return markdown_rows(["method", "τ", "α_1..4 conditional", "α_1..4 unconditional", "tok/s", "speedup vs ar",
                          "identical to AR", "ms/token draft · verify · accept · other"], lines)


def budget_table(results: dict) -> str:
    """Each tuned method's expected figures next to the measured ones ('' when none was tuned)."""
    from .bench import markdown_rows

    rows = []
    for label, m in results["methods"].items():
        b = m.get("budget") or {}
        if not b.get("tuned"):
            continue
        settings = ", ".join(f"{k} {v}" for k, v in b["settings"].items() if k != "checkpoint")
        want, got = b.get("expected_ms_per_token", {}), m.get("latency_ms", {})
        split = (" · ".join(f"{want[k]:.1f}" for k in ("draft", "verify", "accept+other")) + " / "
                 + " · ".join(f"{v:.1f}" for v in (got["draft"], got["verify"], got["accept"] + got["other"]))
                 if want and got else "–")
        rows.append(f"| `{label}` | {settings} | {b['expected_tau']:.2f} / {m.get('tau', float('nan')):.2f} "
                    f"| {b['expected_speedup']:.2f}× / {m['speedup']:.2f}× | {split} |")
    return markdown_rows(["method", "tuned budget", "τ expected / measured", "speedup expected / measured",
                          "ms/token draft · verify · accept+other, expected / measured"], rows)


def cmd_report(args) -> None:
    from .bench import load_results, merge_results
    from .orderings import ordering_table

    results = merge_results([load_results(Path(p)) for p in args.results], args.results)
    if len(args.results) > 1:
        print("merged from " + ", ".join(args.results) + " (speeds compare within one run only)")
    print(f"{results.get('questions', '?')}, {len(results['per_prompt'])} prompts, "
          f"{results['max_new_tokens']} new tokens, "
          f"{results['dtype']}, {results['sampling']['rule']}; {results['machine']}, {results['date']}"
          + (f"; linear layers on {results['linear_kernels']} kernels (`hf` on the default ones)"
             if results.get("linear_kernels", "default") != "default" else "") + "\n")
    print(markdown_table(results))
    budgets = budget_table(results)
    if budgets:
        print("\nTuned budgets, expected against measured:\n\n" + budgets)
    orderings = ordering_table(results)
    if orderings:
        print("\nThe papers' orderings, at equal budgets:\n\n" + orderings)


def _recipe(args, device: str):
    from drafters.corpus import DataRecipe
    from specviz.core.load import resolve_dtype_or_auto

    samples = None if args.samples == "all" else int(args.samples) if args.samples.isdigit() else 0
    if samples is not None and samples < 1:
        raise SpecvizError(f"--samples must be a positive number or 'all', got {args.samples!r}")
    feature_dtype = getattr(args, "feature_dtype", None)  # train and validate read features; data does not
    return DataRecipe(samples, not args.no_self_distill, args.max_prompt_tokens, args.answer_tokens,
                      batch_size=args.distill_batch, prompts=args.prompts,
                      distill_dtype=resolve_dtype_or_auto(args.distill_dtype, device),
                      feature_dtype=resolve_dtype_or_auto(feature_dtype, device) if feature_dtype else None)


def cmd_data(args) -> None:
    from drafters.corpus import SHIPPED_SEQUENCES, prepare_sequences, save_sequences
    from specviz.core.load import cache_dir, default_device, load_target

    device = args.device or default_device()
    recipe = _recipe(args, device)
    target = load_target(args.target, "float32", device)
    splits = prepare_sequences(target, recipe, cache_dir() / "train")
    tokens = {name: sum(int(s.numel()) - a for s, a in seqs) for name, seqs in splits.items()}
    print(f"sequences {recipe.key(target)}: {len(splits['train'])} train ({tokens['train']:,} answer tokens), "
          f"{len(splits['val'])} validation, in {cache_dir() / 'train'}")
    if args.ship:
        path = SHIPPED_SEQUENCES / f"sequences-{recipe.key(target)}.safetensors.xz"
        save_sequences(path, splits, recipe.card(target))
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def _drafters_to_train(spec: str) -> list[str]:
    trained = [n for n, (c, _) in METHODS.items() if c.trained]
    names = trained if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    wrong = [n for n in names if n not in trained]
    if wrong or not names:
        raise SpecvizError(f"{', '.join(wrong) or spec!r} is not a trained drafter; choose from "
                           f"{', '.join(trained)} (or a comma-separated list, or all)")
    return names


def cmd_train(args) -> None:
    """Train one drafter, a list, or all of them at one equal budget (same data, config and epochs)."""
    import hashlib
    import shutil

    import torch

    from drafters.checkpoint import CARD, ship_checkpoint
    from drafters.corpus import prepare
    from drafters.train import OUTSIDE_RUN_KEY, TrainConfig, make_accelerator, saved_state, train
    from specviz.core.load import cache_dir, default_device, load_target

    names = _drafters_to_train(args.drafter)
    if args.out and len(names) > 1:
        raise SpecvizError("--out names one checkpoint folder; train several drafters without it")
    device = args.device or default_device()
    recipe = _recipe(args, device)
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, draft_vocab=args.draft_vocab,
                      seed=args.seed, device=device, precision=args.precision, save_every=args.save_every,
                      validate_every=args.validate_every)
    if torch.device(device).type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the CPU only batches for a GPU: more threads slowed one H200 run (61 vs 85
        # steps/s) and stalled seven runs sharing 16 cores (2 s a step)
    accelerator = make_accelerator(cfg)  # one process per device under `accelerate launch`
    target = load_target(args.target, "float32", str(accelerator.device))
    taps_all = all(METHODS[name][0].tapped_layers(target.num_layers) for name in names)  # each runs the body itself
    train_set, val_set, meta = prepare(target, recipe, cache=cache_dir() / "train", features=not taps_all)
    for name in names:
        config = {k: v for k, v in vars(cfg).items() if k not in OUTSIDE_RUN_KEY}
        objective = getattr(METHODS[name][0], "loss", None)  # a changed objective is another run
        run = json.dumps([name, recipe.features_key(target), config, objective], sort_keys=True, default=str)
        work = cache_dir() / "train" / "runs" / f"{name}-{hashlib.sha1(run.encode()).hexdigest()[:12]}"
        finished = work / "checkpoint"
        out = Path(args.out) if args.out else finished
        if args.resume and (finished / CARD).exists():  # trained to the end before: reuse it
            if out != finished:
                shutil.copytree(finished, out, dirs_exist_ok=True)
            print(f"{name}: finished before, in {finished}" + (f"; copied to {out}" if out != finished else ""))
        else:
            saved = saved_state(work) is not None
            if args.resume and not saved:
                print(f"{name}: no saved state in {work}; starting it", flush=True)
            card = train(METHODS[name][0], target, train_set, val_set, cfg, meta, out, work, args.resume and saved,
                         accelerator)
            if out != finished and accelerator.is_main_process:  # the run folder keeps the final one too
                shutil.copytree(out, finished, dirs_exist_ok=True)
            print(f"wrote {out} ({card['parameters']['trained']:,} trained parameters, "
                  f"{card['training']['steps']} steps in {card['training']['wall_s']:.0f} s); "
                  f"validation {card['history'][-1]['val']}")
        if args.ship and accelerator.is_main_process:
            print(f"shipped {name} to {ship_checkpoint(finished, name)}")


def cmd_validate(args) -> None:
    """Agreement per depth of existing checkpoints on a recipe's held-out prompts, measured as training does:
    compare checkpoints trained on different data on one split."""
    from drafters.corpus import validation_set
    from drafters.train import TrainConfig, depths, validate_checkpoint
    from specviz.core.load import cache_dir, default_device, load_target

    names = _drafters_to_train(args.drafter)
    if args.checkpoint and len(names) > 1:
        raise SpecvizError("--checkpoint names one checkpoint folder; validate several drafters without it")
    device = args.device or default_device()
    recipe = _recipe(args, device)
    target = load_target(args.target, "float32", device)
    val_set, meta = validation_set(target, recipe, cache_dir() / "train")
    cfg = TrainConfig(batch_tokens=args.batch_tokens, device=device)
    folder, results = Path(args.checkpoint) if args.checkpoint else None, {}
    print(f"held-out split {recipe.features_key(target)}: {len(val_set)} prompts")
    for name in names:
        results[name] = validate_checkpoint(METHODS[name][0], target, folder, val_set, meta, cfg)
        print(f"{name:10} agreement by depth {depths(results[name])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"split": recipe.features_key(target), "prompts": len(val_set),
                                              "validation": results}, indent=2) + "\n")


def cmd_sweep(args) -> None:
    from specviz.core.load import load_target

    from .bench import machine_description
    from .questions import load_questions
    from .sweep import sweep

    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise SpecvizError(f"--temperatures must be numbers separated by commas, got {args.temperatures!r}") from None
    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    questions = load_questions(args.questions, per_category=args.per_category)
    rows = []
    for rows in sweep(target, args.methods.split(","), questions, temperatures, args.rules.split(","),
                      args.max_new_tokens, args.seed or 0):
        Path(args.out).write_text(json.dumps({"machine": machine_description(), "dtype": str(target.dtype),
                                              "rows": rows}, indent=1))
        last = rows[-1]
        print(f"T={last['temperature']} {last['rule']}: " + ", ".join(
            f"{r['method']} {r['speedup']:.2f}x ll {r['log_likelihood']:.3f}" for r in rows
            if r["temperature"] == last["temperature"] and r["rule"] == last["rule"]), flush=True)
    print(f"wrote {args.out}")


def cmd_tune(args) -> None:
    from specviz.core.load import load_target

    from .tuning import machine_costs, tune

    target = load_target(args.target, args.dtype, args.device, pack=not args.no_pack)
    names = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in names:
        if name not in METHODS:
            raise SpecvizError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    costs = machine_costs(target, args.refresh)
    for shape, curve in (("chain", costs.chain), ("tree", costs.tree)):
        print(f"verify cost of a {shape}, fitted non-decreasing ({str(target.dtype).replace('torch.', '')}, "
              f"{target.device}): "
              + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in zip(curve.tokens, curve.ms)))
    print(f"AR's own per-step overhead {costs.ar_other_ms:.1f} ms")
    for shape, pad in target.padding.items():
        print(f"{shape}s padded to a size this machine verifies faster: "
              + (", ".join(f"{n} -> {m}" for n, m in pad.items()) or "none"))
    for name in names:
        try:
            tuned = tune(target, name, refresh=args.refresh)
        except SpecvizError as e:
            print(f"{name}: not tuned ({e})")
            continue
        took = f"  [tuned in {tuned.seconds:.1f} s]" if tuned.seconds else "" if not tuned.settings else "  [cached]"
        print(tuned.describe() + took)


def cmd_methods(_args) -> None:
    from dataclasses import fields

    for name, (cls, settings_cls) in METHODS.items():
        opts = ", ".join(f"{f.name}={f.default!r}" for f in fields(settings_cls))
        print(f"{name:10} {cls.title}" + (f"  [{opts}]" if opts else ""))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": cmd_generate, "bench": cmd_bench, "profile": cmd_profile,
                    "report": cmd_report, "methods": cmd_methods, "train": cmd_train, "data": cmd_data,
                    "tune": cmd_tune, "sweep": cmd_sweep, "validate": cmd_validate}
        commands[args.command](args)
    except SpecvizError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
