"""ReDrafter: a recurrent draft head, beam search and dynamic tree attention (Cheng et al., 2024).

The RNN state starts at the root token's embedding, s_0 = e_0, and moves on with
s_i = SiLU(U s_{i-1} + W e_i + b). Each token is drawn from ResBlocks over [s_i, x], with x the
target's last hidden state, projected into the target's frozen LM head. Beam search drafts
``width`` beams of ``length`` tokens; ``DraftTree.from_beams`` merges their shared prefixes into
one tree, verified in a single forward, and records the compression ratio.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .heads import BeamSettings, HeadDrafter, ResBlock


class RecurrentHead(nn.Module):
    def __init__(self, hidden: int, blocks: int = 2):
        super().__init__()
        self.U = nn.Linear(hidden, hidden, bias=False)
        self.W = nn.Linear(hidden, hidden)  # carries b
        self.blocks = nn.Sequential(*[ResBlock(2 * hidden) for _ in range(blocks)])
        self.out = nn.Linear(2 * hidden, hidden)  # into the frozen LM head

    def start(self, x, e):
        return (e,)

    def advance(self, state, e, depth):
        return (F.silu(self.U(state[0]) + self.W(e)),)

    def head(self, state, x, depth):
        return self.out(self.blocks(torch.cat([state[0], x], dim=-1)))


class RedrafterSettings(BeamSettings):
    PAPER = {"width": 4, "length": 4}


class RedrafterDrafter(HeadDrafter):
    name = "redrafter"
    title = "ReDrafter: recurrent draft head, beam search, dynamic tree attention"
    network = RecurrentHead
