"""The fp32 LM head of a bf16 target on the CPU: a bf16 product, exact in fp32 wherever it can decide the argmax.

``load.fp32_head`` runs a bf16 model's final norm and head in fp32, because bf16 logits tie (steps of 0.125 at
magnitudes 16-32) and a tree verify and a one-token forward would break the ties differently. On the CPU that
fp32 product over the vocabulary costs about twice the bf16 one (a sizeable share of a small model's step),
and more as the verify's rows grow. Here the head computes, for its fp32 input x and weight W:

1. the coarse logits ``C = bf16(W · bf16(x))``: oneDNN's packed bf16 product (it accumulates in fp32);
2. a bound ``E`` per row on ``|C_v - L_v|`` for every token v near the top, ``L_v = W_v · x`` summed in fp32:
   ``r·‖x - bf16(x)‖`` (the input's rounding, by Cauchy-Schwarz with ``r`` the largest row norm of W)
   ``+ 2γ·r·‖x‖`` (two fp32 sums' rounding, ``γ = K·2⁻²³`` over K inputs) ``+ 2⁻⁸·|max C|`` (the output's
   rounding), with a tenth more for the rest;
3. ``L_v`` for every candidate ``C_v ≥ max C - 2E``, written over its coarse value (or, where the rows have
   more than ``CANDIDATES`` each, as a flat row has, the whole fp32 product instead).

Steps 2 and 3 run in one call of the rows extension where it is built (``rows.cpp``'s ``refine``: the logits
copied to fp32 with their tops, then the candidates: two passes over the logits where ATen's operators take six,
which a tree's rows multiply), each candidate being the rows kernel's own fp32 product; else
as ATen's operators, whose candidate is one fp32 sum. Either way a candidate's value does not depend on the rest
of the forward.

The argmax of the result is the argmax of ``L``: the token with the largest ``L`` is a candidate (its ``C`` is
within E of its ``L``, which is at least the ``L`` of C's argmax, within E of ``max C``), and every other token's
``L`` is below it (below ``max C - E``). A candidate's value is one fp32 dot product of its own row and x, the
same whatever else the forward holds, and, as the fp32 product's, it moves as little as x does (rounding x
to bf16 first would turn the body's last-bit differences between a tree verify and a one-token forward into
jumps of a thousandth, and near-ties would break differently). Tokens far below the top keep bf16
precision (what a bf16 model's own head gives everywhere); those within ``2E`` of the top are exact.

It needs the head's fp32 weight to be bf16 values (a bf16 model's, upcast), no bias, and packing on this
build; under autograd, autocast or inside a ``torch.compile`` graph (``core.capture`` ends its graph before the
head, so this one runs after it), or for an input that is not fp32, it is the plain fp32 product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rows as rows_kernel
from .packing import install, installed, pack, packed_linear, packed_weight

ROW_NORM = "_specviz_row_norm"  # the largest row norm of the head's weight: ``r`` above
CANDIDATES = 512  # candidates a row, on average, past which the whole fp32 product is cheaper than gathering them


def refined_logits(x: torch.Tensor, weight: torch.Tensor, coarse: torch.Tensor, row_norm: float) -> torch.Tensor:
    """The head's logits [..., V] of fp32 ``x`` [..., K] (the module docstring's rule): ``weight`` [V, K] fp32 with
    bf16 values, ``coarse`` the same packed in bf16 (``packing.pack``), ``row_norm`` its largest row norm."""
    flat = x.reshape(-1, x.shape[-1])
    low = flat.to(torch.bfloat16)
    logits = packed_linear(low, coarse)
    if rows_kernel.fits(flat, weight):  # the same rule in one call (``rows.cpp``: two passes over the logits, not six)
        out = torch.ops.specviz_rows.refine(logits.contiguous(), flat.contiguous(), weight, row_norm, CANDIDATES)
        return out.view(*x.shape[:-1], out.shape[-1]) if out.numel() else F.linear(x, weight)
    logits = logits.float()
    top = logits.max(-1).values
    gamma = flat.shape[-1] * 2.0 ** -23
    bound = 1.1 * (row_norm * (flat - low.float()).norm(dim=-1) + 2 * gamma * row_norm * flat.norm(dim=-1)
                   + 2.0 ** -8 * top.abs()) + 1e-30
    rows, cols = (logits >= (top - 2 * bound)[:, None]).nonzero(as_tuple=True)
    if rows.numel() > CANDIDATES * flat.shape[0]:  # a flat row (a zero input ties every token): the whole product
        return F.linear(x, weight)
    logits[rows, cols] = (flat[rows] * weight[cols]).sum(-1)
    return logits.view(*x.shape[:-1], logits.shape[-1])


def _refined_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (x.dtype != torch.float32 or torch.compiler.is_dynamo_compiling() or torch.is_grad_enabled()
            or torch.is_autocast_enabled(x.device.type)):
        return F.linear(x, self.weight, self.bias)
    return refined_logits(x, self.weight, packed_weight(self), getattr(self, ROW_NORM))


def refine_head(model: torch.nn.Module) -> bool:
    """Run ``model``'s fp32 LM head as the module docstring says. Returns whether it does (False: no linear
    head, a bias, weights that are not bf16 values, a device or build that cannot pack bf16)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head.weight.dtype != torch.float32:
        return False
    weight = head.weight.detach()
    low = weight.to(torch.bfloat16)
    if not torch.equal(low.float(), weight):
        return False
    coarse = pack(low)
    if coarse is None:
        return False
    install(head, coarse, _refined_forward)
    setattr(head, ROW_NORM, float(weight.norm(dim=1).max()))
    return True


def refined(model: torch.nn.Module) -> bool:
    """Whether ``model``'s head runs as ``refine_head`` makes it."""
    return installed(model.get_output_embeddings()) is _refined_forward
