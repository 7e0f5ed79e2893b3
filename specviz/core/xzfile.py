"""Files that may be xz-compressed: a path ending in ``.xz`` is, any other is not."""

from __future__ import annotations

import lzma
from pathlib import Path


def read_bytes(path: Path) -> bytes:
    """The file's contents, decompressed when its name ends in ``.xz`` (lzma.LZMAError or EOFError if damaged)."""
    data = Path(path).read_bytes()
    return lzma.decompress(data) if Path(path).suffix == ".xz" else data


def compress_for(path: Path, data: bytes) -> bytes:
    """``data`` as ``path`` should hold it."""
    return lzma.compress(data, preset=9) if Path(path).suffix == ".xz" else data


def write_bytes(path: Path, data: bytes) -> None:
    Path(path).write_bytes(compress_for(path, data))
