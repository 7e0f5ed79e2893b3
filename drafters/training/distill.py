"""Self-distillation at scale: the target writes the training answers itself (greedy, as HASS §A.4),
batched, in shards saved as they finish, so a killed run goes on from the last finished shard.

The decode loop is lean: one KV cache per batch, a row leaves the batch (cache rows included) the step
its answer ends, and attention reads each key/value head once for its whole group of query heads
(transformers' eager attention copies the cache for every query head, and its CPU SDPA kernel is slow
for one query: together about half of each step).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask

from specviz.core.files import content_key
from specviz.core.target import cache_kwarg

from .batches import length_batches
from .shards import Shards

GROUPED = "specviz_grouped"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over [B, H, q, D] queries and [B, Hkv, L, D] keys/values, H a multiple of Hkv, with an additive
    float mask; query head i reads key/value head i // (H / Hkv), as in transformers' own layers. A prefill
    (many queries) goes to transformers' SDPA attention, which never holds the whole score matrix."""
    b, h, q, d = query.shape
    if q > 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = h // key.shape[1]
    scores = (query.reshape(b, key.shape[1], groups * q, d) @ key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, -q:, : key.shape[-2]]
        mask = mask[:, :, None].expand(b, mask.shape[1], groups, q, -1)
        scores = scores + mask.reshape(b, mask.shape[1], groups * q, -1)
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    return (probs @ value).reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def register_grouped_attention() -> None:
    """Make ``GROUPED`` a name transformers' models can be set to. The registries are global to the process,
    so this happens when a distill model is built, never on import (importing must not change transformers)."""
    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, eager_mask)


@torch.inference_mode()
def greedy_answers(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                   pad: int = 0) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (one batch, left-padded), each cut after its first EOS."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    stop = torch.tensor(sorted(eos) or [-1], device=device)
    alive = torch.arange(len(prompts), device=device)  # original row of each batch row
    answers: list[list[int]] = [[] for _ in prompts]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwarg(model, cache),
                logits_to_keep=1)
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        for row, tok in zip(alive.tolist(), nxt.tolist()):
            answers[row].append(tok)
        keep = ~torch.isin(nxt, stop)
        if step + 1 == max_new_tokens or not bool(keep.any()):
            break
        if not bool(keep.all()):  # finished rows leave the batch
            index = keep.nonzero().squeeze(1)
            cache.batch_select_indices(index)
            alive, nxt, mask, positions = alive[index], nxt[index], mask[index], positions[index]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions, **cache_kwarg(model, cache),
                    logits_to_keep=1)
    return answers


def prompt_batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices in batches of ``batch_size`` prompts of similar length (little padding), longest first."""
    return length_batches([len(p) for p in prompts], rows=batch_size, longest_first=True)


class ShardedDistill:
    """Answers for a fixed list of prompts, written shard by shard into ``folder``.

    Shard i holds prompts [i * shard_size, (i + 1) * shard_size); its batches depend only on its own
    prompts, so a resumed run writes exactly what an unbroken one would."""

    def __init__(self, folder: Path, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64,
                 shard_size: int = 512, label: str = ""):
        self.prompts, self.max_new_tokens, self.batch_size = prompts, max_new_tokens, batch_size
        self.key = content_key({"prompts": content_key(prompts, length=40),  # the whole sha1: the names predate it
                                "max_new_tokens": max_new_tokens, "batch_size": batch_size, "shard_size": shard_size,
                                "label": label})
        self.folder = Path(folder) / f"distill-{self.key}"
        self.shards = Shards(self.folder, len(prompts), shard_size)

    def finished(self) -> list[int]:
        return self.shards.finished()

    def run(self, model, eos: set[int], pad: int = 0, progress: bool = True,
            after_shard: Callable[[int], None] | None = None) -> list[list[int]]:
        """Generate the missing shards (each saved as it finishes), then return every answer in prompt order."""
        todo = self.shards.missing()
        bar = tqdm(total=len(self.prompts), initial=len(self.prompts) - sum(len(self.shards.items(i)) for i in todo),
                   desc="self-distill", unit="prompt", disable=not progress)
        made, start = 0, time.perf_counter()
        for i in todo:
            shard = [self.prompts[j] for j in self.shards.items(i)]
            answers: list[list[int]] = [[] for _ in shard]
            for batch in prompt_batches(shard, self.batch_size):
                for j, answer in zip(batch, greedy_answers(model, [shard[j] for j in batch], self.max_new_tokens,
                                                           eos, pad)):
                    answers[j] = answer
                made += sum(len(answers[j]) for j in batch)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{made / (time.perf_counter() - start):.0f}")
            tensors = {"tokens": torch.tensor([t for a in answers for t in a], dtype=torch.int32),
                       "lengths": torch.tensor([len(a) for a in answers])}
            self.shards.save(i, tensors, {"key": self.key, "shard": str(i)})
            if after_shard is not None:
                after_shard(i)
        bar.close()
        return self.load()

    def load(self) -> list[list[int]]:
        answers: list[list[int]] = []
        for i in range(self.shards.num):
            t = self.shards.load(i)
            answers += [piece.tolist() for piece in t["tokens"].long().split(t["lengths"].tolist())]
        return answers


def cast_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh copy of a transformers ``module`` in ``dtype``: same class, its own config, no hooks."""
    twin = type(module)(copy.deepcopy(module.config))
    twin = twin.to(device=next(module.parameters()).device, dtype=dtype).eval()
    twin.load_state_dict(module.state_dict())
    return twin


def distill_model(target, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of the target's model in ``dtype`` (default: its own) with grouped attention, for writing answers."""
    twin = cast_copy(target.model, dtype or target.dtype)
    register_grouped_attention()
    twin.set_attn_implementation(GROUPED)  # on the copy's own config
    return twin


def self_distill(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                 dtype: torch.dtype | None = None) -> list[list[int]]:
    """Greedy answers written by the target itself, in memory (small runs and tests)."""
    model, eos = distill_model(target, dtype), target.text.eos_token_ids
    answers: list[list[int]] = [[] for _ in prompts]
    for batch in prompt_batches(prompts, batch_size):
        for i, answer in zip(batch, greedy_answers(model, [prompts[i] for i in batch], max_new_tokens, eos,
                                                   pad=min(eos, default=0))):
            answers[i] = answer
    return answers
