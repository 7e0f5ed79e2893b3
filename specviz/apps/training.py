"""The training commands: build the sequences (``data``), train drafters at one budget (``train``), and measure
checkpoints on a recipe's held-out split (``validate``). The pipeline itself is ``drafters.training``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from drafters import METHODS
from specviz.core.errors import SpecvizError
from specviz.core.files import atomic_write
from specviz.core.load import cache_dir, load_target, resolve_dtype_or_auto


def data_recipe(samples: str, self_distill: bool, max_prompt_tokens: int, answer_tokens: int, distill_batch: int,
                prompts: str, distill_dtype: str, feature_dtype: str | None, device: str, domain: str = ""):
    """The data recipe the arguments name (``samples``: a positive number or 'all')."""
    from drafters.training.sequences import DataRecipe

    count = None if samples == "all" else int(samples) if samples.isdigit() else 0
    if count is not None and count < 1:
        raise SpecvizError(f"--samples must be a positive number or 'all', got {samples!r}")
    return DataRecipe(count, self_distill, max_prompt_tokens, answer_tokens, batch_size=distill_batch,
                      prompts=prompts, distill_dtype=resolve_dtype_or_auto(distill_dtype, device),
                      feature_dtype=resolve_dtype_or_auto(feature_dtype, device) if feature_dtype else None,
                      domain=domain)


def drafters_to_train(spec: str) -> list[str]:
    """'all' (the trained methods), or one trained method or variant (``drafters.variants``), or a
    comma-separated list of them ('all' among them: every trained method, then the others)."""
    from drafters.variants import trained_names

    trained = [n for n, (c, _) in METHODS.items() if c.trained]
    asked = [n.strip() for n in spec.split(",") if n.strip()]
    names = list(dict.fromkeys(m for n in asked for m in (trained if n == "all" else [n])))
    wrong = [n for n in names if n not in trained_names()]
    if wrong or not names:
        named = ", ".join(map(repr, wrong)) or repr(spec)
        what = "are not trained drafters" if len(wrong) > 1 else "is not a trained drafter"
        raise SpecvizError(f"{named} {what}; choose from "
                           f"{', '.join(trained)} (or a comma-separated list, or all), or a variant: "
                           f"{', '.join(trained_names()[len(trained):])}")
    return names


def build_data(target_spec: str | None, device: str, recipe, ship: bool) -> None:
    from drafters.training.sequences import SHIPPED_SEQUENCES, prepare_sequences, save_sequences

    target = load_target(target_spec, "float32", device)
    splits = prepare_sequences(target, recipe, cache_dir() / "train")
    tokens = {name: sum(int(s.numel()) - a for s, a in seqs) for name, seqs in splits.items()}
    print(f"sequences {recipe.key(target)}: {len(splits['train'])} train ({tokens['train']:,} answer tokens), "
          f"{len(splits['val'])} validation, in {cache_dir() / 'train'}")
    if ship:
        path = SHIPPED_SEQUENCES / f"sequences-{recipe.key(target)}.safetensors.xz"
        save_sequences(path, splits, recipe.card(target))
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def training_classes(names, joint=None) -> dict:
    """Each name's training class: a trained method's or a variant's (``drafters.variants``), wrapped for joint
    training (``JointOptions``) where ``joint`` is given."""
    from drafters.training.joint import joint_class
    from drafters.variants import trained_class

    classes = {name: trained_class(name) for name in names}
    return classes if joint is None else {name: joint_class(cls, joint) for name, cls in classes.items()}


def run_folder(name: str, cls, features_key: str, cfg) -> Path:
    """Where a training run of ``name`` lives in the cache: named by everything that determines its weights
    (``run_key``: data, settings, objective, network), so a later call finds the same run again."""
    from drafters.training.config import run_key

    return cache_dir() / "train" / "runs" / f"{cls.variant_name or name}-{run_key(cls, features_key, cfg)}"


def run_prefix(cls, features_key: str, cfg) -> Path | None:
    """Where a run of ``cls`` finds or writes the first steps it shares with other arms
    (``drafters.training.prefix``); None when its objective shares none."""
    from drafters.training.prefix import prefix_folder

    return prefix_folder(cls, features_key, cfg, cache_dir() / "train" / "prefixes")


def prepare_data(classes, target, recipe, joint=None):
    """The recipe's sequences, with the target's features where one of ``classes`` reads them stored (EAGLE-3
    and joint training run the target's body themselves; the heads read none): (train, validation, meta)."""
    from drafters.training.dataset import prepare

    stored = joint is None and any(c.reads_features and not c.tapped_layers(target.num_layers) for c in classes)
    return prepare(target, recipe, cache=cache_dir() / "train", features=stored)


def train_drafters(names: list[str], target_spec, recipe, cfg, out: str | None, resume: bool,
                   ship: bool, joint=None) -> dict[str, Path]:
    """Train each of ``names`` at one equal budget (same data, config and epochs), each in a run folder named by
    everything that determines it, so ``resume`` finds a finished or saved run again; returns each one's finished
    checkpoint folder. ``target_spec``: a name or folder, or a loaded target; ``joint`` (``JointOptions``): train a
    LoRA on the target with each (``drafters.training.joint``)."""
    from drafters.checkpoint import CARD, ship_checkpoint
    from drafters.training.loop import make_accelerator, train
    from drafters.training.state import saved_state

    if out and len(names) > 1:
        raise SpecvizError("--out names one checkpoint folder; train several drafters without it")
    variants = [n for n in names if n not in METHODS or joint is not None]
    if ship and variants:
        raise SpecvizError(f"{', '.join(variants)}: a variant is not shipped as a method (its experiment's results "
                           "are); train it without --ship")
    if torch.device(cfg.device).type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the CPU only batches for a GPU: more threads slowed a lone run, and
        # several runs sharing one host's cores starved each other
    accelerator = make_accelerator(cfg)  # one process per device under `accelerate launch`
    target = target_spec if hasattr(target_spec, "model") else load_target(target_spec, "float32",
                                                                           str(accelerator.device))
    classes = training_classes(names, joint)
    train_set, val_set, meta = prepare_data(classes.values(), target, recipe, joint)
    folders = {}
    for name in names:
        work = run_folder(name, classes[name], recipe.features_key(target), cfg)
        finished = work / "checkpoint"
        folder = Path(out) if out else finished
        if resume and (finished / CARD).exists():  # trained to the end before: reuse it
            if folder != finished:
                shutil.copytree(finished, folder, dirs_exist_ok=True)
            print(f"{name}: finished before, in {finished}" + (f"; copied to {folder}" if folder != finished else ""))
        else:
            saved = saved_state(work) is not None
            if resume and not saved:
                print(f"{name}: no saved state in {work}; starting it", flush=True)
            card = train(classes[name], target, train_set, val_set, cfg, meta, folder, work, resume and saved,
                         accelerator, prefix=run_prefix(classes[name], recipe.features_key(target), cfg))
            if folder != finished and accelerator.is_main_process:  # the run folder keeps the final one too
                shutil.copytree(folder, finished, dirs_exist_ok=True)
            print(f"wrote {folder} ({card['parameters']['trained']:,} trained parameters, "
                  f"{card['training']['steps']} steps in {card['training']['wall_s']:.0f} s); "
                  f"validation {card['history'][-1]['val']}")
        if ship and accelerator.is_main_process:
            print(f"shipped {name} to {ship_checkpoint(finished, name)}")
        folders[name] = finished
    return folders


def validate_drafters(names: list[str], target_spec: str | None, device: str, recipe, checkpoint: str | None,
                      batch_tokens: int, out: str | None) -> None:
    """Agreement per depth of existing checkpoints on a recipe's held-out prompts, measured as training does:
    compare checkpoints trained on different data on one split."""
    from drafters.training.config import TrainConfig
    from drafters.training.dataset import validation_set
    from drafters.training.loop import depths, validate_checkpoint
    from drafters.variants import trained_class

    if checkpoint and len(names) > 1:
        raise SpecvizError("--checkpoint names one checkpoint folder; validate several drafters without it")
    if not checkpoint and any(n not in METHODS for n in names):
        raise SpecvizError("a variant has no shipped checkpoint: name its folder with --checkpoint")
    target = load_target(target_spec, "float32", device)
    val_set, meta = validation_set(target, recipe, cache_dir() / "train")
    cfg = TrainConfig(batch_tokens=batch_tokens, device=device)
    folder, results = Path(checkpoint) if checkpoint else None, {}
    print(f"held-out split {recipe.features_key(target)}: {len(val_set)} prompts")
    for name in names:
        results[name] = validate_checkpoint(trained_class(name), target, folder, val_set, meta, cfg)
        print(f"{name:10} agreement by depth {depths(results[name])}", flush=True)
    if out:
        atomic_write(Path(out), json.dumps({"split": recipe.features_key(target), "prompts": len(val_set),
                                            "validation": results}, indent=2) + "\n")
