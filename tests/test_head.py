"""The refined LM head (``core.head``) and the argmax rule (``verify.top_ids``): the same top token as the fp32
product, whatever the row count, where a bf16 head alone would tie; and lossless decoding on it."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from conftest import NO_BF16_PACKING, greedy_as_ar
from drafters import build_drafter
from specviz.core.head import refine_head, refined, refined_logits
from specviz.core.load import prepare
from specviz.core.packing import pack, packed_linear, plain_copy, unpacked
from specviz.core.target import TargetModel
from specviz.core.verify import top_ids

pytestmark = NO_BF16_PACKING
VOCAB, K = 512, 64


def test_top_ids_is_argmax_with_its_ties_and_nans():
    x = torch.zeros(3, 1000)
    x[0, [5, 700, 900]] = 1.0  # ties: the first
    x[1] = float("-inf")
    x[1, [9, 10]] = 2.0
    x[2, 100], x[2, 50] = float("nan"), 3.0  # a NaN wins, as argmax's does
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert top_ids(x.to(dtype)).tolist() == x.to(dtype).argmax(-1).tolist() == [5, 9, 100]
    rounded = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).bfloat16().round()  # many ties
    assert torch.equal(top_ids(rounded), rounded.argmax(-1))


def _near_ties(seed: int = 0, rows: int = 48):
    """A head whose tokens 2j and 2j+1 differ by one bf16 step in one weight, and inputs near token pairs' rows:
    the pairs' logits differ by far less than bf16's step at their size, so a bf16 head ties them."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(VOCAB, K, generator=gen) * 0.3).bfloat16()
    bump = torch.randint(0, K, (VOCAB // 2,), generator=gen)
    pairs = torch.arange(0, VOCAB, 2)
    sign = torch.where(torch.rand(VOCAB // 2, generator=gen) < 0.5, -1.0, 1.0)
    up = weight[pairs, bump].float() * (1 + sign * 2.0 ** -7)  # one step up or down
    weight[pairs + 1] = weight[pairs]
    weight[pairs + 1, bump] = up.bfloat16()
    weight = weight.float()
    which = torch.randint(0, VOCAB // 2, (rows,), generator=gen) * 2
    x = weight[which] * 4 + torch.randn(rows, K, generator=gen) * 0.05
    return weight, x


def _exact(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The head's logits in float64."""
    return x.double() @ weight.double().T


def _refined(weight, x):
    return refined_logits(x, weight, pack(weight.bfloat16()), float(weight.norm(dim=1).max()))


@pytest.fixture(params=["rows kernel", "aten"])
def path(request, monkeypatch):
    """Each refined-head test on both forms of the rule: the rows extension's one call, and ATen's operators."""
    from specviz.core import head, rows

    if request.param == "rows kernel" and not rows.available():
        pytest.skip(f"the rows extension is not built here: {rows.unavailable()}")
    if request.param == "aten":
        monkeypatch.setattr(head, "rows_kernel", types.SimpleNamespace(fits=lambda *a: False))
    return request.param


def test_the_rows_kernel_refines_as_atens_operators_do(monkeypatch):
    """The one call (``rows.cpp``'s ``refine``) against the operators: the same top token and the same candidates,
    exact to fp32's rounding of one sum; every other logit the same coarse value, bit for bit."""
    from specviz.core import head, rows

    if not rows.available():
        pytest.skip(f"the rows extension is not built here: {rows.unavailable()}")
    calls = []
    real = torch.ops.specviz_rows.refine
    monkeypatch.setattr(head.torch.ops.specviz_rows, "refine", lambda *a: calls.append(1) or real(*a), raising=False)
    weight, x = _near_ties(seed=4, rows=16)
    with torch.inference_mode():
        got = _refined(weight, x)
        assert calls, "the rows kernel did not run"
        monkeypatch.setattr(head, "rows_kernel", types.SimpleNamespace(fits=lambda *a: False))
        want = _refined(weight, x)
    assert len(calls) == 1 and torch.equal(top_ids(got), top_ids(want))
    exact = _exact(weight, x)
    changed = got != want
    assert changed.sum() >= 1  # candidates, summed in another order
    torch.testing.assert_close(got[changed].double(), exact[changed], rtol=1e-6, atol=1e-5)
    assert torch.equal(got[~changed], want[~changed])


def test_refined_head_finds_the_exact_top_token_where_bf16_ties(path):
    weight, x = _near_ties()
    exact = _exact(weight, x)
    clear = exact.topk(2, dim=-1).values.diff(dim=-1).abs()[:, 0] > 1e-5  # beyond fp32 sums' own rounding
    assert clear.sum() >= 40
    with torch.inference_mode():
        got = _refined(weight, x)
        coarse = packed_linear(x.bfloat16(), pack(weight.bfloat16())).float()
    assert torch.equal(top_ids(got)[clear], exact.argmax(-1)[clear])
    assert (top_ids(coarse) != exact.argmax(-1))[clear].sum() >= 5, "bf16 alone finds them: the test shows nothing"
    best = exact.argmax(-1, keepdim=True)  # the winner's value is its fp32 dot product
    torch.testing.assert_close(got.gather(1, best).double(), exact.gather(1, best), rtol=1e-6, atol=1e-6)
    dropped = weight.norm(dim=1).max() * (x - x.bfloat16().float()).norm(dim=-1, keepdim=True)  # the input's rounding
    assert ((got.double() - exact).abs() <= dropped + 2 ** -8 * exact.abs() + 1e-4).all()  # elsewhere: bf16's error


def test_refined_head_gives_a_row_the_same_top_whatever_the_batch(path):
    weight, x = _near_ties(seed=1)
    with torch.inference_mode():
        whole = _refined(weight, x.view(6, 8, K))
        for i in range(x.shape[0]):
            alone = _refined(weight, x[i:i + 1])[0]
            row = whole.view(-1, VOCAB)[i]
            top = int(top_ids(alone))
            assert int(top_ids(row)) == top and alone[top] == row[top]  # bit for bit


def test_refined_head_makes_every_token_of_a_crowded_top_exact(path):
    weight, x = _near_ties(seed=2, rows=4)
    weight[10: 34] = weight[10]  # many equal top tokens
    x[1] = weight[10] * 4
    with torch.inference_mode():
        got = _refined(weight, x)
    assert int(top_ids(got[1])) == 10  # the first of equals
    assert torch.equal(got[1, 10: 34], got[1, 10].expand(24))  # every one of them exact


def test_refined_head_takes_the_whole_product_for_a_flat_row(monkeypatch, path):
    """A zero input ties every token: all are candidates, and past ``CANDIDATES`` a row the whole fp32 product
    is taken instead of gathering them (on the real vocabulary, 49,152 rows of weights a row)."""
    from specviz.core import head

    weight, x = _near_ties(seed=3, rows=3)
    x[1] = 0.0
    with torch.inference_mode():
        got = _refined(weight, x)
        assert torch.equal(got[1], torch.zeros(VOCAB)) and int(top_ids(got[1])) == 0  # every token, exactly
        monkeypatch.setattr(head, "CANDIDATES", 8)
        assert torch.equal(_refined(weight, x), torch.nn.functional.linear(x, weight))


def _bf16_llama(tiny_llama, num_layers: int = 4):
    model = tiny_llama(VOCAB, seed=0, num_layers=num_layers, std=0.05).to(torch.bfloat16)  # small: ties at bf16
    return prepare(model, pack=True)


def test_prepare_refines_a_bf16_models_head_but_not_an_fp32_ones(tiny_llama):
    model = _bf16_llama(tiny_llama)
    head = model.get_output_embeddings()
    assert refined(model) and head.weight.dtype == torch.float32
    assert "exact in fp32" in TargetModel(model).kernels
    fp32 = prepare(tiny_llama(VOCAB, seed=0, num_layers=2).bfloat16().float(), pack=True)  # bf16 values, fp32 model
    assert not refined(fp32)
    x = torch.randn(2, 3, head.in_features)
    with torch.inference_mode():
        with unpacked(model):  # transformers' own head inside: the fp32 product
            assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
        assert torch.equal(top_ids(head(x)), top_ids(_exact(head.weight, x)))
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))  # autograd on: the fp32 product
    trainable = plain_copy(model)  # a copy to train: no packed weight, the plain head
    assert not refined(trainable) and not hasattr(trainable.get_output_embeddings(), "_specviz_packed")
    assert refine_head(copy.deepcopy(trainable)) is True  # its weights are still bf16 values


@pytest.mark.parametrize("method,settings", [("pld", {}), ("lookahead", dict(window=4, ngram=3, guesses=4)),
                                             ("skip", dict(layers=2, num_tokens=3))], ids=str)
def test_speculation_on_the_refined_head_is_lossless(method, settings, tiny_llama):
    """Greedy speculation on a bf16 target with the refined head gives its own AR output, tree rows and all."""
    target = TargetModel(_bf16_llama(tiny_llama))
    prompts = [[3, 7, 1, 9, 3, 7, 1, 9, 3], [5, 5, 2, 8, 11, 2, 8, 11], [30, 1, 4, 1, 5, 9, 2, 6]]
    accepted = greedy_as_ar(target, build_drafter(method, target, **settings), prompts, 40)
    assert accepted > 0, "no draft token was ever accepted: the check is vacuous"


def test_the_compiled_path_runs_the_refined_head_after_its_graph(tiny_llama, monkeypatch):
    """``--engine compiled`` on a bf16 target: the graph ends at the final norm and the refined head runs eagerly on
    its output (in a graph it would be the plain fp32 product), so a verify's logits are the refined head's of its
    features; speculation on that path gives the path's own AR text."""
    import specviz.core.head as head_module

    target = TargetModel(_bf16_llama(tiny_llama, num_layers=2))
    assert target.use_engine("compiled").path == "compiled"
    head = target.model.get_output_embeddings()
    assert target.captured.head is head
    calls, graph = [], target.captured._fn
    real = head_module.refined_logits
    monkeypatch.setattr(head_module, "refined_logits", lambda *args: calls.append("head") or real(*args))
    monkeypatch.setattr(target.captured, "_fn", lambda **kwargs: calls.append("graph") or graph(**kwargs))
    cache = target.new_cache(64)
    target.prefill([3, 7, 1, 9, 3, 7], cache)
    calls.clear()
    logits, feats = target.forward_rows(torch.tensor([[9, 3, 7]]), torch.arange(6, 9)[None], None, cache)
    assert calls == ["graph", "head"], calls  # the compiled graph, then the refined head
    with torch.inference_mode():
        assert torch.equal(logits, head(feats))
        assert torch.equal(top_ids(logits), top_ids(_exact(head.weight, feats)))
    prompts = [[3, 7, 1, 9, 3, 7, 1, 9, 3], [5, 5, 2, 8, 11, 2, 8, 11]]
    assert greedy_as_ar(target, build_drafter("pld", target), prompts, 32) > 0
