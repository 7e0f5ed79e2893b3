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
    """Embeddings and the draft-vocabulary rows of the LM head, both frozen.

    ``head`` replaces the target's rows with a drafter's own head over the same draft vocabulary (a
    published EAGLE-3 checkpoint trains one). The whole vocabulary shares the target's head, uncopied."""

    def __init__(self, target, vocab_map: torch.Tensor, head: torch.Tensor | None = None):
        model = target.model
        self.embedding = model.get_input_embeddings()
        self.vocab_map = vocab_map.long().to(target.device)
        if head is not None:  # its shape was checked with the checkpoint (``TrainedDrafter.restore``)
            self.head = head.detach().to(device=target.device, dtype=target.dtype)
        else:
            weight = model.get_output_embeddings().weight.detach()
            whole = self.vocab_map.numel() == weight.shape[0] and bool(
                (self.vocab_map == torch.arange(weight.shape[0], device=self.vocab_map.device)).all())
            self.head = weight.to(target.dtype) if whole else weight[self.vocab_map].to(target.dtype).clone()
        self.packed_head: torch.Tensor | None = None  # [V', H] above, in the drafter's dtype
        self.plain_rows = 0  # calls of up to this many rows on the default kernels (``core.kernels``)

    def pack(self, plain_rows: int = 0) -> None:
        """Decode on a packed copy of the head (``core.packing``), but calls of up to ``plain_rows`` rows; the
        head is frozen, so it never goes stale."""
        self.packed_head, self.plain_rows = pack(self.head), plain_rows

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).detach()

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        # the cast: training autocast
        return linear(head_in, self.head.to(head_in.dtype), packed=self.packed_head, plain_rows=self.plain_rows)
