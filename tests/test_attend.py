"""The few-query attention kernel (``attend.cpp``, reached through ``core.attention``): transformers' SDPA output
for every layout it takes, each row a function of its query and the keys it sees alone (bit for bit, whatever
rows sit beside it or masked keys between), and which calls take it."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import specviz.core.attention as attention
from conftest import make_llama
from specviz.core import rows


@pytest.fixture(autouse=True)
def built():
    """Built inside a test, under the suite's own cache folder (``conftest``), never at collection."""
    assert rows.available(), rows.unavailable()  # CI's machine and ours build it (``test_rows``)


def attend(q, k, v, mask=None, scale=0.25):
    return torch.ops.specviz_rows.attend(q, k, v, mask, scale)


def reference(q, k, v, mask=None, scale=0.25):
    """transformers' own SDPA path, in float64 (grouped heads repeated), as [B, Q, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def inputs(b, heads, kv_heads, q, length, dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, q, dim, generator=gen).to(dtype),
            torch.randn(b, kv_heads, length, dim, generator=gen).to(dtype),
            torch.randn(b, kv_heads, length, dim, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 257, 64), (2, 4, 2, 3, 10, 16), (3, 4, 2, 7, 20, 12),
                                   (1, 4, 4, 6, 33, 32), (2, 6, 2, 64, 80, 8)], ids=str)
def test_it_gives_sdpa_output_for_every_mask_layout(shape, dtype):
    """No mask (one query), a boolean mask per sequence, an additive one per head with the most negative number;
    heads in groups or not, head sizes off the vector width, up to ``FEW`` queries."""
    b, heads, kv_heads, q_len, length, dim = shape
    q, k, v = inputs(*shape, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    seen = torch.rand(b, heads, q_len, length, generator=gen) > 0.4
    seen[..., 0] = True  # no row sees nothing (SDPA's answer there is NaN)
    masks = [seen[:, :1], torch.zeros(1 if b == 1 else b, heads, q_len, length, dtype=dtype).masked_fill(
        ~seen[:1] if b == 1 else ~seen, torch.finfo(dtype).min)]
    if q_len == 1:
        masks.append(None)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for mask in masks:
        got = attend(q, k, v, mask)
        assert got.shape == (b, q_len, heads, dim) and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.double(), reference(q, k, v, mask), **tolerance)


def test_it_reads_keys_and_values_through_their_strides():
    """A cache's live rows are a view of a larger store: the same output as from contiguous copies."""
    q, k, v = inputs(2, 6, 3, 4, 40, 16)
    store_k, store_v = torch.randn(2, 3, 64, 16), torch.randn(2, 3, 64, 16)
    store_k[:, :, :40], store_v[:, :, :40] = k, v
    mask = torch.rand(1, 1, 4, 40, generator=torch.Generator().manual_seed(2)) > 0.2
    mask[..., 0] = True
    view_q = torch.randn(2, 4, 6, 16).transpose(1, 2)  # [B, H, Q, D] with its heads not outermost
    view_q.copy_(q)
    assert torch.equal(attend(view_q, store_k[:, :, :40], store_v[:, :, :40], mask), attend(q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_alone_beside_others_and_with_masked_gaps(dtype):
    """A tree verify's row against the one-token forward over the same keys: the row among 7 queries, its keys
    spread with unseen ones between them, gives bit for bit what the query alone over those keys, packed, gives."""
    q, k, v = inputs(1, 6, 2, 7, 30, 16, dtype=dtype, seed=3)
    seen = torch.rand(1, 1, 7, 30, generator=torch.Generator().manual_seed(4)) > 0.5
    seen[..., :3] = True
    tree = attend(q, k, v, seen)
    additive = attend(q, k, v, torch.zeros(1, 1, 7, 30, dtype=dtype).masked_fill(~seen, float("-inf")))
    assert torch.equal(tree, additive)
    for row in range(7):
        keep = seen[0, 0, row].nonzero()[:, 0]
        alone = attend(q[:, :, row:row + 1].contiguous(), k[:, :, keep].contiguous(), v[:, :, keep].contiguous())
        assert torch.equal(alone[:, 0], tree[:, row]), row


def test_a_row_that_sees_nothing_is_zero():
    q, k, v = inputs(1, 2, 1, 2, 5, 8)
    seen = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    seen[0, 0, 1] = False
    out = attend(q, k, v, seen)
    assert torch.equal(out[:, 1], torch.zeros(1, 2, 8)) and torch.isfinite(out).all()


def test_bad_inputs_are_refused_with_a_message():
    q, k, v = inputs(1, 4, 2, 2, 6, 8)
    with pytest.raises(RuntimeError, match="H a multiple of KVH"):
        attend(q[:, :3], k, v, torch.ones(1, 1, 2, 6, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="mask"):
        attend(q, k, v, torch.ones(1, 1, 2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="fp32 or bf16 alike"):
        attend(q.half(), k.half(), v.half(), None)


def test_which_calls_take_the_kernel(monkeypatch):
    """Up to ``FEW`` queries with a mask (or one without), no autograd: the kernel, with SDPA's output; a prompt's
    queries without a mask (causal), more than ``FEW``, or a call that records gradients: SDPA."""
    module = make_llama(64, 0, 1).model.layers[0].self_attn
    calls = []
    real = torch.ops.specviz_rows.attend
    monkeypatch.setattr(attention.torch.ops.specviz_rows, "attend", lambda *a: calls.append(1) or real(*a),
                        raising=False)

    def run(q_len, mask, grad=False):
        q, k, v = inputs(1, 4, 2, q_len, 70, 16, seed=q_len)
        m = None if not mask else torch.ones(1, 1, q_len, 70, dtype=torch.bool).tril(70 - q_len)
        before = len(calls)
        with torch.set_grad_enabled(grad):
            got, _ = attention.grouped_sdpa(module, q, k, v, m, scaling=0.25)
            want, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.25, is_causal=m is None and q_len > 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return len(calls) > before

    assert run(1, mask=False) and run(1, mask=True) and run(attention.FEW, mask=True)
    assert not run(3, mask=False) and not run(attention.FEW + 1, mask=True) and not run(2, mask=True, grad=True)
