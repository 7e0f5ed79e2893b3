"""A published checkpoint's files: where it is (a folder, or a model-hub id fetched once), its config and weights.

Weights are read from every ``*.safetensors`` file of the folder, else from the ``*.bin`` / ``*.pt`` files EAGLE
and Medusa publish, which are opened with torch's weights-only loader: a file holding anything but tensors is
refused, never run.
Writing goes through ``core.files.atomic_write``, so an interrupted export never leaves a torn file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from specviz.core import files

from ..checkpoint import CheckpointError, read_json_object

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def resolve(source: str | Path) -> Path:
    """``source`` as a local folder: a folder as given, else a model-hub id downloaded (config and weights only)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if not HUB_ID.match(str(source)):
        raise CheckpointError(f"no checkpoint folder at {source} (and it is not a model-hub id such as owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(source), allow_patterns=["*.json", *WEIGHT_FILES]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated model: all mean "not here"
        raise CheckpointError(f"no folder {source}, and it could not be fetched from the model hub "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); download it and pass the "
                              "folder") from None


def read_config(folder: Path) -> dict:
    return read_json_object(Path(folder) / "config.json", "checkpoint config", "a config object")


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files: its safetensors files if any, else its torch-saved tensor files."""
    for pattern in WEIGHT_FILES[:1], WEIGHT_FILES[1:]:
        found = sorted(p for g in pattern for p in Path(folder).glob(g) if not p.name.startswith("training"))
        if found:
            return found
    return []


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, on the CPU."""
    paths = weight_files(folder)
    if not paths:
        raise CheckpointError(f"no weights (*.safetensors, *.bin or *.pt) in {folder}")
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            if path.suffix == ".safetensors":
                part = load_file(path)
            else:
                part = torch.load(path, map_location="cpu", weights_only=True)  # tensors only, never code
        except Exception as e:  # noqa: BLE001 - corrupt, truncated or refused by the weights-only loader: unreadable
            raise CheckpointError(f"{path} is unreadable (corrupt, truncated or not plain tensors): "
                                  f"{' '.join(str(e).split())[:200]}") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise CheckpointError(f"{path} does not hold a dictionary of tensors")
        state.update(part)
    return state


def write_folder(out: Path, config: dict, tensors: dict[str, torch.Tensor], weights_name: str) -> Path:
    """``config.json`` and one safetensors file in ``out``."""
    out = Path(out)
    # cloned: a tensor that shares memory with another (the target's head given to every Medusa head) cannot be saved
    files.atomic_write(out / weights_name, save({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()},
                                                metadata={"format": "pt"}))
    files.atomic_write(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out
