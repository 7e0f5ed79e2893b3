"""The aligned passes' structured attention equals the dense-mask attention it replaces, forward and backward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaAttention

import drafters.training.aligned_attention as aligned_attention
from drafters.eagle2 import FeatureNet
from drafters.training import losses
from drafters.training.aligned_attention import NAME, AlignedLayout, aligned
from drafters.training.losses import aligned_mask, aligned_passes
from specviz.core.tree import additive_mask


def attention_module(heads: int = 4, kv_heads: int = 2, dim: int = 8) -> LlamaAttention:
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, num_hidden_layers=1, vocab_size=8, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaAttention(config, layer_idx=0)


def qkv(step: int, t: int, dtype=torch.float32, b: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(10 * step + t)
    make = [(b, heads, t, dim), (b, kv_heads, step * t, dim), (b, kv_heads, step * t, dim)]
    return [(torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in make]


def dense(module, q, k, v, step, t):
    mask = additive_mask(aligned_mask(t, step), q.dtype)
    return sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0]


def structured(module, q, k, v, step, t):
    return aligned_attention.aligned_attention(module, q, k, v, AlignedLayout(step, t), scaling=module.scaling)[0]


@pytest.mark.parametrize("tile", [3, 128], ids=["tiled", "one-tile"])
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_equals_the_dense_mask_forward_and_backward(step, tile, monkeypatch):
    """Every query sees exactly the keys ``aligned_mask`` lets it see, weighted the same, with the same gradients
    for the queries, keys and values (the later blocks' keys carry the earlier passes' gradient in EAGLE-3)."""
    monkeypatch.setattr(aligned_attention, "TILE", tile)
    module, t = attention_module(), 11
    q, k, v = qkv(step, t)
    grad = torch.randn(2, t, 4, 8, generator=torch.Generator().manual_seed(3))
    results = []
    for attend in (dense, structured):
        out = attend(module, q, k, v, step, t)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step", [2, 4])
def test_gradients_are_the_functions_own(step, monkeypatch):
    """fp64 gradcheck of the hand-written backward, across tiles (rows whose block 1 is empty included)."""
    monkeypatch.setattr(aligned_attention, "TILE", 2)
    module, t = attention_module(heads=2, kv_heads=1, dim=3), 6
    q, k, v = qkv(step, t, torch.float64, b=1, heads=2, kv_heads=1, dim=3)
    assert torch.autograd.gradcheck(lambda *x: structured(module, *x, step, t), (q, k, v))


def test_bf16_stays_as_close_to_fp32_as_the_dense_path():
    """In bf16 the products round as autocast's attention does: the error against fp32 stays the dense path's size."""
    module, step, t = attention_module(), 3, 40
    q, k, v = qkv(step, t)
    exact = dense(module, q, k, v, step, t)
    low = [x.detach().bfloat16() for x in (q, k, v)]
    err_dense = (dense(module, *low, step, t).float() - exact).abs().max()
    err_ours = (structured(module, *low, step, t).float() - exact).abs().max()
    assert err_ours <= 2 * err_dense + 1e-2


def test_a_wrong_layout_is_refused():
    module = attention_module()
    q, k, v = qkv(2, 5)
    with pytest.raises(ValueError, match="needs 15 keys"):
        structured(module, q, k, v, 3, 5)


def test_switch_is_scoped_to_the_block(target_net):
    config = target_net.attn.config
    with aligned(target_net) as on:
        assert on and config._attn_implementation == NAME
    assert config._attn_implementation == "sdpa"
    config._attn_implementation = "eager"  # a network on another attention keeps its dense masks
    try:
        with aligned(target_net) as on:
            assert not on and config._attn_implementation == "eager"
    finally:
        config._attn_implementation = "sdpa"


@pytest.fixture
def target_net():
    torch.manual_seed(0)
    config = attention_module(heads=4, kv_heads=2, dim=8).config
    config.intermediate_size, config.rms_norm_eps = 48, 1e-6
    return FeatureNet(config)


@pytest.mark.parametrize("detach", [True, False], ids=["hass", "eagle3"])
def test_passes_train_as_with_the_dense_mask(target_net, detach, monkeypatch):
    """A whole unrolled objective: the same predictions and the same gradient on every parameter."""
    g = torch.Generator().manual_seed(4)
    feats, embeds = torch.randn(2, 9, 32, generator=g), torch.randn(2, 9, 32, generator=g)

    def objective():
        target_net.zero_grad()
        outs = list(aligned_passes(target_net, feats, embeds, 4, detach))
        sum((h ** 2).mean() + f.mean() for h, f in outs).backward()
        return [h.detach() for h, _ in outs], {n: p.grad.clone() for n, p in target_net.named_parameters()}

    ours = objective()
    with monkeypatch.context() as m:
        m.setattr(losses, "aligned", lambda net: _Off())
        want = objective()
    for a, b in zip(ours[0], want[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in want[1]:
        torch.testing.assert_close(ours[1][name], want[1][name], atol=1e-5, rtol=1e-4, msg=name)


class _Off:
    """``aligned`` as it is for a network on another attention: the dense masks."""

    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on a lent one)")
def test_on_a_real_gpu_as_the_dense_mask():
    module, step, t = attention_module(), 3, 300
    q, k, v = (x.detach().cuda().requires_grad_() for x in qkv(step, t))
    grad = torch.randn(2, t, 4, 8, device="cuda")
    results = []
    for attend in (dense, structured):
        out = attend(module.cuda(), q, k, v, step, t)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
