"""Packed oneDNN linear weights: the same numbers as the default kernels, lossless decoding, off under autograd."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_as_ar, train_tiny_drafter
from drafters import build_drafter
from specviz.core.load import prepare
from specviz.core.packing import linear, pack, pack_linears, unpacked
from specviz.core.target import TargetModel

pytestmark = pytest.mark.skipif(pack(torch.ones(2, 2)) is None, reason="this torch build cannot pack for oneDNN")
VOCAB = 32
PROMPTS = [[3, 7, 1, 9, 3, 7, 1], [5, 5, 2, 8, 11, 2, 8], [30, 1, 4, 1, 5, 9, 2, 6]]


def test_packed_linear_matches_the_default_kernel():
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        w, b = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
        packed = pack(w)
        for rows in (1, 3, 8, 17):
            x = torch.randn(2, rows, 24, generator=gen).to(dtype)
            with torch.inference_mode():
                got = linear(x, w, b, packed)
            assert got.shape == (2, rows, 40)
            torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, w, b).float(), rtol=tol, atol=tol)


def test_pack_linears_counts_every_linear_and_keeps_the_logits(tiny_llama):
    model = tiny_llama(VOCAB, seed=0, num_layers=2)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    with torch.inference_mode():
        after = model(ids).logits
        with unpacked(model):
            plain = model(ids).logits
        again = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(plain, before)  # the default kernels inside unpacked(): bit for bit
    assert torch.equal(again, after)  # packed again after it


def test_autograd_and_autocast_fall_back_to_the_dense_weight():
    layer = torch.nn.Linear(8, 4)
    pack_linears(layer)
    x = torch.randn(3, 8)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and torch.allclose(layer.weight.grad, x.sum(0).expand(4, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as training computes features
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("method,settings", [("ar", {}), ("pld", {}), ("lookahead", dict(window=4, ngram=3, guesses=4)),
                                             ("skip", dict(layers=2, num_tokens=3))], ids=str)
def test_packed_target_decodes_as_the_default_one(method, settings, tiny_llama):
    """Greedy output of every method on the packed target is the unpacked target's AR output."""
    plain = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))
    packed = TargetModel(prepare(tiny_llama(VOCAB, seed=0, num_layers=4), pack=True))
    assert packed.packed_linears > 0 and packed.kernels.startswith("oneDNN") and plain.kernels == "default"
    greedy_as_ar(packed, build_drafter(method, packed, **settings), PROMPTS, 30, reference=plain)


@pytest.mark.parametrize("method,settings", [("eagle2", dict(depth=4, top_k=3, total_tokens=10)),
                                             ("medusa", dict(heads=4, top_k=3, total_tokens=10))], ids=str)
def test_trained_drafters_pack_and_stay_lossless(method, settings, tiny_llama, tmp_path):
    """A trained drafter on a packed target decodes on packed weights too (its net and its draft head)."""
    plain = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))
    packed = TargetModel(prepare(tiny_llama(VOCAB, seed=0, num_layers=4), pack=True))
    folder = train_tiny_drafter(packed, method, tmp_path / method)  # training itself runs on the dense weights
    drafter = build_drafter(method, packed, checkpoint=str(folder), **settings)
    assert drafter.frozen.packed_head is not None
    assert any(hasattr(m, "_specviz_packed") for m in drafter.net.modules())
    accepted = greedy_as_ar(packed, drafter, PROMPTS, 30, reference=plain)
    assert accepted > 0, "no draft token was ever accepted: the check is vacuous"
