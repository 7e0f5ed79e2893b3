"""Attention of a grouped-query target under a mask, without copying its cache in every layer.

A verify forward feeds several queries under a 4D mask (a tree, a batch's rows, a whole buffer). For a
grouped-query model (fewer key/value heads than query heads), transformers' SDPA path then repeats the
keys and values once per query head (``repeat_kv``): a copy of the layer's whole cache, in every layer, at
every step, growing with the context. (PyTorch's own ``enable_gqa`` would avoid it, but on CUDA it falls
back to the math kernel when a mask is given, so transformers only uses it without one.)

Here a group's query heads are stacked as extra query rows instead, the way transformers already does for
a single query: the queries ``[B, H, q, D]`` become ``[B, KVH, groups * q, D]``, row ``r * q + t`` of
group ``j`` being head ``j * groups + r``'s query ``t`` (the head ``repeat_kv`` pairs with key/value head
``j``), the mask's rows are repeated ``groups`` times to match (``q * L`` values, not ``H * L * D``), and
the output is laid back out as ``[B, q, H, D]``. transformers does the same for one query, but not under
``torch.compile``, where a CUDA graph's one-token step over the whole buffer would copy it; so one query
takes this path too, with or without a mask. That matters on the CPU too: SDPA reading the grouped heads itself
(``enable_gqa``) runs one query per head through its flash kernel, which took 108 us a layer for one bf16 query
over 257 keys on a 2-core Zen 4 against 23 us for the same heads stacked as three query rows (a tenth of a decode
step, every layer); fp32 decodes came out identical, bf16 ones round differently at near-ties. Every other
call (several queries without a mask, no groups, a position bias) goes to transformers' own SDPA function
unchanged: without a mask it lets SDPA read the grouped heads itself, as fast as stacking there.

**A few queries run on our own kernel** on the CPU (``attend.cpp`` in the rows extension, ``core.rows``): up to
``FEW`` queries a call (a decode step's one, a verify's tree), fp32 or bf16, without autograd. PyTorch's flash
kernel is built for long queries; for a decode step's three query rows over 257 keys it spent 25 us a layer alone
and 45 inside a forward, mostly fixed costs. The kernel runs each key/value head's rows together, reading each
key and value once for four rows, and makes every row a function of its query and of the keys it sees, in
order, alone: a tree verify's row is bit for bit the one-token forward's over the same keys, whatever masked
gaps lie between them. Several queries without a mask (a prompt, causal) and everything else stay on SDPA.

``use_grouped_attention`` registers it with transformers' public ``AttentionInterface`` (and SDPA's mask
builder with ``AttentionMaskInterface``) under ``NAME`` and switches a model on SDPA to it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import rows

NAME = "specviz_grouped_sdpa"
REVISION = 3  # bump where its cost changes, so budgets tuned on the old are measured again (``apps.machine``)


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, KVH, L, D], an additive or
    boolean mask [B or 1, 1 or H, q, L]; returns ([B, q, H, D], None)."""
    if few_queries(module, query, key, value, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.specviz_rows.attend(query, key, value, attention_mask, float(scale)), None
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, dim = query.shape
    mask = attention_mask  # None: every key visible, which only one query (a decode step) may stack without one
    if (groups == 1 or key.shape[1] * groups != heads or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or (mask is None and q > 1)
            or (mask is not None and (mask.dim() != 4 or mask.shape[-1] != key.shape[2]
                                      or mask.shape[1] not in (1, heads)))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    stacked = query.reshape(b, kv_heads, groups * q, dim)
    if mask is not None and mask.shape[1] == 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * q, length)
    elif mask is not None:
        mask = mask.reshape(mask.shape[0], kv_heads, groups * q, length)
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.reshape(b, heads, q, dim).transpose(1, 2).contiguous(), None


FEW = 64  # queries a call up to which ``attend.cpp`` runs them: a tree verify's rows (a longer prompt is SDPA's)
_UNSUPPORTED = ("position_bias", "softcap", "sliding_window", "s_aux")  # terms the kernel does not compute


def few_queries(module, query, key, value, mask, dropout, kwargs) -> bool:
    """Whether this call runs on ``attend.cpp`` (the module docstring's rule): the CPU, fp32 or bf16 alike, no
    autograd or dropout, up to ``FEW`` queries (one without a mask: several would need a causal one), a 4D mask
    laid out as the kernel reads it, the rows extension loaded."""
    b, heads, q, _ = query.shape
    if (query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16)
            or key.dtype != query.dtype or value.dtype != query.dtype or torch.is_grad_enabled()
            or (dropout and module.training) or q > FEW or (mask is None and q > 1)
            or any(kwargs.get(name) is not None for name in _UNSUPPORTED)
            or key.shape[1] == 0 or heads % key.shape[1] or key.shape != value.shape
            or min(query.stride(-1), key.stride(-1), value.stride(-1)) != 1):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, heads)
                             or mask.shape[2] != q or mask.shape[3] != key.shape[2]
                             or mask.dtype not in (torch.bool, query.dtype)):
        return False
    return rows.loaded() if torch.compiler.is_dynamo_compiling() else rows.available()


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Run ``model``'s attention through ``grouped_sdpa`` where it runs transformers' SDPA on grouped heads.
    Returns whether it switched (a model on eager or flash attention, or without groups, is left as it is).
    The name joins transformers' global registries here, never on import (importing must not change them)."""
    config = model.config
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    from transformers import AttentionInterface  # here: it loads transformers' model registry, which a model has

    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True


@contextlib.contextmanager
def transformers_attention(model: torch.nn.Module):
    """Run ``model`` on transformers' own SDPA inside the block, where ``use_grouped_attention`` switched it
    (transformers' ``generate`` as its users get it); one decode at a time, like ``packing.unpacked``."""
    switched = getattr(model.config, "_attn_implementation", None) == NAME
    if switched:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(NAME)
