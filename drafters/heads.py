"""Drafters that read only the target's last hidden state and the pending token.

Medusa, ReDrafter and semi-autoregressive drafting share this file. Each step they see x, the
target's (final-normed) hidden state at the last committed position, and the root token the
target just produced, and draft the tokens after the root. A small network feeds the target's
frozen LM head over the draft vocabulary, through a learned projection. Networks follow one
protocol, used teacher-forced in training (``drafters.training.losses.chain_loss``) and by beam search
at decoding time:

    start(x, e_root) -> state           state: a tuple of tensors, one row per beam/position
    head(state, x, depth) -> [rows, H]  the LM-head input for the draft token at ``depth``
    advance(state, e, depth) -> state   after the token at ``depth`` (embedding ``e``) is drafted
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Commit, DraftRequest, Settings
from specviz.core.tree import DraftTree

from .trained import TrainedDrafter
from .training.losses import chain_loss

DEPTH = 4  # draft tokens per position in training (K = 4 as in the semi-AR paper)


class ResBlock(nn.Module):
    """x + SiLU(Wx + b), zero-initialised so it starts as the identity (as in Medusa)."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@torch.inference_mode()
def beam_search(net, frozen, x: torch.Tensor, root: int, width: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` best drafts of ``length`` tokens after ``root`` by total log-prob (standard beam search).

    Returns beams [W, L] as target token ids and each token's draft log-prob [W, L].
    """
    vocab = frozen.vocab_map.numel()
    state = net.start(x, frozen.embed(torch.tensor([root], device=x.device)).to(x.dtype))
    rows = x
    score = torch.zeros(1, device=x.device)
    seqs = torch.zeros(1, 0, dtype=torch.long, device=x.device)
    logps = torch.zeros(1, 0, device=x.device)
    for d in range(1, length + 1):
        logp = torch.log_softmax(frozen.logits(net.head(state, rows, d)).float(), dim=-1)  # [w, V']
        best = (score[:, None] + logp).reshape(-1).topk(min(width, logp.numel()))
        row, tok = best.indices // vocab, best.indices % vocab
        seqs = torch.cat([seqs[row], tok[:, None]], dim=1)
        logps = torch.cat([logps[row], logp[row, tok][:, None]], dim=1)
        score = best.values
        if d < length:
            state = tuple(s[row] for s in state)
            rows = x.expand(row.numel(), -1)
            state = net.advance(state, frozen.embed(frozen.vocab_map[tok]).to(x.dtype), d)
    return frozen.vocab_map[seqs], logps


@dataclass
class BeamSettings(Settings):
    """Beam search over the drafter: ``width`` beams of ``length`` tokens, merged into one tree.

    width 1 is a plain chain of ``length`` tokens. The default, one token, is the fastest on the
    2-core CPU (swept on held-out ShareGPT prompts); each method keeps its paper's setting in ``PAPER``.
    """

    width: int = 1
    length: int = 1
    checkpoint: str = ""  # folder; empty = the shipped one in assets/drafters/<method>
    ranges = {"width": (1, 32), "length": (1, 8)}
    longest: ClassVar[int] = 8  # the longest draft the tuner tries

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("length", None, (("width", w),), depths=tuple(range(1, cls.longest + 1))) for w in (1, 4)]


@dataclass
class HeadState:
    """One decode's view for the heads: the feature at the last committed position and the pending root."""

    x: torch.Tensor | None = None  # [1, H]
    root: int | None = None


class HeadDrafter(TrainedDrafter):
    """A trained network on the target's last hidden state; drafts by beam search (Medusa overrides)."""

    max_length = 8  # longest draft the network supports
    network: type[nn.Module]  # built as network(hidden_size)

    def check_settings(self, settings) -> None:
        if settings.length > self.max_length:
            raise SettingsError(f"{self.name} drafts at most {self.max_length} tokens, got length={settings.length}")

    @classmethod
    def new_network(cls, target, **shape) -> nn.Module:
        return cls.network(target.config.hidden_size, **shape)

    @classmethod
    def training_loss(cls, net, frozen, tokens, feats, valid, evaluate: bool = False, done: float = 1.0):
        return chain_loss(net, frozen, tokens, feats, valid, DEPTH, evaluate)

    def start(self) -> HeadState:
        return HeadState()

    @torch.inference_mode()
    def observe(self, state: HeadState, commit: Commit) -> None:
        state.x = self.features(commit)[-1:]
        state.root = commit.pending

    @torch.inference_mode()
    def propose(self, state: HeadState, request: DraftRequest) -> DraftTree:
        length = min(self.settings.length, request.max_depth)
        if length < 1 or state.x is None:
            return DraftTree.empty()
        beams, logps = beam_search(self.net, self.frozen, state.x, state.root, self.settings.width, length)
        merged = getattr(self.settings, "tree_attention", 1)  # ReDrafter's ablation can keep the beams apart
        return (DraftTree.from_beams if merged else DraftTree.from_beams_apart)(beams.cpu(), logps.cpu())
