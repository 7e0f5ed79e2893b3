"""Files: names that say how they are stored, writes that never leave half a file, keys from content.

- A path ending in ``.xz`` is xz-compressed on disk; any other name holds the bytes as given.
- ``atomic_write`` writes beside the destination and renames: a kill mid-write leaves the old file
  whole (or no file), never a torn one. Every writer of a results file, cache entry or card uses it.
- ``content_key`` is the one short, stable name for everything that determines a job's output
  (run folders, tuning caches, data recipes): the same content always gives the same key.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path


def read_bytes(path: Path) -> bytes:
    """The file's contents, decompressed when its name ends in ``.xz`` (lzma.LZMAError or EOFError if damaged)."""
    data = Path(path).read_bytes()
    return lzma.decompress(data) if Path(path).suffix == ".xz" else data


def compress_for(path: Path, data: bytes) -> bytes:
    """``data`` as ``path`` should hold it."""
    return lzma.compress(data, preset=9) if Path(path).suffix == ".xz" else data


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` (str as UTF-8) to ``path``, compressed by its name, all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # per process: two writers never share it
    try:
        partial.write_bytes(compress_for(path, raw))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, data)


def content_key(value, length: int = 12) -> str:
    """A short hex name for ``value`` (any JSON-serialisable data; other objects by ``str``), stable across
    runs and machines: dict keys are sorted, so the order they were built in does not matter."""
    if isinstance(value, bytes):
        raw = value
    else:
        raw = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha1(raw).hexdigest()[:length]


def cache_dir() -> Path:
    root = os.environ.get("SPECVIZ_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specviz"
    return Path(root)


def looks_like_a_path(spec: str) -> bool:
    """Whether ``spec`` names a folder rather than a Hugging Face id (``owner/name``: at most one slash, never
    starting with a dot, a slash or a tilde), so a missing one is an error without asking the hub."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def missing_folder(spec: str) -> bool:
    """Whether ``spec`` names a folder (``looks_like_a_path``) that is not there."""
    return looks_like_a_path(spec) and not os.path.isdir(os.path.expanduser(spec))
