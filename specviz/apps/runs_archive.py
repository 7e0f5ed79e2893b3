"""Finished training runs carried between machines: a GPU trains an experiment's arms, a CPU benches them.

A run is exported as its checkpoint alone (card and weights, the weights xz-compressed as shipped ones are; no
optimizer state, so an unfinished run does not travel), under its run folder's name, into plain tar parts of at
most ``part_bytes`` each (a transfer's file-size limit). Importing puts each checkpoint back under the cache's
runs folder by that name, so the run key that named it on the GPU names it here (``experiment --trained-on``).

Rules: a part never holds half a run; a run larger than one part is refused, not split; importing extracts only
``<run>/checkpoint/<file>`` members (no links, no absolute or parent paths) and never overwrites a finished run
with another.
"""

from __future__ import annotations

import io
import lzma
import tarfile
from pathlib import Path

from drafters.checkpoint import CARD, SHIPPED_WEIGHTS, WEIGHTS, weights_file
from specviz.core.errors import SpecvizError
from specviz.core.load import cache_dir

PART = "runs-part{:02d}.tar"


def runs_dir() -> Path:
    return cache_dir() / "train" / "runs"


def _members(checkpoint: Path) -> list[tuple[str, bytes]]:
    """(name inside the archive, bytes) of one finished run's checkpoint."""
    run = checkpoint.parent.name
    weights = weights_file(checkpoint)
    if weights is None or not (checkpoint / CARD).exists():
        raise SpecvizError(f"{checkpoint} is not a finished checkpoint (a card and weights)")
    data = weights.read_bytes()
    if weights.name == WEIGHTS:
        data = lzma.compress(data, preset=6)
    return [(f"{run}/checkpoint/{CARD}", (checkpoint / CARD).read_bytes()),
            (f"{run}/checkpoint/{SHIPPED_WEIGHTS}", data)]


def export_runs(checkpoints: list[Path], out: Path, part_bytes: int) -> list[Path]:
    """Write the finished runs' checkpoints into tar parts in ``out``; returns the parts written."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [_members(c) for c in dict.fromkeys(checkpoints)]
    parts: list[list[list[tuple[str, bytes]]]] = []
    size = part_bytes
    for run in runs:
        need = sum(len(b) + 1024 for _, b in run) + 2048  # each member's header and padding, the end blocks
        if need > part_bytes:
            raise SpecvizError(f"{run[0][0].split('/')[0]}: {need:,} bytes will not fit a part of {part_bytes:,} bytes")
        if size + need > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(run)
        size += need
    written = []
    for i, part in enumerate(parts, 1):
        path = out / PART.format(i)
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in (m for run in part for m in run):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        written.append(path)
    return written


def import_runs(paths: list[Path], into: Path | None = None) -> list[Path]:
    """Extract the runs in these parts into the runs folder; returns each imported run's checkpoint folder."""
    into = into or runs_dir()
    imported = []
    for path in paths:
        try:
            tar = tarfile.open(path, "r:")
        except (OSError, tarfile.TarError) as e:
            raise SpecvizError(f"{path}: not a runs archive ({e})") from None
        with tar:
            members = tar.getmembers()
            for m in members:
                parts = m.name.split("/")
                if not m.isfile() or len(parts) != 3 or parts[1] != "checkpoint" or any(p in ("", ".", "..")
                                                                                       for p in parts):
                    raise SpecvizError(f"{path}: unexpected member {m.name!r}; nothing imported from it")
            for run in dict.fromkeys(m.name.split("/")[0] for m in members):
                folder = into / run / "checkpoint"
                if (folder / CARD).exists():
                    print(f"{run}: finished here already; kept", flush=True)
                    continue
                folder.mkdir(parents=True, exist_ok=True)
                for m in sorted(members, key=lambda m: m.name.endswith(CARD)):  # the card last: it marks finished
                    if m.name.startswith(run + "/"):
                        (folder / m.name.split("/")[2]).write_bytes(tar.extractfile(m).read())
                imported.append(folder)
    return imported
