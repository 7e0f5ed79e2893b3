"""EAGLE-2: a one-layer feature drafter with a dynamic draft tree (Li et al., 2024).

The network reads the target's feature (its final-norm output, as in EAGLE's released code) fused
with the next token's embedding, runs one Llama decoder layer built from transformers' own modules,
and predicts the next feature. Draft logits come from the
target's frozen LM head restricted to a reduced draft vocabulary (the most frequent tokens of the
training data), which keeps the per-node head cheap on CPU. HASS and FSPAD reuse this file; the
objective they share is ``drafters.training.losses.feature_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specviz.core.protocol import BudgetGrid, Commit, DraftRequest, Settings
from specviz.core.target import cache_kwarg
from specviz.core.tree import DraftTree, additive_mask

from .trained import TrainedDrafter
from .training.losses import LossOptions, feature_loss


def layer_config(target_config, **shape) -> LlamaConfig:
    """A one-layer Llama config with the target's widths, heads and rotary settings; ``shape`` overrides
    them with a published drafter's own (``intermediate_size``, ``rope_parameters``, ...)."""
    c = target_config
    heads = shape.get("num_attention_heads") or c.num_attention_heads
    values = dict(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(c, "max_position_embeddings", 8192), vocab_size=1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,  # no vocabulary of its own: no special ids to check
        rope_parameters=getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg = LlamaConfig(**{**values, **shape})
    cfg._attn_implementation = "sdpa"
    return cfg


class FeatureNet(nn.Module):
    """fuse(feature, embedding) -> decoder layer -> (head input, next feature).

    ``sampler`` adds FSPAD's Feature Sampler, in one of two forms:

    - ``"fc+gate"`` (or True): EAGLE's ``fc(f ⊕ e)`` kept, then a residual branch in which the token
      embedding gates a projection of the fused input, as FSPAD's released code builds it;
    - ``"gate"``: the paper's text, where the sampler *replaces* the fc connector: the embedding gates
      a projection of the target's feature itself, ``f + down(SiLU(gate(e)) * up(norm(f)))``.

    ``split`` doubles the MLP output so one half feeds the LM head and the other is the fed-back
    feature (FSPAD's partial alignment, PAD).
    """

    SAMPLERS = ("", "fc+gate", "gate")

    def __init__(self, config: LlamaConfig, sampler: bool | str = False, split: bool = False):
        super().__init__()
        sampler = "fc+gate" if sampler is True else (sampler or "")
        if sampler not in self.SAMPLERS:
            raise ValueError(f"sampler is one of {self.SAMPLERS[1:]} or off, got {sampler!r}")
        h, i = config.hidden_size, config.intermediate_size
        self.hidden, self.sampler, self.split = h, sampler, split
        if sampler != "gate":
            self.fuse = nn.Linear(2 * h, h)
        if sampler:
            self.sampler_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.sampler_gate = nn.Linear(h, i, bias=False)
            self.sampler_up = nn.Linear(h, i, bias=False)
            self.sampler_down = nn.Linear(i, h, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.attn = LlamaAttention(config, layer_idx=0)
        self.post_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        if split:
            self.mlp.down_proj = nn.Linear(i, 2 * h, bias=False)

    def entry(self, features: torch.Tensor) -> torch.Tensor:
        """What the first pass reads from the target's features: its final-norm output."""
        return features[..., :self.hidden]

    def forward(self, features, embeds, positions, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        x = features if self.sampler == "gate" else self.fuse(torch.cat([features, embeds], dim=-1))
        if self.sampler:  # FSPAD: the token embedding gates a projection of the (fused) feature
            x = x + self.sampler_down(F.silu(self.sampler_gate(embeds)) * self.sampler_up(self.sampler_norm(x)))
        cos_sin = self.rotary(x, positions)
        x = x + self.attn(x, position_embeddings=cos_sin, attention_mask=mask, **cache_kwarg(self.attn, cache))[0]
        out = self.mlp(self.post_norm(x))
        if self.split:
            head_in, feature = (torch.cat([x, x], dim=-1) + out).chunk(2, dim=-1)
            return head_in, feature
        out = x + out
        return out, out


@dataclass
class TreeSettings(Settings):
    """Dynamic tree: expand the top_k best nodes per depth, then keep the total_tokens best overall.

    The CLI and the app choose depth and total_tokens for the machine (``specviz/apps/tuning.py``);
    the values here are the untuned fallback. The paper's (EAGLE-2: depth 6, top_k 10,
    total_tokens 60) are in ``PAPER``.
    """

    depth: int = 1
    top_k: int = 2
    total_tokens: int = 2
    checkpoint: str = ""  # folder; empty = the shipped one in assets/drafters/<method>
    ranges = {"depth": (1, 16), "top_k": (1, 32), "total_tokens": (1, 256)}

    PAPER = {"depth": 6, "top_k": 10, "total_tokens": 60}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("depth", "total_tokens", (("top_k", 8),))]


@dataclass
class FeatureState:
    """One decode's drafter KV cache (accepted positions only, between steps), the committed positions
    not yet fed to it, and the network's outputs at the last fed position."""

    cache: DynamicCache
    queue: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (features, next tokens)
    last: tuple[torch.Tensor, torch.Tensor] | None = None


class Eagle2Drafter(TrainedDrafter):
    name = "eagle2"
    title = "EAGLE-2: one-layer feature drafter, dynamic draft tree"
    variant = {"sampler": False, "split": False}
    loss = LossOptions()

    @classmethod
    def new_network(cls, target, **shape) -> FeatureNet:
        """``shape`` may carry the network's own flags (``sampler``, ``split``: a variant's card) beside a
        published drafter's widths."""
        flags = {k: shape.pop(k) for k in ("sampler", "split") if k in shape}
        return FeatureNet(layer_config(target.config, **shape), **{**cls.variant, **flags})

    @classmethod
    def training_loss(cls, net, frozen, tokens, feats, valid, evaluate: bool = False, done: float = 1.0):
        """The method's objective; ``evaluate`` reports accuracy at depths 1-4 (as the chain drafters do),
        each depth drafted from the drafter's own earlier predictions."""
        opts = replace(cls.loss, passes=4, detach=True) if evaluate else cls.loss
        return feature_loss(net, frozen, tokens, feats, valid, opts, done)

    # -- decoding -----------------------------------------------------------------------------
    def start(self) -> FeatureState:
        return FeatureState(DynamicCache())

    @torch.inference_mode()
    def observe(self, state: FeatureState, commit: Commit) -> None:
        nxt = torch.cat([commit.tokens[1:].cpu(), torch.tensor([commit.pending])])
        state.queue.append((self.features(commit), nxt.to(self.device)))

    def _step(self, state: FeatureState, feats, tokens, positions, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        mask = additive_mask(allowed, feats.dtype).to(self.device)
        head_in, feature = self.net(feats[None], self.frozen.embed(tokens)[None], positions[None].to(self.device),
                                    mask, state.cache)
        return head_in[0], feature[0]

    def _feed_queue(self, state: FeatureState) -> int:
        if state.queue:
            feats = torch.cat([f for f, _ in state.queue])
            tokens = torch.cat([t for _, t in state.queue])
            state.queue = []
            past, n = state.cache.get_seq_length(), tokens.numel()
            allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)
            head_in, feature = self._step(state, feats, tokens, torch.arange(past, past + n), allowed)
            state.last = (head_in[-1], feature[-1])
        return state.cache.get_seq_length()

    @torch.inference_mode()
    def propose(self, state: FeatureState, request: DraftRequest) -> DraftTree:
        depth = min(self.settings.depth, request.max_depth)
        accepted = self._feed_queue(state)
        if depth < 1 or state.last is None:
            return DraftTree.empty()
        try:
            return self._expand(state, accepted, depth)
        finally:
            drop = state.cache.get_seq_length() - accepted
            if drop > 0:
                state.cache.crop(-drop)

    def _expand(self, state: FeatureState, accepted: int, depth: int) -> DraftTree:
        """EAGLE-2's dynamic tree: grow the top_k best frontier nodes per depth, then rerank."""
        k, budget = self.settings.top_k, self.settings.total_tokens
        head_in, feature = state.last
        logp = torch.log_softmax(self.frozen.logits(head_in[None]).float(), dim=-1)[0]
        score, tok = (t.cpu() for t in logp.topk(min(k, logp.numel())))  # the tree's bookkeeping is on the CPU
        # every candidate, level by level; a node's global id is its index in the concatenation
        scores, tokens, logps, parents, depths = ([score], [tok], [score], [torch.full_like(tok, -1)],
                                                  [torch.ones_like(tok)])
        frontier, front_tok, front_score = torch.arange(tok.numel()), tok, score
        front_feat = feature[None].expand(tok.numel(), -1)
        front_anc = torch.zeros(tok.numel(), 0, dtype=torch.bool)  # fed ancestors (none below the root)
        fed_anc = torch.zeros(0, 0, dtype=torch.bool)  # ancestor-or-self among the fed tree nodes
        count = tok.numel()
        for d in range(1, depth):
            f0, m = fed_anc.shape[0], frontier.numel()
            fed_anc = torch.cat([torch.cat([fed_anc, torch.zeros(f0, m, dtype=torch.bool)], dim=1),
                                 torch.cat([front_anc, torch.eye(m, dtype=torch.bool)], dim=1)])
            allowed = torch.cat([torch.ones(m, accepted, dtype=torch.bool), fed_anc[f0:]], dim=1)
            positions = torch.full((m,), accepted - 1 + d)
            head_in, feats = self._step(state, front_feat, self.frozen.vocab_map[front_tok], positions, allowed)
            logp = torch.log_softmax(self.frozen.logits(head_in).float(), dim=-1)  # [m, V']
            child_logp, child_tok = (t.cpu() for t in logp.topk(min(k, logp.shape[-1]), dim=-1))  # [m, k]
            child_score = (front_score[:, None] + child_logp).reshape(-1)
            width, n_new = child_tok.shape[1], child_tok.numel()
            scores.append(child_score)
            tokens.append(child_tok.reshape(-1))
            logps.append(child_logp.reshape(-1))
            parents.append(frontier.repeat_interleave(width))
            depths.append(torch.full((n_new,), d + 1))
            best = child_score.topk(min(k, n_new)).indices
            parent_row = best // width  # row of each new frontier node's parent in this level
            frontier, front_tok, front_score = count + best, tokens[-1][best], child_score[best]
            front_feat, front_anc = feats[parent_row], fed_anc[f0 + parent_row]
            count += n_new
        flat_score, flat_depth = torch.cat(scores), torch.cat(depths)
        key = flat_score - 1e-4 * flat_depth  # a parent always outranks its children
        keep, rank = key.topk(min(budget, key.numel())).indices.sort()  # ids grow with depth; rank = keep order
        index = torch.full((count,), -1, dtype=torch.long)
        index[keep] = torch.arange(1, keep.numel() + 1)
        parent_ids = torch.cat(parents)[keep]
        parent_input = torch.where(parent_ids < 0, torch.zeros_like(parent_ids), index[parent_ids.clamp_min(0)])
        return DraftTree(self.frozen.vocab_map[torch.cat(tokens)[keep]].cpu(), parent_input,
                         torch.cat(logps)[keep].cpu(), info={"rank": rank})
