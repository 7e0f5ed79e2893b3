"""The rows kernel (``core.rows``): the default kernel's products, a row's result independent of the rows beside
it, the default kernel wherever it does not fit, and a clear reason where it cannot be built."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specviz.core import rows
from specviz.core.packing import pack_linears, set_plain_rows


def test_it_builds_here_and_computes_the_default_kernels_products():
    assert rows.available(), rows.unavailable()  # x86-64 with AVX2, a compiler and ninja: CI's machine and ours
    gen = torch.Generator().manual_seed(0)
    for k in (16, 64, 576):
        for n in (1, 3, 7, 33, 100):
            w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            for m in (1, 2, 3, 5, 8, 9, 16, 20):
                x = torch.randn(m, k, generator=gen)
                with torch.inference_mode():
                    got = rows.linear(x, w, b)
                torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)
    x = torch.randn(2, 3, 64, generator=gen)  # rows: every dimension but the last
    w = torch.randn(10, 64, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(rows.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: a one-token forward's product and the same row inside a tree verify's."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 576, generator=gen)
    x = torch.randn(20, 576, generator=gen)
    with torch.inference_mode():
        alone = torch.cat([rows.linear(x[i:i + 1], w) for i in range(20)])
        for m in (2, 4, 8, 12, 20):
            assert torch.equal(rows.linear(x[:m], w), alone[:m]), m


def test_the_default_kernel_runs_wherever_it_does_not_fit():
    gen = torch.Generator().manual_seed(2)
    cases = [(torch.randn(3, 21, generator=gen), torch.randn(5, 21, generator=gen)),  # inner size no width divides
             (torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(5, 32, generator=gen).bfloat16()),
             (torch.randn(3, 32, generator=gen), torch.randn(32, 5, generator=gen).t())]  # a weight not contiguous
    with torch.inference_mode():
        for x, w in cases:
            assert not rows.fits(x, w) and torch.equal(rows.linear(x, w), F.linear(x, w))
    x, w = torch.randn(3, 32, generator=gen, requires_grad=True), torch.randn(5, 32, generator=gen)
    assert not rows.fits(x, w)  # autograd: the default kernel, which has a backward
    rows.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, 32))


def test_a_packed_layers_plain_calls_run_on_it():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 40)
    pack_linears(layer, plain_rows=8)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.ops.specviz_rows.linear(x, layer.weight) + layer.bias)
    set_plain_rows(layer, 0)


def test_a_failed_build_says_why_and_the_default_kernels_serve(monkeypatch, tmp_path):
    broken = tmp_path / "rows.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(rows, "SOURCE", broken)
    monkeypatch.setattr(rows, "_build_folder", lambda: tmp_path / "build")
    monkeypatch.setattr(rows, "_width", None)  # not loaded yet in this process
    assert not rows.available() and "did not build" in rows.unavailable()
    x, w = torch.randn(2, 32), torch.randn(4, 32)
    with torch.inference_mode():
        assert not rows.fits(x, w) and torch.equal(rows.linear(x, w), F.linear(x, w))
    assert rows.plain_name() == "default kernels"
    monkeypatch.undo()
    rows._width = None  # built and loaded again from the real source
    assert rows.available() and rows.plain_name() == "the rows kernel"
