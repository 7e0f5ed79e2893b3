"""The chunked soft losses equal the operators they replace: values, agreement and gradients."""

from __future__ import annotations

import pytest
import torch

import drafters.training.soft_loss as soft_loss
from drafters.training.soft_loss import Goal, soft_losses


def operators(logits, goal_logits, k, at):
    """The losses as plain operators (what ``feature_loss`` and ``chain_loss`` computed before)."""
    p = torch.softmax(goal_logits.float(), dim=-1)[at]
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -(p * logp).sum(-1)
    top_p, top_i = p.topk(k, dim=-1)
    agree = logits.float().argmax(-1) == goal_logits.float().argmax(-1)[at]
    return ce, -(top_p * logp.gather(-1, top_i)).sum(-1), agree


def case(n=37, m=29, v=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype).requires_grad_()
    goal_logits = torch.randn(m, v, generator=g) * 3
    at = torch.randint(0, m, (n,), generator=g)  # rows of the goal, repeats allowed (chain_loss's depths)
    return logits, goal_logits, at, torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("chunk", [120, 1 << 18], ids=["rows-in-chunks", "one-chunk"])
def test_equals_the_operators(chunk, monkeypatch):
    monkeypatch.setattr(soft_loss, "CHUNK", chunk)
    logits, goal_logits, at, g, h = case()
    ce, top_term, agree = soft_losses(logits, Goal.of(goal_logits, 5), at)
    want = operators(logits, goal_logits, 5, at)
    torch.testing.assert_close(ce, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(top_term, want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(agree, want[2])
    ours = torch.autograd.grad((ce * g).sum() + (top_term * h).sum(), logits)[0]
    theirs = torch.autograd.grad((want[0] * g).sum() + (want[1] * h).sum(), logits)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_one_term_alone_gets_its_own_gradient():
    logits, goal_logits, at, g, _ = case(seed=1)
    ce, top_term, _ = soft_losses(logits, Goal.of(goal_logits, 4), at)
    ours = torch.autograd.grad((top_term * g).sum(), logits)[0]  # the cross-entropy unused: no gradient from it
    want = operators(logits, goal_logits, 4, at)[1]
    torch.testing.assert_close(ours, torch.autograd.grad((want * g).sum(), logits)[0], rtol=1e-5, atol=1e-6)
    ce2, none, _ = soft_losses(logits, Goal.of(goal_logits), at)
    assert none is None
    torch.testing.assert_close(ce2, ce.detach())


def test_gradcheck_float64(monkeypatch):
    monkeypatch.setattr(soft_loss, "CHUNK", 20)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    goal = Goal.of(torch.randn(4, 7, generator=g, dtype=torch.float64), 3)
    at = torch.tensor([0, 3, 3, 1, 2])
    assert torch.autograd.gradcheck(lambda x: soft_losses(x, goal, at)[:2], (logits,))


def test_bf16_logits_are_read_as_they_are():
    """Autocast's bf16 logits: the losses are the fp32 operators' on those same values, the gradient bf16."""
    logits, goal_logits, at, g, _ = case(dtype=torch.bfloat16, seed=3)
    ce, _, _ = soft_losses(logits, Goal.of(goal_logits), at)
    want = operators(logits, goal_logits, 1, at)[0]
    torch.testing.assert_close(ce, want, rtol=1e-5, atol=1e-5)
    grad = torch.autograd.grad((ce * g).sum(), logits)[0]
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, torch.autograd.grad((want * g).sum(), logits)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on a lent one)")
def test_on_a_real_gpu_as_the_operators():
    """On a GPU the rows go in wide chunks (launches count there, not cache); the same values and gradient."""
    logits, goal_logits, at, g, h = case(n=300, m=200, v=4096, seed=4)
    gpu = logits.detach().cuda().requires_grad_()
    ce, top_term, agree = soft_losses(gpu, Goal.of(goal_logits.cuda(), 8), at.cuda())
    want = operators(logits, goal_logits, 8, at)
    torch.testing.assert_close(ce.cpu(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(top_term.cpu(), want[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(agree.cpu(), want[2])
    ours = torch.autograd.grad((ce * g.cuda()).sum() + (top_term * h.cuda()).sum(), gpu)[0].cpu()
    theirs = torch.autograd.grad((want[0] * g).sum() + (want[1] * h).sum(), logits)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
