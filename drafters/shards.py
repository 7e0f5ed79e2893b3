"""Long jobs in shards: items [0, n) are processed in fixed blocks, each saved whole as it finishes,
so a killed job started again does only the blocks it is missing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def recipe_key(recipe) -> str:
    """A short, stable name for everything that determines a job's output."""
    return hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def save_whole(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written aside and renamed: a killed save leaves it whole or absent, never half."""
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


class Shards:
    def __init__(self, folder: Path, count: int, size: int):
        self.folder, self.count, self.size = Path(folder), count, size

    @property
    def num(self) -> int:
        return -(-self.count // self.size)

    def items(self, i: int) -> range:
        return range(i * self.size, min((i + 1) * self.size, self.count))

    def path(self, i: int) -> Path:
        return self.folder / f"shard-{i:05d}.safetensors"

    def finished(self) -> list[int]:
        return [i for i in range(self.num) if self.path(i).exists()]

    def missing(self) -> list[int]:
        return [i for i in range(self.num) if not self.path(i).exists()]

    def save(self, i: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        save_whole(self.path(i), {k: v.contiguous() for k, v in tensors.items()}, metadata)

    def load(self, i: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.path(i)))
