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
from specviz.core.protocol import BudgetGrid, Commit, DraftRequest, Settings, lanes_by_depth
from specviz.core.transfer import to_device, to_host
from specviz.core.tree import DraftTree

from .captured import CAPTURE_LOCK, CapturedHeads, capture_heads, shared_captures
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

    Returns beams [W, L] as target token ids and each token's draft log-prob [W, L]."""
    beams, logps = beam_search_batch(net, frozen, x, to_device(torch.tensor([root]), x.device), width, length)
    return beams[0], logps[0]


@torch.inference_mode()
def beam_search_batch(net, frozen, x: torch.Tensor, roots: torch.Tensor, width: int,
                      length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search for G decodes at once (a batch's lanes): x [G, H] and roots [G]; beams [G, W, L] and their
    tokens' log-probs. Each lane keeps its own ``width`` best; the network runs every lane's beams in one call."""
    return search(net, frozen, x, roots, width, length)


def search(net, frozen, x: torch.Tensor, roots: torch.Tensor, width: int, length: int):
    """``beam_search_batch``'s body, as a compiled draft traces it (``drafters.captured.CapturedHeads``)."""
    vocab, g = frozen.vocab_map.numel(), x.shape[0]
    state = net.start(x, frozen.embed(roots).to(x.dtype))
    rows, beams = x, 1  # rows: every lane's beams, lane-major
    score = torch.zeros(g, 1, device=x.device)
    seqs = torch.zeros(g, 1, 0, dtype=torch.long, device=x.device)
    logps = torch.zeros(g, 1, 0, device=x.device)
    for d in range(1, length + 1):
        logp = torch.log_softmax(frozen.logits(net.head(state, rows, d)).float(), dim=-1).view(g, beams, vocab)
        best = (score[:, :, None] + logp).reshape(g, -1).topk(min(width, beams * vocab), dim=-1)
        row, tok = best.indices // vocab, best.indices % vocab  # [G, W']
        lanes = torch.arange(g, device=x.device)[:, None]
        seqs = torch.cat([seqs[lanes, row], tok[..., None]], dim=-1)
        logps = torch.cat([logps[lanes, row], logp[lanes, row, tok][..., None]], dim=-1)
        score, beams = best.values, row.shape[1]
        if d < length:
            flat = (lanes * logp.shape[1] + row).reshape(-1)  # the parent beams' rows, lane-major
            state = tuple(s[flat] for s in state)
            rows = x.repeat_interleave(beams, dim=0)
            state = net.advance(state, frozen.embed(frozen.vocab_map[tok.reshape(-1)]).to(x.dtype), d)
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

    # -- a compiled draft (``drafters.captured``; only where asked: ``capture_heads``) ----------------------------
    capture: CapturedHeads | None = None

    def capture_forwards(self, target) -> str:
        """The draft at this drafter's full length compiled once per target, checkpoint and draft shape in a
        process (a drafter built again takes the graph of the first), warmed on made-up features."""
        if not capture_heads(target):
            return "eager"
        key = (self.name, self.settings.checkpoint, repr(self.card.get("network")), repr(self.settings))
        with CAPTURE_LOCK:  # dynamo compiles one thing at a time
            shared = shared_captures(target.model)
            if key not in shared:
                capture = CapturedHeads(self._draft_function(), self.net, self.device)
                capture.warm(lambda: capture.run(*self._draft_inputs(
                    torch.zeros(1, self.hidden_size, dtype=self.dtype, device=self.device), 0)))
                shared[key] = (self.net, self.frozen, capture)
            self.net, self.frozen, self.capture = shared[key]
        return "compiled" if self.capture.ready else f"eager ({self.capture.error})"

    def _draft_function(self):
        net, frozen, width, length = self.net, self.frozen, self.settings.width, self.settings.length
        return lambda x, roots: search(net, frozen, x, roots, width, length)

    def _draft_inputs(self, x: torch.Tensor, root: int) -> tuple:
        return x, to_device(torch.tensor([root]), x.device)

    def _compiled(self, state: HeadState, depth: int, full: int):
        """The compiled draft's output for ``state``, where it may run (the full length) and ran; else None."""
        if self.capture is None or not self.capture.ready or depth != full:
            return None
        # a copy made here, under inference mode as the warm-up's inputs were: a graph is kept per input's kind
        return self.capture.run(*self._draft_inputs(state.x.clone(), state.root))

    @torch.inference_mode()
    def propose(self, state: HeadState, request: DraftRequest) -> DraftTree:
        length = min(self.settings.length, request.max_depth)
        if length < 1 or state.x is None:
            return DraftTree.empty()
        out = self._compiled(state, length, self.settings.length)
        beams, logps = (out[0][0], out[1][0]) if out is not None else beam_search(
            self.net, self.frozen, state.x, state.root, self.settings.width, length)
        return self._tree(beams, logps)

    def _tree(self, beams: torch.Tensor, logps: torch.Tensor) -> DraftTree:
        """The beams as one tree. Merged by prefix (tree attention), its size depends on the tokens, so the host
        reads the beams first (one copy); kept apart, or a single beam, the tree stays where it was drafted, read
        with the verify's answer (``core.tree.on_host``)."""
        if self._merges(beams.shape[0]):
            return DraftTree.from_beams(*to_host([beams, logps]))
        tree = DraftTree.from_beams_apart(beams, logps)
        tree.info["max_depth"] = beams.shape[1]
        return tree

    def _merges(self, width: int) -> bool:
        """Whether beams are merged by prefix into one tree: several, unless ReDrafter's ablation keeps them apart."""
        return width > 1 and bool(getattr(self.settings, "tree_attention", 1))

    @torch.inference_mode()
    def propose_batch(self, states: list[HeadState], requests: list[DraftRequest]) -> list[DraftTree]:
        """Every lane's beam search in one call per draft length (lanes near their token limit draft shorter)."""
        trees: list[DraftTree] = [DraftTree.empty()] * len(states)
        searched = []
        for length, lanes in lanes_by_depth(states, requests, self.settings.length, lambda s: s.x is not None).items():
            x = torch.cat([states[i].x for i in lanes])
            roots = to_device(torch.tensor([states[i].root for i in lanes]), x.device)
            searched.append((lanes, *beam_search_batch(self.net, self.frozen, x, roots, self.settings.width, length)))
        if self._merges(self.settings.width):  # every lane's beams in one read, to be merged on the host
            read = iter(to_host([t for _, beams, logps in searched for t in (beams, logps)]))
            searched = [(lanes, next(read), next(read)) for lanes, _, _ in searched]
        for lanes, beams, logps in searched:
            for k, i in enumerate(lanes):
                trees[i] = self._tree(beams[k], logps[k])
        return trees
