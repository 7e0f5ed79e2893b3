"""EAGLE-2: a one-layer feature drafter with a dynamic draft tree (Li et al., 2024).

The network reads the target's feature (its final-norm output, as in EAGLE's released code) fused
with the next token's embedding, runs one Llama decoder layer built from transformers' own modules,
and predicts the next feature. Draft logits come from the
target's frozen LM head restricted to a reduced draft vocabulary (the most frequent tokens of the
training data), which keeps the per-node head cheap on CPU. HASS and FSPAD reuse this file; the
objective they share is ``drafters.training.losses.feature_loss``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specviz.core.cache import SlabCache
from specviz.core.protocol import BudgetGrid, Commit, DraftRequest, Settings, lanes_by_depth
from specviz.core.target import cache_kwarg
from specviz.core.transfer import to_device
from specviz.core.tree import DraftTree, additive_mask

from .captured import CAPTURE_LOCK, CapturedDraft, shared_captures
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

    cache: SlabCache | DynamicCache
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
    capture: CapturedDraft | None = None  # the network step and head compiled (``drafters.captured``)

    def capture_forwards(self, target) -> str:
        """Compiled once per target and checkpoint in a process: a drafter built again (the tuner builds one per
        budget) takes the network, head and graphs of the first. The graphs are warmed on a scratch copy, so a
        drafter in use on another thread (the app's) drafts eager until they are ready."""
        key = (self.name, self.settings.checkpoint, repr(self.card.get("network")), target.captured.layout)
        with CAPTURE_LOCK:  # dynamo compiles one thing at a time
            shared = shared_captures(target.model)
            if key not in shared:
                scratch = copy.copy(self)
                scratch.capture = CapturedDraft(self.net, self.frozen, self.device, target.captured.layout)
                scratch.capture.warm(scratch._warm_capture)
                shared[key] = (self.net, self.frozen, scratch.capture)
            self.net, self.frozen, self.capture = shared[key]
        return "compiled" if self.capture.ready else f"eager ({self.capture.error})"

    def _warm_capture(self) -> None:
        """Every graph a decode asks for, on a scratch state with made-up features: the feed (the first allocates
        the buffers, eager; then several rows, then one) and a tree three deep (the head on one row and on a
        frontier, the network over a frontier under a mask)."""
        state = self.start()
        for n in (4, 3, 1):
            state.queue.append((torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device),
                                torch.ones(n, dtype=torch.long, device=self.device)))
            self._feed([state])
        self._expand([state], 3)

    def start(self) -> FeatureState:
        """Rollback rewinds a length, as the target's cache (``core.cache``); static where CUDA graphs replay."""
        return FeatureState(SlabCache(1, 256, static=self.capture is not None and self.capture.graphs))

    @torch.inference_mode()
    def observe(self, state: FeatureState, commit: Commit) -> None:
        nxt = torch.cat([commit.tokens[1:].cpu(), torch.tensor([commit.pending])])
        state.queue.append((self.features(commit), to_device(nxt, self.device)))

    def _run(self, feats, tokens, positions, allowed, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The network over [B, n] inputs; ``allowed`` [B, n, keys] says what each query sees in ``cache`` and
        among the n (one row per lane)."""
        mask = to_device(additive_mask(allowed, feats.dtype)[0, 0][:, None], self.device)
        positions = to_device(positions, self.device)
        if self.capture is not None and self.capture.usable(feats, cache):
            out = self.capture.run_step(feats, tokens, positions, mask, cache)
            if out is not None:  # None: the graph broke, and the drafter drafts eagerly from now on
                return out
        return self.net(feats, self.frozen.embed(tokens), positions, mask, cache)

    def _top(self, head_in: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, draft-vocabulary ids) of the k best next tokens at each ``head_in`` row (its device)."""
        k = min(k, self.frozen.head.shape[0])
        top = None
        if self.capture is not None and self.capture.ready and head_in.shape[0] == 1:
            top = self.capture.run_top(head_in, k)  # None where the graph broke
        score, tok = top or torch.log_softmax(self.frozen.logits(head_in).float(), dim=-1).topk(k, dim=-1)
        return score, tok  # the tree is grown on the device: the host reads it once, whole (``_tree``)

    def _feed(self, states: list[FeatureState]) -> None:
        """Every lane's queued committed positions through the network in one call; each lane's cache grows
        by them and keeps the network's outputs at its last position."""
        lanes = [s for s in states if s.queue]
        if not lanes:
            return
        feats = [torch.cat([f for f, _ in s.queue]) for s in lanes]
        tokens = [torch.cat([t for _, t in s.queue]) for s in lanes]
        for s in lanes:
            s.queue = []
        pasts, sizes = [s.cache.get_seq_length() for s in lanes], [t.numel() for t in tokens]
        width, n = max(pasts), max(sizes)
        cache = lanes[0].cache if len(lanes) == 1 else stacked([s.cache for s in lanes], pasts)
        allowed = torch.zeros(len(lanes), n, width + n, dtype=torch.bool)
        allowed[:, :, width:] = torch.ones(n, n, dtype=torch.bool).tril()  # padding sees padding: never read
        x = feats[0].new_zeros(len(lanes), n, feats[0].shape[-1])
        ids = tokens[0].new_zeros(len(lanes), n)
        for b, (past, m) in enumerate(zip(pasts, sizes)):
            allowed[b, :m, :past] = True
            x[b, :m], ids[b, :m] = feats[b], tokens[b]
        positions = torch.tensor(pasts)[:, None] + torch.arange(n)
        head_in, feature = self._run(x, ids, positions, allowed, cache)
        for b, (s, m) in enumerate(zip(lanes, sizes)):
            if len(lanes) > 1:  # the lane's own cache grows by its m new positions, as a lone lane's does
                layer = cache.layers[0]
                s.cache.update(layer.keys[b:b + 1, :, width:width + m], layer.values[b:b + 1, :, width:width + m], 0)
            s.last = (head_in[b, m - 1], feature[b, m - 1])

    @torch.inference_mode()
    def propose(self, state: FeatureState, request: DraftRequest) -> DraftTree:
        return self.propose_batch([state], [request])[0]

    @torch.inference_mode()
    def propose_batch(self, states: list[FeatureState], requests: list[DraftRequest]) -> list[DraftTree]:
        """Every lane's queue in one forward, then every lane's tree grown together, one forward per depth
        (lanes that may draft fewer levels, near their token limit, grow apart)."""
        self._feed(states)
        trees = [DraftTree.empty()] * len(states)
        for depth, lanes in lanes_by_depth(states, requests, self.settings.depth, lambda s: s.last is not None).items():
            for i, tree in zip(lanes, self._expand([states[i] for i in lanes], depth)):
                trees[i] = tree
        return trees

    def _expand(self, states: list[FeatureState], depth: int) -> list[DraftTree]:
        """EAGLE-2's dynamic tree, for every lane at once: grow the top_k best frontier nodes per depth, then
        rerank. A lone lane grows in its own cache (cropped back after); several in a stacked copy. Every tensor of
        the growth lives on the drafter's device, so no depth waits for the host (a GPU runs them back to back)."""
        k, b, dev = self.settings.top_k, len(states), self.device
        accepted = [s.cache.get_seq_length() for s in states]
        width = max(accepted)
        cache = states[0].cache if b == 1 else stacked([s.cache for s in states], accepted)
        head_in, feature = (torch.stack([s.last[j] for s in states]) for j in (0, 1))
        score, tok = self._top(head_in, k)
        # every candidate, level by level; a node's id is its index in the concatenation, per lane
        scores, tokens, logps, parents, depths = [score], [tok], [score], [torch.full_like(tok, -1)], [
            torch.ones_like(tok)]
        frontier, front_tok, front_score = torch.arange(tok.shape[1], device=dev).expand(b, -1), tok, score
        front_feat = feature[:, None].expand(-1, tok.shape[1], -1)
        front_anc = torch.zeros(b, tok.shape[1], 0, dtype=torch.bool, device=dev)  # fed ancestors (none yet)
        fed_anc = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)  # ancestor-or-self among the fed tree nodes
        count, lanes = tok.shape[1], torch.arange(b, device=dev)[:, None]
        try:
            for d in range(1, depth):
                f0, m = fed_anc.shape[1], frontier.shape[1]
                fed_anc = torch.cat([torch.cat([fed_anc, fed_anc.new_zeros(b, f0, m)], dim=2),
                                     torch.cat([front_anc, torch.eye(m, dtype=torch.bool, device=dev).expand(b, m, m)],
                                               dim=2)], dim=1)
                allowed = fed_anc.new_zeros(b, m, width + f0 + m)
                for i, n in enumerate(accepted):
                    allowed[i, :, :n] = True
                allowed[:, :, width:] = fed_anc[:, f0:]
                positions = (torch.tensor(accepted) - 1 + d)[:, None].expand(b, m)
                head_in, feats = self._run(front_feat, self.frozen.vocab_map[front_tok], positions, allowed, cache)
                child_logp, child_tok = self._top(head_in, k)  # [B, m, k]
                child_score = (front_score[:, :, None] + child_logp).reshape(b, -1)
                width_k, n_new = child_tok.shape[2], m * child_tok.shape[2]
                scores.append(child_score)
                tokens.append(child_tok.reshape(b, -1))
                logps.append(child_logp.reshape(b, -1))
                parents.append(frontier.repeat_interleave(width_k, dim=1))
                depths.append(torch.full((b, n_new), d + 1, device=dev))
                best = child_score.topk(min(k, n_new), dim=1).indices
                parent_row = best // width_k  # row of each new frontier node's parent in this level
                frontier, front_tok, front_score = count + best, tokens[-1].gather(1, best), child_score.gather(1, best)
                front_feat, front_anc = feats[lanes, parent_row], fed_anc[:, f0:][lanes, parent_row]
                count += n_new
        finally:
            if b == 1 and cache.get_seq_length() > accepted[0]:
                cache.crop(accepted[0] - cache.get_seq_length())
        flat = [torch.cat(x, dim=1) for x in (scores, tokens, logps, parents, depths)]
        return [self._tree(*(x[i] for x in flat), count, depth) for i in range(b)]

    def _tree(self, score, tokens, logps, parents, depths, count: int, depth: int) -> DraftTree:
        """One lane's candidates reranked: the total_tokens best, a parent always before its children. The tree
        stays where it grew: on a GPU the host reads it with the verify's answer (``core.tree.on_host``)."""
        key = score - 1e-4 * depths  # a parent always outranks its children
        keep, rank = key.topk(min(self.settings.total_tokens, key.numel())).indices.sort()  # ids grow with depth
        index = torch.full((count,), -1, dtype=torch.long, device=keep.device)
        index[keep] = torch.arange(1, keep.numel() + 1, device=keep.device)
        parent_ids = parents[keep]
        parent_input = torch.where(parent_ids < 0, torch.zeros_like(parent_ids), index[parent_ids.clamp_min(0)])
        return DraftTree(self.frozen.vocab_map[tokens[keep]], parent_input, logps[keep],
                         info={"rank": rank, "max_depth": depth})


def stacked(caches: list[DynamicCache], lengths: list[int]) -> DynamicCache:
    """One cache holding each lane's first ``lengths[b]`` positions in its row, padded to the longest (the
    padding is masked from every query)."""
    out, width = DynamicCache(), max(lengths)
    filled = [(b, c.layers[0], n) for b, (c, n) in enumerate(zip(caches, lengths)) if n]
    if not filled:
        return out
    ref = filled[0][1].keys
    keys = ref.new_zeros(len(caches), ref.shape[1], width, ref.shape[3])
    values = torch.zeros_like(keys)
    for b, layer, n in filled:
        keys[b, :, :n], values[b, :, :n] = layer.keys[0, :, :n], layer.values[0, :, :n]
    out.update(keys, values, 0)
    return out
