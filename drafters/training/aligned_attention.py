"""Attention of HASS's aligned passes without the masked-out blocks (EAGLE-3's training-time test too).

In training pass j the keys are the passes' outputs laid side by side, ``j * T`` of them, and a query at
position t sees only (``losses.aligned_mask``):

- block 1, the target's features, causally shifted: keys s <= t - j + 1;
- one key in each later block i = 2..j: position t - j + i, the drafter's own pass-i output there.

A dense mask over all ``j * T`` keys makes SDPA compute every block: ``T * T`` scores per block, of which the
later blocks keep one a row. Passes 1..j so cost ``j (j + 1) / 2`` blocks where ``j`` would do, and the
first pass's plain causal mask stops the CPU flash kernel from skipping the upper triangle as it does
under ``is_causal``.

Here pass 1 runs causal SDPA; pass j >= 2 scores block 1 in tiles of query rows, each against only the keys
its rows see under the shifted causal mask, and each later block's single key as a row-wise dot product,
takes one softmax over both, and sums the values the same way (``_LaterPass``, with a backward of its own
that recomputes the probabilities, as flash attention does). It is the same attention, with every masked
key left out rather than weighted zero: outputs and gradients equal the dense-mask path to rounding
(``tests/test_aligned_attention.py``).

``aligned(net)`` switches the attention of ``net``'s modules on transformers' SDPA to this function, through
transformers' public ``AttentionInterface``, for the duration of a block; a call whose mask is not an
``AlignedLayout`` goes to transformers' own SDPA unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

NAME = "specviz_aligned_passes"


@dataclass(frozen=True)
class AlignedLayout:
    """Stands for pass ``step``'s mask over ``step * length`` keys (``losses.aligned_mask``), passed where
    the attention's mask goes. Invariant: step >= 1, and the keys are the passes' outputs in pass order."""

    step: int
    length: int


def aligned_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, KVH, L, D]; returns
    ([B, T, H, D], None). An ``AlignedLayout`` mask takes the structured path, anything else SDPA's."""
    if not isinstance(attention_mask, AlignedLayout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    step, t = attention_mask.step, attention_mask.length
    if query.shape[2] != t or key.shape[2] != step * t:
        raise ValueError(f"aligned pass {step} over {t} positions needs {step * t} keys, got {key.shape[2]}")
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step == 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    return _later_pass(query, key, value, step, t, scale).transpose(1, 2).contiguous(), None


def _later_pass(query, key, value, step: int, t: int, scale: float) -> torch.Tensor:
    """Pass ``step`` >= 2 (the module docstring's rule), all heads at once: [B, H, T, D]."""
    singles_k, singles_v = [], []
    for i in range(2, step + 1):  # block i's one key a row sits at t - (step - i): shift the block down that far
        shift = step - i
        k_i, v_i = key[:, :, (i - 1) * t:i * t], value[:, :, (i - 1) * t:i * t]
        singles_k.append(F.pad(k_i, (0, 0, shift, 0))[:, :, :t] if shift else k_i)
        singles_v.append(F.pad(v_i, (0, 0, shift, 0))[:, :, :t] if shift else v_i)
    return _LaterPass.apply(query, key[:, :, :t], value[:, :, :t], torch.stack(singles_k, 2),
                            torch.stack(singles_v, 2), scale)


TILE = 128  # query rows scored at once: a tile's keys end where its last row's do, so the masked corner is skipped


class _LaterPass(torch.autograd.Function):
    """Attention of a later pass as one softmax over block 1 (under the shifted causal mask) and ``n`` single keys a
    row, with flash attention's economy: the queries go in tiles of ``TILE`` rows, each scored only against the
    keys its rows can see, and nothing quadratic is kept for the backward, which recomputes a tile's
    probabilities from the saved log-normaliser.

    q, k1, v1: [B, H, T, D]; ks, vs: [B, H, n, T, D], single j of row t at [..., j, t, :] (already shifted;
    j = n - 1 is the row's own position, the earlier ones lie n - 1 - j rows before it and are absent there
    where that is before the sequence starts). Products run in the inputs' dtype, as bf16 autocast runs
    attention's (on a CPU with bf16 instructions several times faster than fp32); scores, softmax and sums
    in fp32 (fp64 for fp64 inputs)."""

    @staticmethod
    def forward(ctx, q, k1, v1, ks, vs, scale: float):
        work = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(q.shape, dtype=work, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=work, device=q.device)
        for rows, keys in _tiles(q.shape[2], ks.shape[2]):
            probs, single_p, lse[:, :, rows] = _probabilities(q, k1, ks, rows, keys, scale, work)
            out[:, :, rows] = (_mm(probs, v1[:, :, keys], q.dtype, work)
                               + (single_p[..., None] * vs[:, :, :, rows].to(work)).sum(2))
        ctx.save_for_backward(q, k1, v1, ks, vs, out, lse)
        ctx.scale = scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k1, v1, ks, vs, out, lse = ctx.saved_tensors
        work, scale, dtype = out.dtype, ctx.scale, q.dtype
        dq, dks, dvs = (torch.empty(x.shape, dtype=work, device=x.device) for x in (q, ks, vs))
        dk1, dv1 = (torch.zeros(x.shape, dtype=work, device=x.device) for x in (k1, v1))
        for rows, keys in _tiles(q.shape[2], ks.shape[2]):
            probs, single_p, _ = _probabilities(q, k1, ks, rows, keys, scale, work, lse[:, :, rows])
            g, qt = grad_out[:, :, rows], q[:, :, rows]
            ks_t, vs_t = ks[:, :, :, rows].to(work), vs[:, :, :, rows].to(work)
            centre = (g.to(work) * out[:, :, rows]).sum(-1)  # sum over keys of p * dp: softmax's backward subtracts it
            d_scores = _mm(g, v1[:, :, keys].transpose(-1, -2), dtype, work).sub_(centre[..., None]).mul_(probs)
            d_single = single_p * ((g[:, :, None].to(work) * vs_t).sum(-1) - centre[:, :, None])
            d_scores = d_scores.to(dtype)  # cast once, contiguous; the products below read it as they need
            dq[:, :, rows] = (_mm(d_scores, k1[:, :, keys], dtype, work) + (d_single[..., None] * ks_t).sum(2)) * scale
            dk1[:, :, keys] += _mm(qt.transpose(-1, -2), d_scores, dtype, work).transpose(-1, -2) * scale
            dv1[:, :, keys] += _mm(g.transpose(-1, -2), probs, dtype, work).transpose(-1, -2)
            dks[:, :, :, rows] = d_single[..., None] * qt[:, :, None].to(work) * scale
            dvs[:, :, :, rows] = single_p[..., None] * g[:, :, None].to(work)
        return (*(gr.to(x.dtype) for gr, x in zip((dq, dk1, dv1, dks, dvs), (q, k1, v1, ks, vs))), None)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, work: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype`` (the inputs'), the result in ``work``."""
    return (a.to(dtype) @ b.to(dtype)).to(work)


def _tiles(t: int, n: int) -> list[tuple[slice, slice]]:
    """(query rows, block-1 keys they see) per tile: row r sees keys s <= r - n, n = step - 1 (at least one key a
    tile, masked where a row sees none)."""
    return [(slice(a, min(a + TILE, t)), slice(0, max(min(a + TILE, t) - n, 1))) for a in range(0, t, TILE)]


def _probabilities(q, k1, ks, rows: slice, keys: slice, scale: float, work: torch.dtype,
                   lse: torch.Tensor | None = None):
    """(block 1's probabilities [B, H, rows, keys], the singles' [B, H, n, rows], the log-normaliser [B, H, rows])
    of one tile, in ``work``; with ``lse`` given (the backward) it normalises by that instead of computing it."""
    n = ks.shape[2]
    pos, key_pos = torch.arange(rows.start, rows.stop, device=q.device), torch.arange(keys.stop, device=q.device)
    scores = _mm(q[:, :, rows], k1[:, :, keys].transpose(-1, -2), q.dtype, work).mul_(scale)
    scores.masked_fill_(key_pos[None, :] > pos[:, None] - n, float("-inf"))  # block 1: s <= t - step + 1
    singles = (q[:, :, None, rows].to(work) * ks[:, :, :, rows]).sum(-1).mul_(scale)
    absent = pos[None, :] < (n - 1 - torch.arange(n, device=q.device))[:, None]  # [n, rows]: before the start
    singles.masked_fill_(absent, float("-inf"))
    if lse is None:  # every row sees its own position's single, so the maximum is finite
        top = torch.maximum(scores.amax(-1), singles.amax(2))
        scores.sub_(top[..., None]).exp_()
        single_p = (singles - top[:, :, None]).exp_()
        total = scores.sum(-1) + single_p.sum(2)
        return scores.div_(total[..., None]), single_p.div_(total[:, :, None]), top + total.log()
    return scores.sub_(lse[..., None]).exp_(), singles.sub_(lse[:, :, None]).exp_(), lse


@contextlib.contextmanager
def aligned(net: torch.nn.Module):
    """Within the block, ``net``'s attention modules on transformers' SDPA take ``AlignedLayout`` masks; yields
    whether any did (a network on another attention keeps taking dense masks). The name joins transformers'
    registry here, never on import; each config is switched back afterwards."""
    from transformers import AttentionInterface  # here: it loads transformers' model registry

    AttentionInterface.register(NAME, aligned_attention)
    modules = net.modules() if isinstance(net, torch.nn.Module) else ()
    configs = {id(c): c for m in modules if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}
    for c in configs.values():
        c._attn_implementation = NAME
    try:
        yield bool(configs)
    finally:
        for c in configs.values():
            c._attn_implementation = "sdpa"
