"""The frozen target's features: its final-norm output at every position of every training sequence.

``extract_features`` computes and stores them once (resumable in shards); ``LayerTaps`` adds, batch by
batch during training, the inputs of the decoder layers a method reads besides (EAGLE-3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from ..trained import TrainedDrafter
from .batches import length_batches
from .distill import cast_copy
from .shards import Shards, save_whole


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


@torch.inference_mode()
def extract_features(target, seqs: list[tuple[torch.Tensor, int]], batch_tokens: int = 4096, desc: str = "features",
                     work: Path | None = None, shard_size: int = 1024, dtype: torch.dtype | None = None) -> FeatureSet:
    """Run the frozen target over each sequence and keep its features (final-norm output) at every position.

    ``dtype``: run a copy of the target's body in it (bf16 where the hardware is fast at it; the features are
    stored as float16 either way). With ``work``, sequences go in shards saved there as they finish, so a
    killed run goes on from the last one."""
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


class LayerTaps:
    """The inputs of the target's decoder ``layers`` over a batch, appended to its stored features.

    Computed on the fly (one forward of the target's body per batch, in the dtype the stored features
    came from), so a method reading more layers (EAGLE-3) keeps no second feature cache on disk.
    Right padding needs no mask: attention is causal, so padding never reaches a real position."""

    def __init__(self, target, layers: tuple[int, ...], dtype: torch.dtype | None = None):
        self.layers = layers
        decoder = target.model.get_decoder()
        copy = layers and dtype not in (None, target.dtype)  # most methods tap nothing: no copy of the body
        self.decoder = cast_copy(decoder, dtype) if copy else decoder

    @classmethod
    def of(cls, method: type[TrainedDrafter], target, data_meta: dict) -> "LayerTaps":
        """The taps ``method`` reads, in the dtype the data card says the stored features came from."""
        dtype = data_meta.get("feature_dtype")
        return cls(target, method.tapped_layers(target.num_layers), getattr(torch, dtype) if dtype else None)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``feats`` with the taps appended; a set of tokens alone (``prepare(features=False)``, no columns)
        gets the final-norm output from the same forward, rounded to float16 as stored features are."""
        if not self.layers and feats.shape[-1]:
            return feats
        out = self.decoder(input_ids=tokens, use_cache=False, output_hidden_states=True)
        if feats.shape[-1] == 0:  # features on the fly (no stored ones): rounded as stored ones are
            feats = out.last_hidden_state.half().to(feats.dtype)
        return torch.cat([feats] + [out.hidden_states[i].to(feats.dtype) for i in self.layers], dim=-1)
