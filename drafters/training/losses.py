"""The training objectives of the two trained families, each over a batch of sequences.

- ``feature_loss``: the EAGLE family (EAGLE-2, HASS, FSPAD, EAGLE-3). The drafter reads a feature and the
  next token's embedding and predicts the next feature; ``LossOptions`` says how each method weighs
  feature regression, the token loss, HASS's Top-K term and the unrolled passes (HASS's context alignment,
  EAGLE-3's training-time test).
- ``chain_loss``: the hidden-state heads (Medusa, ReDrafter, semi-AR), teacher-forced over ``depth``
  draft tokens per position.

Both score the draft against the target's own distribution (soft cross-entropy through its frozen LM head)
and return ``(loss, statistics)``; the statistics' ``acc{d}`` is the agreement at depth d the cards report.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specviz.core.tree import additive_mask

from ..vocab_head import FrozenTarget
from .aligned_attention import AlignedLayout, aligned
from .soft_loss import Goal, soft_losses


@dataclass(frozen=True)
class LossOptions:
    """The EAGLE family's objective (every method of it shares the network's interface and this loss)."""

    feature_weight: float = 1.0  # SmoothL1 on the predicted feature
    token_weight: float = 0.1  # soft cross-entropy against the target's distribution
    passes: int = 1  # HASS harmonized context alignment passes (1 = plain EAGLE)
    topk: int = 0  # HASS Top-K distillation K (0 = off)
    topk_weight: float = 0.0
    topk_after: float = 0.0  # the Top-K term joins once this fraction of the training is done (HASS's recipe: 0.8)
    beta: float = 1.0  # weight of pass j is beta ** (j - 1)
    detach: bool = True  # pass j reads pass j-1's prediction without its gradient (HASS); EAGLE-3 keeps it


def aligned_mask(length: int, step: int) -> torch.Tensor:
    """Which keys a query at position t sees in training pass ``step`` (HASS context alignment).

    The keys are the passes' outputs laid side by side: pass 1 (target features) up to t-step+1,
    then one key per later pass i at position t-step+i, as a decoder drafting step-deep would see.
    """
    t = torch.arange(length)[:, None]
    s = torch.arange(length)[None, :]
    blocks = [s <= t - step + 1] + [s == t - step + i for i in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def aligned_passes(net: nn.Module, inputs: torch.Tensor, embeds: torch.Tensor, passes: int,
                   detach: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (head_in, predicted feature) for HASS passes 1..passes over a whole batch.

    Pass 1 reads the target's features. Pass j reads, at position t, the drafter's own pass j-1
    prediction for feature t (detached unless ``detach`` is False: EAGLE-3's training-time test),
    and attends to keys laid out by ``aligned_mask``. ``net`` is called as the decoder calls it:
    ``net(features, embeds, positions, mask, cache) -> (head_in, feature)``.
    """
    b, t = inputs.shape[:2]
    positions = torch.arange(t, device=inputs.device)[None].expand(b, t)
    cache, current = DynamicCache(), inputs
    for step in range(1, passes + 1):
        with aligned(net) as structured:  # the masked-out blocks left out, not weighted zero
            mask = (AlignedLayout(step, t) if structured
                    else additive_mask(aligned_mask(t, step), inputs.dtype).to(inputs.device))
            head_in, pred = net(current, embeds, positions, mask, cache)
        yield head_in, pred
        current = torch.cat([inputs[:, :1], (pred.detach() if detach else pred)[:, :-1]], dim=1)


