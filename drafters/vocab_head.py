"""The target's frozen embedding and LM head, restricted to a reduced draft vocabulary.

Trained drafters borrow these instead of shipping private vocab-sized heads (an allowed deviation,
stated on every card). The draft vocabulary is the most frequent tokens of the training data: every
draft node then pays a V'xH head instead of VxH, which is what makes trees affordable on a CPU.
"""

from __future__ import annotations

import torch

from specviz.core.packing import linear, pack


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent ids in ``tokens`` (plus ``always``), sorted; size 0 = everything."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size).float()
    for t in always:
        counts[t] = float("inf")
    return counts.topk(size).indices.sort().values


class FrozenTarget:
    """Embeddings and the draft-vocabulary rows of the LM head, both frozen."""

    def __init__(self, target, vocab_map: torch.Tensor):
        model = target.model
        self.embedding = model.get_input_embeddings()
        self.vocab_map = vocab_map.long().to(target.device)
        head = model.get_output_embeddings().weight.detach()[self.vocab_map]
        self.head = head.to(target.dtype).clone()  # [V', H], in the drafter's dtype
        self.packed_head: torch.Tensor | None = None

    def pack(self) -> None:
        """Decode on a packed copy of the head (``core.packing``); the head is frozen, so it never goes stale."""
        self.packed_head = pack(self.head)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).detach()

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        return linear(head_in, self.head.to(head_in.dtype), packed=self.packed_head)  # the cast: training autocast
