"""Batches of sequences of similar length, so little of each batch is padding.

``length_batches`` is the one bucketer: self-distillation batches prompts by count, feature extraction
and training by padded tokens. ``make_batch`` pads a training batch and marks the predictions that count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # for annotations only: ``features`` imports this module
    from .features import FeatureSet


def length_batches(lengths: list[int], batch_tokens: int | None = None, gen: torch.Generator | None = None, *,
                   rows: int | None = None, longest_first: bool = False) -> list[list[int]]:
    """Indices grouped by length: a batch closes before it would pad to more than ``batch_tokens`` tokens
    or hold more than ``rows`` sequences (None: no such bound).

    With ``gen``, equal lengths are ordered at random and the batches come in shuffled order (training);
    without it, shortest first (feature extraction), or longest first (self-distillation: a batch too big
    for the device fails at once, not hours in)."""
    if gen is None:  # Python's sort is stable, reversed too: equal lengths keep their order
        order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=longest_first)
    else:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], torch.rand(1, generator=gen).item()))
    out, cur, widest = [], [], 0
    for i in order:
        wider = max(widest, lengths[i])
        if cur and ((batch_tokens is not None and (len(cur) + 1) * wider > batch_tokens)
                    or (rows is not None and len(cur) == rows)):
            out.append(cur)
            cur, wider = [], lengths[i]
        cur.append(i)
        widest = wider
    if cur:
        out.append(cur)
    return out if gen is None else [out[j] for j in torch.randperm(len(out), generator=gen).tolist()]


def training_batches(data: FeatureSet, batch_tokens: int, max_length: int, gen: torch.Generator) -> list[list[int]]:
    """One epoch's length-bucketed batches of about ``batch_tokens`` padded tokens, in shuffled order."""
    lengths = (data.offsets[1:] - data.offsets[:-1]).clamp(max=max_length).tolist()
    return length_batches(lengths, batch_tokens, gen)


def make_batch(data: FeatureSet, ids: list[int], max_length: int, device="cpu"):
    """Right-padded tokens [B,T], features [B,T,H] (fp32) and valid [B,T]: predictions that count."""
    seqs = [data.sequence(i) for i in ids]
    width = min(max_length, max(s[0].numel() for s in seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    feats = torch.zeros(len(seqs), width, data.features.shape[1])
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (tok, feat, start) in enumerate(seqs):
        n = min(width, tok.numel())
        tokens[row, :n], feats[row, :n] = tok[:n], feat[:n].float()
        valid[row, max(start - 1, 0): n - 1] = True  # position t predicts feature t+1 (inside the answer)
    return tokens.to(device), feats.to(device), valid.to(device)
