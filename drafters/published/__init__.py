"""Published drafter checkpoints, read and written: EAGLE-1/2 and HASS (EAGLE's layout), EAGLE-3 (its own layout
and the ``speculators`` package's) and Medusa-1.

Reading turns a published folder (or model-hub id) into what a specviz checkpoint holds, a native state
dict and a card, so a drafter loads it like its own (``TrainedDrafter``); the card records the layout and
the source. Writing is the inverse, for drafters trained here (``python -m specviz export``). Each layout is
a class with:

    NAME, METHODS, TITLE, WEIGHTS      its format name, the specviz methods that run it, a title, its weights file
    matches(config, keys) -> bool      whether a folder's config and weight names are this layout
    read(config, state, target, source) -> (native state, card fields)
    write(native, card, target, base, server) -> (config, tensors, notes)
                                       base: the target as the config names it; server: vllm or sglang
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CARD, CheckpointError, check_target, load_checkpoint
from . import files
from .eagle import Eagle
from .eagle3 import Original, Speculators
from .medusa import Medusa

LAYOUTS = {layout.NAME: layout for layout in (Eagle, Original, Speculators, Medusa)}
DETECTION = (Speculators, Original, Medusa, Eagle)  # the most specific first
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NO_SERVING = {
    "fspad": "FSPAD's feature sampler and split output exist in no serving engine's EAGLE; hass (plain EAGLE at "
             "inference) exports with --format eagle",
    "redrafter": "ReDrafter is served only by TensorRT-LLM, through its own checkpoint converter; vLLM and SGLang "
                 "have no ReDrafter drafter",
    "semi-attn": "the semi-autoregressive heads have no serving equivalent in vLLM or SGLang",
    "semi-lstm": "the semi-autoregressive heads have no serving equivalent in vLLM or SGLang",
}


IGNORED = ("embed_tokens.weight", "t2d", "inv_freq", "verifier_lm_head.weight", "verifier_norm.weight")  # the
# target's own copies, derived tables and buffers: read from the target or recomputed, never trained


class Tracked(dict):
    """A state dict that records which keys a layout read, so a tensor it has no place for is never dropped silently."""

    def __init__(self, state):
        super().__init__(state)
        self.seen: set[str] = set()

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)


def _kind(source: str | Path) -> str:
    """'native' (a folder with a specviz card), 'published' (a folder with a config, or a hub id) or 'missing'."""
    path = Path(source).expanduser()
    if path.is_dir():
        return "native" if (path / CARD).exists() or not (path / "config.json").exists() else "published"
    return "published" if files.HUB_ID.match(str(source)) else "missing"


def read_published(source: str | Path, method: str, target) -> tuple[dict[str, torch.Tensor], dict]:
    """A published checkpoint as specviz's own: weights (float32) and a card, checked against ``target``."""
    folder = files.resolve(source)
    config, state = files.read_config(folder), files.read_weights(folder)
    layout = next((lay for lay in DETECTION if lay.matches(config, set(state))), None)
    if layout is None:
        raise CheckpointError(f"{source} is neither a specviz checkpoint (card.json) nor a layout specviz reads: "
                              f"{', '.join(lay.TITLE for lay in LAYOUTS.values())}")
    if method not in layout.METHODS:
        raise CheckpointError(f"{source} is a {layout.TITLE} checkpoint, which runs as "
                              f"{' or '.join(layout.METHODS)}, not {method}")
    read = Tracked(state)
    native, fields = layout.read(config, read, target, source)
    if unread := sorted(k for k in set(state) - read.seen if not k.endswith(IGNORED)):
        raise CheckpointError(f"{source} holds weights the {layout.TITLE} network has no place for: {unread[:4]}"
                              " (a variant specviz does not run, such as extra norms)")
    card = {"method": method, "title": f"{layout.TITLE}: {source}",
            "published": {"layout": layout.NAME, "source": str(source)}, **fields}
    check_target(card, target, f"{method} checkpoint {source}")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in native.items()}, card


def load_any(source: str | Path | None, method: str, target) -> tuple[dict[str, torch.Tensor], dict]:
    """``method``'s checkpoint from ``source``: specviz's own (the shipped one when empty) or a published one."""
    if source and _kind(source) == "published":
        return read_published(source, method, target)
    return load_checkpoint(source, method, target)


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the folder, its files, and what a user must know about serving it."""

    folder: Path
    files: tuple[str, ...]
    notes: tuple[str, ...]


SERVERS = ("vllm", "sglang")


def export(method: str, source: str | Path | None, fmt: str, out: Path, target, base: str,
           dtype: str = "bfloat16", server: str = "vllm") -> Exported:
    """Write ``method``'s checkpoint (``source``; empty = the shipped one) in layout ``fmt`` into ``out``, for
    ``server`` where the two read the layout differently (``docs/serving.md``)."""
    if fmt not in LAYOUTS:
        raise CheckpointError(f"unknown format {fmt!r}: one of {', '.join(LAYOUTS)}")
    layout = LAYOUTS[fmt]
    if method not in layout.METHODS:
        fits = [name for name, lay in LAYOUTS.items() if method in lay.METHODS]
        why = NO_SERVING.get(method) or (f"export it with --format {' or '.join(fits)}" if fits else
                                         "it has no trained weights to export")
        raise CheckpointError(f"{method} cannot be written in the {fmt} layout ({layout.TITLE}): {why}")
    if dtype not in DTYPES or server not in SERVERS:
        raise CheckpointError(f"unknown dtype {dtype!r} or server {server!r}: dtype one of {', '.join(DTYPES)}, "
                              f"server one of {', '.join(SERVERS)}")
    native, card = load_any(source, method, target)
    config, tensors, notes = layout.write(native, card, target, base, server)
    cast = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v) for k, v in tensors.items()}
    config["torch_dtype"] = dtype
    files.write_folder(out, config, cast, layout.WEIGHTS)
    return Exported(Path(out), ("config.json", layout.WEIGHTS), tuple(notes))


__all__ = ["LAYOUTS", "SERVERS", "Exported", "export", "load_any", "read_published"]