def feature_loss(net: nn.Module, frozen: FrozenTarget, tokens, feats, valid, opts: LossOptions,
                 done: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over a batch of sequences. ``valid[b, t]``: the prediction made at t counts; ``done``: the
    fraction of the training made (1.0 outside training).

    Position t reads (feature_t, token_{t+1}) and predicts feature_{t+1}, whose LM-head
    distribution is the target's distribution for token_{t+2}. ``feats`` may carry tapped layers
    after the final-norm output (EAGLE-3); the network's ``entry`` picks what it reads.
    """
    hidden = frozen.head.shape[1]
    inputs, goal, valid = net.entry(feats[:, :-1]), feats[:, 1:, :hidden], valid[:, :-1]
    t = inputs.shape[1]
    rows = valid.nonzero(as_tuple=True)  # only these reach the LM head: every pass's positions are among them
    goal = goal[rows]
    topk = opts.topk if opts.topk and done >= opts.topk_after else 0
    with torch.no_grad():
        target = Goal.of(frozen.logits(goal), topk)
    total, stats = 0.0, {}
    passes = aligned_passes(net, inputs, frozen.embed(tokens[:, 1:]), opts.passes, opts.detach)
    for step, (head_in, pred) in enumerate(passes, start=1):
        ok = valid.clone()
        if step > 1:  # the draft must have started at a valid position too
            ok[:, step - 1:] &= valid[:, : t - step + 1]
            ok[:, : step - 1] = False
        w = ok[rows].float()
        n = w.sum().clamp_min(1)
        ce, top_term, agree = soft_losses(frozen.logits(head_in[rows]), target)
        loss = opts.token_weight * (ce * w).sum() / n
        if opts.feature_weight:
            l_feat = (F.smooth_l1_loss(pred[rows].float(), goal.float(), reduction="none").mean(-1) * w).sum() / n
            loss = loss + opts.feature_weight * l_feat
        if top_term is not None:
            loss = loss + opts.topk_weight * (top_term * w).sum() / n
        total = total + opts.beta ** (step - 1) * loss
        stats[f"acc{step}"] = float((agree.float() * w).sum() / n)
        stats[f"loss{step}"] = float(loss.detach())
    return total, stats


def teacher_forced(net: nn.Module, frozen: FrozenTarget, tokens: torch.Tensor, feats: torch.Tensor, depth: int,
                   rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """LM-head inputs for depths 1..depth: position t reads x_t, root t+1 and the true tokens after it.

    ``net`` follows the heads' protocol (``drafters.heads``: start, head, advance). Each output is [B, T, H],
    or [len(rows), H] for only the flat positions ``rows`` of [B*T] when given.
    """
    b, t = tokens.shape
    x = feats.reshape(b * t, -1)
    dense = rows is None
    rows = torch.arange(b * t, device=x.device) if dense else rows
    x = x[rows]

    def embed(shift: int) -> torch.Tensor:  # token t+shift at position t (wraps past the end: masked out)
        return frozen.embed(torch.roll(tokens, -shift, dims=1).reshape(-1)[rows]).to(x.dtype)

    state, outs = net.start(x, embed(1)), []
    for d in range(1, depth + 1):
        out = net.head(state, x, d)
        outs.append(out.reshape(b, t, -1) if dense else out)
        if d < depth:
            state = net.advance(state, embed(1 + d), d)
    return outs


def chain_loss(net: nn.Module, frozen: FrozenTarget, tokens, feats, valid, depth: int,
               evaluate: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft cross-entropy against the target's own distribution for each drafted token.

    The draft at position t and depth d is token t+1+d; the target's distribution for it is its
    LM head on feature t+d. ``valid[b, t]``: position t predicts inside the answer, and depth d
    counts where t+d is valid too. Only those positions go through the network and the LM head
    (padding and prompts would be more than a quarter of the work). With ``evaluate``, also the
    share of positions where the target's top token is rank r of the draft.
    """
    b, t = tokens.shape
    flat_valid = valid.reshape(-1)
    rows = flat_valid.nonzero().squeeze(1)  # flat positions whose depth-1 draft counts
    keeps, needed = [], torch.zeros_like(flat_valid)
    for d in range(1, depth + 1):
        ahead = rows + d
        keep = (ahead % t >= d) & flat_valid[ahead.clamp(max=b * t - 1)]  # t+d: same sequence, and valid
        keeps.append(keep)
        needed[ahead[keep]] = True
    with torch.no_grad():
        goal_rows = needed.nonzero().squeeze(1)
        target = Goal.of(frozen.logits(feats.reshape(b * t, -1)[goal_rows]))
        goal_index = torch.zeros(b * t, dtype=torch.long, device=rows.device)
        goal_index[goal_rows] = torch.arange(goal_rows.numel(), device=rows.device)
    total, stats = 0.0, {}
    for d, head_in in enumerate(teacher_forced(net, frozen, tokens, feats, depth, rows), start=1):
        keep = keeps[d - 1]
        n = max(int(keep.sum()), 1)
        at = goal_index[rows[keep] + d]
        logits = frozen.logits(head_in[keep])
        ce, _, agree = soft_losses(logits, target, at)
        loss = ce.sum() / n
        total = total + loss
        stats[f"acc{d}"] = float(agree.float().sum() / n)
        stats[f"loss{d}"] = float(loss.detach())
        if evaluate:
            logits, top = logits.float(), target.top[at]
            rank = (logits > logits.gather(-1, top[:, None])).sum(-1)
            for r in range(8):
                stats[f"rank{d}_{r}"] = float((rank == r).float().sum() / n)
    return total, stats
