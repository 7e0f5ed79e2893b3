"""Long jobs in shards: items [0, n) are processed in fixed blocks, each saved whole as it finishes,
so a killed job started again does only the blocks it is missing."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save

from specviz.core.files import atomic_write


def save_whole(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written as ``atomic_write`` writes every file: a killed save leaves it whole or absent."""
    atomic_write(path, save(tensors, metadata=metadata))


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
        save_whole(self.path(i), {k: v.contiguous() for k, v in tensors.items()}, metadata)

    def load(self, i: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.path(i)))
