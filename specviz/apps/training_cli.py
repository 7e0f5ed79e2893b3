"""The training commands' arguments and handlers (``data``, ``train``, ``validate``; ``cli`` registers them).
The work is in ``apps.training`` and the pipeline in ``drafters.training``."""

from __future__ import annotations

import argparse
import sys

from drafters import METHODS
from drafters.training.sharegpt import DOMAINS


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
    p.add_argument("--domain", default="", choices=["", *DOMAINS],
                   help="a slice of the prompts by a stated rule (drafters/training/sharegpt.py); default: all")


def add_parsers(sub) -> None:
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
    t.add_argument("--joint", action="store_true",
                   help="train a LoRA on the target with the drafter (semi-AR joint training; docs/training.md)")
    t.add_argument("--lambda", dest="lam", type=float, default=0.25,
                   help="joint training: the drafter loss's weight (1 = separate training)")
    t.add_argument("--lora-rank", type=int, default=8, help="joint training: the LoRA's rank")

    v = sub.add_parser("validate", help="checkpoints' agreement per depth on the held-out split of a data recipe")
    v.add_argument("--drafter", required=True, help="a trained method, a comma-separated list, or all")
    _data_args(v)
    v.add_argument("--feature-dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    v.add_argument("--checkpoint", default=None, help="checkpoint folder (one drafter; default: the shipped one)")
    v.add_argument("--batch-tokens", type=int, default=4096)
    v.add_argument("--out", default=None, help="also write the figures to this JSON file")


def _recipe(args, device: str):
    import torch

    from .training import data_recipe

    recipe = data_recipe(args.samples, not args.no_self_distill, args.max_prompt_tokens, args.answer_tokens,
                         args.distill_batch, args.prompts, args.distill_dtype, getattr(args, "feature_dtype", None),
                         device, args.domain)  # train and validate read features; data does not
    _warn_slow_bf16(device, distillation=recipe.distill_dtype == torch.bfloat16 and recipe.self_distilled,
                    features=recipe.feature_dtype == torch.bfloat16)
    return recipe


def _warn_slow_bf16(device: str, **steps: bool) -> None:
    """Say so where a step the user set to bf16 runs on a CPU where bf16 products take a slow path."""
    from specviz.core.load import slow_bf16

    named = [name for name, bf16 in steps.items() if bf16]
    if named and slow_bf16(device):
        print(f"warning: {' and '.join(named)} in bf16 on a CPU without AMX or AVX-512 BF16: bf16 matrix products "
              "take a slow path here, several times fp32's time (float32 is faster on this CPU)", file=sys.stderr)


def cmd_data(args) -> None:  # apps.training
    from specviz.core.load import default_device

    from .training import build_data

    device = args.device or default_device()
    build_data(args.target, device, _recipe(args, device), args.ship)


def cmd_train(args) -> None:  # apps.training
    from drafters.training.config import TrainConfig
    from drafters.training.joint import JointOptions
    from specviz.core.load import default_device

    from .training import drafters_to_train, train_drafters

    names = drafters_to_train(args.drafter)
    device = args.device or default_device()
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, draft_vocab=args.draft_vocab,
                      seed=args.seed, device=device, precision=args.precision, save_every=args.save_every,
                      validate_every=args.validate_every)
    joint = JointOptions(args.lam, args.lora_rank) if args.joint else None
    _warn_slow_bf16(device, training=cfg.mixed_precision == "bf16")
    train_drafters(names, args.target, _recipe(args, device), cfg, args.out, args.resume, args.ship, joint)


def cmd_validate(args) -> None:  # apps.training
    from specviz.core.load import default_device

    from .training import drafters_to_train, validate_drafters

    names = drafters_to_train(args.drafter)
    device = args.device or default_device()
    validate_drafters(names, args.target, device, _recipe(args, device), args.checkpoint, args.batch_tokens, args.out)
