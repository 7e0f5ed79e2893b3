"""ReDrafter: a recurrent draft head, beam search and dynamic tree attention (Cheng et al., 2024).

The RNN state starts at the root token's embedding, s_0 = e_0, and moves on with
s_i = SiLU(U s_{i-1} + W e_i + b). Each token is drawn from ResBlocks over [s_i, x], with x the
target's last hidden state, projected into the target's frozen LM head. Beam search drafts
``width`` beams of ``length`` tokens; ``DraftTree.from_beams`` merges their shared prefixes into
one tree, verified in a single forward, and records the compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specviz.core.errors import SettingsError

from .heads import BeamSettings, HeadDrafter, ResBlock


class RecurrentHead(nn.Module):
    """``blocks`` ResBlocks (the paper's default is 2; Fig. 4 also tries 4). ``recurrent=False`` is the paper's
    non-RNN ablation: U = W = I and f the identity, so s_i = s_{i-1} + e_i, a running sum of embeddings."""

    def __init__(self, hidden: int, blocks: int = 2, recurrent: bool = True):
        super().__init__()
        self.recurrent = recurrent
        if recurrent:
            self.U = nn.Linear(hidden, hidden, bias=False)
            self.W = nn.Linear(hidden, hidden)  # carries b
        self.blocks = nn.Sequential(*[ResBlock(2 * hidden) for _ in range(blocks)])
        self.out = nn.Linear(2 * hidden, hidden)  # into the frozen LM head

    def start(self, x, e):
        return (e,)

    def advance(self, state, e, depth):
        if not self.recurrent:
            return (state[0] + e,)
        return (F.silu(self.U(state[0]) + self.W(e)),)

    def head(self, state, x, depth):
        return self.out(self.blocks(torch.cat([state[0], x], dim=-1)))


@dataclass
class RedrafterSettings(BeamSettings):
    # 1: the beams merged into one tree (dynamic tree attention); 0: each beam a branch of its own, nothing
    # shared (the paper's ablation, Fig. 6), to measure what the merge saves
    tree_attention: int = 1
    PAPER = {"width": 4, "length": 4}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree_attention not in (0, 1):
            raise SettingsError(f"tree_attention is 1 (beams merged) or 0 (apart), got {self.tree_attention!r}")


class RedrafterDrafter(HeadDrafter):
    name = "redrafter"
    title = "ReDrafter: recurrent draft head, beam search, dynamic tree attention"
    network = RecurrentHead
