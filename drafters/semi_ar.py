"""Semi-autoregressive drafting: q(d_j | h_p, h_q(d_<j)).

h_p is the target's last hidden state, computed once per step by the verify forward and reused
for every draft token; h_q summarises the tokens drafted so far (the root first) with a tiny LM:

- ``semi-attn``, the simplified transformer: h_q = sum_l a_l MLP(e(d_l)) / sum_l a_l, with one
  learnable a_l = sigmoid(w_l) in (0, 1) per draft position and a 2-layer MLP of width H/2;
- ``semi-lstm``: a 2-layer LSTM of width H/2 over the same embeddings.

Head: f = W3 s(concat(W_p h_p, W_q h_q)) + b3, with s = SiLU here and f fed to the target's frozen
LM head (the allowed projection deviation). Trained separately, target frozen. Drafts a chain of
K = 4 tokens; width > 1 drafts a beam tree instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .heads import DEPTH, BeamSettings, HeadDrafter


class SemiHead(nn.Module):
    def __init__(self, hidden: int, context: int):
        super().__init__()
        self.p = nn.Linear(hidden, hidden, bias=False)  # W_p
        self.q = nn.Linear(context, hidden, bias=False)  # W_q
        self.out = nn.Linear(2 * hidden, hidden)  # W3, b3

    def forward(self, h_p, h_q):
        return self.out(F.silu(torch.cat([self.p(h_p), self.q(h_q)], dim=-1)))


class FixedAttentionLM(nn.Module):
    """The simplified transformer: a position-weighted mean of per-token MLP outputs."""

    def __init__(self, hidden: int, positions: int = DEPTH):
        super().__init__()
        half = hidden // 2
        self.mlp = nn.Sequential(nn.Linear(hidden, half), nn.SiLU(), nn.Linear(half, half))
        self.alpha_logit = nn.Parameter(torch.zeros(positions))
        self.f = SemiHead(hidden, half)

    @property
    def alpha(self) -> torch.Tensor:
        return 1e-4 + (1 - 2e-4) * torch.sigmoid(self.alpha_logit)  # strictly inside (0, 1), even saturated

    def start(self, x, e):
        a = self.alpha[0]
        return a * self.mlp(e), a.expand(e.shape[0], 1)

    def advance(self, state, e, depth):
        total, weight = state
        a = self.alpha[depth]
        return total + a * self.mlp(e), weight + a

    def head(self, state, x, depth):
        total, weight = state
        return self.f(x, total / weight)


class LstmLM(nn.Module):
    """A 2-layer LSTM of width H/2 over the drafted tokens' embeddings."""

    def __init__(self, hidden: int):
        super().__init__()
        half = hidden // 2
        self.lstm = nn.LSTM(hidden, half, num_layers=2, batch_first=True)
        self.f = SemiHead(hidden, half)

    def _run(self, e, hc=None):
        _, (h, c) = self.lstm(e[:, None], hc)
        return h.transpose(0, 1), c.transpose(0, 1)  # rows first, so beam search can reorder them

    def start(self, x, e):
        return self._run(e)

    def advance(self, state, e, depth):
        h, c = state
        return self._run(e, (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))

    def head(self, state, x, depth):
        return self.f(x, state[0][:, -1])


class LastTokenLM(nn.Module):
    """A 0-layer h_q, as Hydra's heads: an MLP of the last drafted token's embedding alone, no sequence model."""

    def __init__(self, hidden: int):
        super().__init__()
        half = hidden // 2
        self.mlp = nn.Sequential(nn.Linear(hidden, half), nn.SiLU(), nn.Linear(half, half))
        self.f = SemiHead(hidden, half)

    def start(self, x, e):
        return (self.mlp(e),)

    def advance(self, state, e, depth):
        return (self.mlp(e),)

    def head(self, state, x, depth):
        return self.f(x, state[0])


class TransformerLM(nn.Module):
    """An N-layer causal transformer of width H/2 over the drafted tokens' embeddings (with learned positions);
    h_q is its output at the last drafted token. The state is the projected embeddings so far, rows first."""

    def __init__(self, hidden: int, layers: int = 1, positions: int = DEPTH):
        super().__init__()
        half = hidden // 2
        self.project = nn.Linear(hidden, half)
        self.position = nn.Parameter(torch.zeros(positions, half))
        layer = nn.TransformerEncoderLayer(half, nhead=4, dim_feedforward=2 * half, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.f = SemiHead(hidden, half)

    def start(self, x, e):
        return (self.project(e)[:, None],)

    def advance(self, state, e, depth):
        return (torch.cat([state[0], self.project(e)[:, None]], dim=1),)

    def head(self, state, x, depth):
        seq = state[0] + self.position[:state[0].shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(seq.shape[1], device=seq.device, dtype=seq.dtype)
        return self.f(x, self.layers(seq, mask=causal, is_causal=True)[:, -1])


def semi_network(hidden: int, hq: str = "fixed-attention", layers: int = 1) -> nn.Module:
    """semi-attn's network with the h_q it names: ``fixed-attention`` (the paper's simplified transformer, the
    shipped one), ``last`` (0 layers) or ``transformer`` (``layers`` causal layers): the h_q sweep's arms."""
    if hq == "fixed-attention":
        return FixedAttentionLM(hidden)
    if hq == "last":
        return LastTokenLM(hidden)
    if hq == "transformer":
        return TransformerLM(hidden, layers)
    raise ValueError(f"hq is fixed-attention, last or transformer, got {hq!r}")


class SemiSettings(BeamSettings):
    PAPER = {"width": 1, "length": 4}  # the K = 4 chain
    longest = DEPTH


class SemiAttnDrafter(HeadDrafter):
    name = "semi-attn"
    title = "Semi-AR: target hidden state + fixed-attention simplified transformer, K-token chain"
    max_length = DEPTH  # one learned weight per draft position
    network = staticmethod(semi_network)


class SemiLstmDrafter(HeadDrafter):
    name = "semi-lstm"
    title = "Semi-AR: target hidden state + 2-layer LSTM, K-token chain"
    network = LstmLM
