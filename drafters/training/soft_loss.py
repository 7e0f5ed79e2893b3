"""A draft's cross-entropy against the target's own distribution over the draft vocabulary, row by row, in place.

Every trained drafter scores its LM-head logits ``x`` (one row a scored position, ``V'`` columns) against the
target's probabilities ``p`` at that position:

- the soft cross-entropy ``-sum_v p_v log softmax(x)_v = lse(x) S - p . x`` with ``S = sum_v p_v``;
- HASS's Top-K term, the same sum over the target's top k only (``S_K``, ``p_K``);
- and, for the statistics, whether the draft's top token is the target's.

Their gradient with respect to ``x`` is ``softmax(x) (g S + h S_K) - g p - h p_K`` for the two terms' output
gradients ``g`` and ``h``. Written as operators, the loss makes a dozen passes over ``[rows, V']`` fp32
tensors (the fp32 copy, log-softmax, the product, and each of their backwards), and those are memory-bound:
on a 2-core CPU they took as long as the LM head's products themselves. Here the rows go in chunks that
stay in cache, each read twice forward (max and sum, as ``logsumexp`` does) and once backward, with nothing
the size of the logits kept but the logits themselves (which autocast already made; they are read in
their own dtype and worked on in fp32). The result equals the operators' to rounding
(``tests/test_soft_loss.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 1 << 18  # elements of a chunk of rows on a CPU: 1 MiB in fp32, a core's share of cache
WIDE_CHUNK = 1 << 26  # elsewhere: few launches matter there, not cache, so chunks only bound the memory


@dataclass(frozen=True)
class Goal:
    """The target's distribution at the scored positions, computed once a step and read by every pass or depth.

    Invariants: ``probs`` [N, V'] fp32 rows sum to 1; ``top`` [N] is each row's argmax; ``top_i`` / ``top_p``
    [N, K] are its K most likely ids and their probabilities, or None without a Top-K term."""

    probs: torch.Tensor
    top: torch.Tensor
    top_i: torch.Tensor | None = None
    top_p: torch.Tensor | None = None

    @classmethod
    @torch.no_grad()
    def of(cls, logits: torch.Tensor, k: int = 0) -> "Goal":
        logits = logits.float()
        probs, top = torch.softmax(logits, dim=-1), logits.argmax(-1)
        if not k:
            return cls(probs, top)
        top_p, top_i = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return cls(probs, top, top_i, top_p)


def soft_losses(logits: torch.Tensor, goal: Goal, at: torch.Tensor | None = None):
    """(cross-entropy [N], Top-K term [N] or None, agreement [N] bool) of ``logits`` [N, V'] against
    ``goal``'s rows ``at`` (all of them, in order, when None). Differentiable in ``logits``."""
    at = torch.arange(logits.shape[0], device=logits.device) if at is None else at
    topk = goal.top_i is not None
    empty = logits.new_empty(0)
    ce, tk, top = _SoftLosses.apply(logits, goal.probs, at, goal.top_i if topk else empty,
                                    goal.top_p if topk else empty)
    return ce, (tk if topk else None), top == goal.top[at]


class _SoftLosses(torch.autograd.Function):
    """The module docstring's losses; ``top_i`` empty means no Top-K term (its output is zeros)."""

    @staticmethod
    def forward(ctx, logits, probs, at, top_i, top_p):
        n, work = logits.shape[0], torch.promote_types(logits.dtype, torch.float32)
        ce, tk, lse = (torch.zeros(n, dtype=work, device=logits.device) for _ in range(3))
        top = torch.empty(n, dtype=torch.long, device=logits.device)
        sums, top_sums = torch.empty_like(ce), torch.zeros_like(ce)
        for rows in _chunks(n, logits.shape[1], logits.device):
            x, p = logits[rows].to(work), probs[at[rows]].to(work)
            lse[rows], sums[rows], top[rows] = torch.logsumexp(x, -1), p.sum(-1), x.argmax(-1)
            ce[rows] = lse[rows] * sums[rows] - (p * x).sum(-1)
            if top_i.numel():
                ids, tp = top_i[at[rows]], top_p[at[rows]]
                top_sums[rows] = tp.sum(-1)
                tk[rows] = lse[rows] * top_sums[rows] - (tp * x.gather(-1, ids)).sum(-1)
        ctx.save_for_backward(logits, probs, at, top_i, top_p, lse, sums, top_sums)
        ctx.mark_non_differentiable(top)
        return ce, tk, top

    @staticmethod
    def backward(ctx, g_ce, g_tk, _):
        logits, probs, at, top_i, top_p, lse, sums, top_sums = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g_ce = torch.zeros_like(lse) if g_ce is None else g_ce.to(lse.dtype)
        g_tk = torch.zeros_like(lse) if g_tk is None or not top_i.numel() else g_tk.to(lse.dtype)
        for rows in _chunks(*logits.shape, logits.device):
            g, h = g_ce[rows, None], g_tk[rows, None]
            d = (logits[rows].to(lse.dtype) - lse[rows, None]).exp_()
            d.mul_(g * sums[rows, None] + h * top_sums[rows, None]).addcmul_(probs[at[rows]].to(d.dtype), g, value=-1.0)
            if top_i.numel():
                d.scatter_add_(-1, top_i[at[rows]], -h * top_p[at[rows]].to(d.dtype))
            grad[rows] = d
        return grad, None, None, None, None


def _chunks(n: int, width: int, device: torch.device) -> list[slice]:
    size = max(1, (CHUNK if device.type == "cpu" else WIDE_CHUNK) // max(1, width))
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
