"""Trained drafter checkpoints: ``weights.safetensors`` (bf16) plus ``card.json`` in one folder.

Shipped checkpoints (``assets/drafters/<method>``) hold ``weights.safetensors.xz`` instead: bf16 weights
shrink about 30 % under xz, which keeps the repository small; loading reads either."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from specviz.core import files
from specviz.core.errors import SpecvizError

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets" / "drafters"
WEIGHTS, CARD = "weights.safetensors", "card.json"
SHIPPED_WEIGHTS = WEIGHTS + ".xz"


class CheckpointError(SpecvizError):
    """A drafter checkpoint that is missing, unreadable or made for another target or method."""


def default_path(method: str) -> Path:
    return ASSETS / method


def target_signature(target) -> dict:
    """The target facts a checkpoint depends on."""
    cfg = target.config
    return {"name": target.name, "hidden_size": int(cfg.hidden_size), "vocab_size": int(target.vocab_size),
            "num_hidden_layers": int(cfg.num_hidden_layers)}


def save_checkpoint(folder: Path, state: dict[str, torch.Tensor], card: dict, dtype=torch.bfloat16) -> None:
    folder = Path(folder)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in state.items()}
    files.atomic_write(folder / WEIGHTS, save(tensors, metadata={"method": card["method"]}))
    files.atomic_write(folder / CARD, json.dumps(card, indent=2) + "\n")


def weights_file(folder: Path) -> Path | None:
    """The folder's weights file, plain or xz-compressed; None when it has neither."""
    return next((Path(folder) / f for f in (WEIGHTS, SHIPPED_WEIGHTS) if (Path(folder) / f).exists()), None)


def ship_checkpoint(source: Path, method: str) -> Path:
    """Copy a finished checkpoint into ``assets/drafters/<method>``, its weights xz-compressed."""
    folder, weights = default_path(method), weights_file(source)
    if weights is None:
        raise CheckpointError(f"no weights in {source} to ship")
    folder.mkdir(parents=True, exist_ok=True)
    files.atomic_write(folder / SHIPPED_WEIGHTS, files.read_bytes(weights))
    (folder / WEIGHTS).unlink(missing_ok=True)  # a stale uncompressed copy would win over the new one
    shutil.copyfile(Path(source) / CARD, folder / CARD)
    return folder


def read_json_object(path: Path, what: str, expected: str) -> dict:
    """The JSON object in ``path`` (a card, a published config); ``what`` names it and ``expected`` says what it
    should be, in the errors."""
    if not path.exists():
        raise CheckpointError(f"no {what} at {path}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} is not {expected}")
    return value


def read_card(folder: Path) -> dict:
    path = Path(folder) / CARD
    expected = "a card (expected an object with method and target)"
    card = read_json_object(path, "checkpoint card", expected)
    if not isinstance(card.get("target", {}), dict):
        raise CheckpointError(f"checkpoint card {path} is not {expected}")
    return card


def update_card(folder: Path, **fields) -> None:
    card = read_card(folder)
    card.update(fields)
    files.atomic_write(Path(folder) / CARD, json.dumps(card, indent=2) + "\n")


def check_target(card: dict, target, what: str) -> None:
    """Refuse a checkpoint whose card names another target's hidden size, vocabulary or depth."""
    want, have = card.get("target", {}), target_signature(target)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in want and want[key] != have[key]:
            raise CheckpointError(f"{what} was trained for a target with {key}={want[key]} "
                                  f"({want.get('name', '?')}); this target ({have['name']}) has {key}={have[key]}")


def load_checkpoint(folder: str | Path | None, method: str, target) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights (float32) and card for ``method``, checked against ``target``; clear errors otherwise."""
    folder = Path(folder) if folder else default_path(method)
    weights = weights_file(folder)
    if weights is None:
        raise CheckpointError(
            f"no {method} checkpoint at {folder}: train one with "
            f"`python -m specviz train --drafter {method}` or pass checkpoint=FOLDER")
    card = read_card(folder)
    if card.get("method") != method:
        raise CheckpointError(f"{folder} holds a {card.get('method')!r} checkpoint, not {method!r}")
    check_target(card, target, f"{method} checkpoint {folder}")
    try:
        state = load(files.read_bytes(weights))
    except (SafetensorError, OSError, ValueError, lzma.LZMAError, EOFError) as e:
        raise CheckpointError(f"{method} checkpoint {weights} is unreadable "
                              f"(corrupt or truncated): {e}") from None
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}, card


def shareable_path(path: str | Path) -> str:
    """``path`` as a card should name it: relative to the repository, or just the file name if outside it."""
    path = Path(path).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
