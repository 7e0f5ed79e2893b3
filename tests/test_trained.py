"""Trained feature drafters (EAGLE-2, HASS, FSPAD, EAGLE-3): the networks' wiring and their training losses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from trained_helpers import HIDDEN, VOCAB, causal
from transformers import DynamicCache

from drafters.eagle2 import Eagle2Drafter, FeatureNet, layer_config
from drafters.eagle3 import Eagle3Drafter
from drafters.fspad import FspadDrafter
from drafters.hass import HassDrafter
from drafters.training.features import extract_features
from drafters.training.losses import aligned_mask, aligned_passes, feature_loss
from drafters.training.soft_loss import Goal, soft_losses
from drafters.vocab_head import FrozenTarget
from specviz.core.target import TargetModel
from specviz.core.tree import additive_mask


@pytest.fixture(scope="module")
def target(tiny_target) -> TargetModel:
    return tiny_target(VOCAB, seed=0, num_layers=2)


def random_inputs(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g)


def capture(module, which: str, store: dict, key: str):
    """Forward hook storing a module's first input ('in') or its output ('out')."""
    if which == "in":
        return module.register_forward_pre_hook(lambda _m, args: store.__setitem__(key, args[0].detach().clone()))
    return module.register_forward_hook(lambda _m, _a, out: store.__setitem__(key, out.detach().clone()))


# -- the network ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", [Eagle2Drafter, FspadDrafter])
def test_feature_net_shapes_and_causality(method, target):
    torch.manual_seed(0)
    net = method.new_network(target).eval()
    b, t = 2, 6
    feats, embeds = random_inputs(b, t)
    positions = torch.arange(t)[None].expand(b, t)
    with torch.no_grad():
        cache = DynamicCache()
        head_in, feature = net(feats, embeds, positions, causal(t), cache)
        assert head_in.shape == feature.shape == (b, t, HIDDEN)
        assert cache.get_seq_length() == t
        assert torch.isfinite(head_in).all() and torch.isfinite(feature).all()
        # causal: changing the last position leaves every earlier output alone
        feats2 = feats.clone()
        feats2[:, -1] += 1.0
        head_in2, _ = net(feats2, embeds, positions, causal(t), DynamicCache())
    torch.testing.assert_close(head_in2[:, :-1], head_in[:, :-1])
    assert not torch.allclose(head_in2[:, -1], head_in[:, -1])


def test_eagle_net_is_a_residual_decoder_layer(target):
    """fused = fuse(feature, embedding); x = fused + attn(fused); out = x + mlp(post_norm(x)), fed back as is."""
    torch.manual_seed(5)
    net = Eagle2Drafter.new_network(target).eval()
    feats, embeds = random_inputs(2, 5, seed=5)
    seen = {}
    hooks = [capture(net.fuse, "out", seen, "fused"), capture(net.post_norm, "in", seen, "x"),
             capture(net.mlp, "in", seen, "mlp_in"), capture(net.mlp, "out", seen, "mlp")]
    hooks.append(net.attn.register_forward_hook(lambda _m, _a, out: seen.__setitem__("attn", out[0].detach())))
    with torch.no_grad():
        head_in, feature = net(feats, embeds, torch.arange(5)[None].expand(2, 5), causal(5), DynamicCache())
        torch.testing.assert_close(seen["fused"], net.fuse(torch.cat([feats, embeds], -1)))
        torch.testing.assert_close(seen["mlp_in"], net.post_norm(seen["x"]))
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(seen["x"], seen["fused"] + seen["attn"])
    torch.testing.assert_close(head_in, seen["x"] + seen["mlp"])
    assert torch.equal(head_in, feature)


# -- Top-K distillation loss -----------------------------------------------------------------------

P_TARGET = [0.1, 0.4, 0.05, 0.3, 0.15]  # top-2: tokens 1 and 3
Q_DRAFT = [0.4, 0.1, 0.2, 0.25, 0.05]  # the draft's own favourite (token 0) is not in the target's top-2


def test_topk_term_by_hand():
    # arbitrary offsets: the loss must normalise the logits itself
    target_logits = torch.tensor([[math.log(p) + 3.0 for p in P_TARGET]] * 3)
    draft_logits = torch.tensor([[math.log(q) - 1.0 for q in Q_DRAFT]] * 3)
    k2 = -(0.4 * math.log(0.1) + 0.3 * math.log(0.25))
    k5 = -sum(p * math.log(q) for p, q in zip(P_TARGET, Q_DRAFT))
    for k, want in ((2, k2), (5, k5), (50, k5)):
        ce, top_term, agree = soft_losses(draft_logits, Goal.of(target_logits, k))
        torch.testing.assert_close(top_term, torch.full((3,), want), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ce, torch.full((3,), k5), rtol=1e-5, atol=1e-6)  # the whole distribution
        assert not agree.any()  # the draft's favourite, token 0, is not the target's (token 1)
    assert soft_losses(draft_logits, Goal.of(target_logits))[1] is None  # no Top-K term asked


def hass_batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    feats = torch.randn(2, 9, HIDDEN, generator=g)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    return tokens, feats, valid


def test_hass_top_k_term_joins_for_the_last_fifth(target):
    """The reference recipe: aligned passes alone, then with the Top-K term (40 + 10 epochs: from 0.8 on)."""
    torch.manual_seed(4)
    net, frozen = HassDrafter.new_network(target).requires_grad_(False), FrozenTarget(target, torch.arange(VOCAB))
    batch = hass_batch()
    without = feature_loss(net, frozen, *batch, replace(HassDrafter.loss, topk=0))[0]
    with_topk = feature_loss(net, frozen, *batch, replace(HassDrafter.loss, topk_after=0.0))[0]
    assert float(with_topk) > float(without) + 0.1  # the term is not negligible, so the switch shows
    assert HassDrafter.loss.topk_after == 0.8
    torch.testing.assert_close(HassDrafter.training_loss(net, frozen, *batch, done=0.0)[0], without)
    torch.testing.assert_close(HassDrafter.training_loss(net, frozen, *batch, done=0.799)[0], without)
    torch.testing.assert_close(HassDrafter.training_loss(net, frozen, *batch, done=0.8)[0], with_topk)
    torch.testing.assert_close(HassDrafter.training_loss(net, frozen, *batch)[0], with_topk)  # outside training


def test_training_tells_the_loss_how_far_it_is(target, monkeypatch):
    """``done`` is the fraction of optimizer steps made before the step: 0 at the first, below 1 at the last."""
    from drafters.training.config import TrainConfig
    from drafters.training.loop import train

    seen = []
    original = HassDrafter.training_loss.__func__

    def spy(cls, net, frozen, tokens, feats, valid, evaluate=False, done=1.0):
        if not evaluate:
            seen.append(done)
        return original(cls, net, frozen, tokens, feats, valid, evaluate, done)

    monkeypatch.setattr(HassDrafter, "training_loss", classmethod(spy))
    gen = torch.Generator().manual_seed(5)
    data = extract_features(target, [(torch.randint(0, VOCAB, (12,), generator=gen), 4) for _ in range(6)])
    cfg = TrainConfig(epochs=2, batch_tokens=32, draft_vocab=VOCAB, device="cpu")
    train(HassDrafter, target, data, data, cfg, {"source": "test"})
    steps = len(seen)
    assert steps >= 4 and seen == [pytest.approx(i / steps) for i in range(steps)]


# -- HASS context alignment ------------------------------------------------------------------------

class Recorder:
    """Calls the net and remembers the features each pass read and what it returned."""

    def __init__(self, net):
        self.net, self.inputs, self.outputs = net, [], []

    def __call__(self, features, *args):
        self.inputs.append(features)
        out = self.net(features, *args)
        self.outputs.append(out)
        return out


def test_aligned_mask_first_pass_is_causal():
    assert torch.equal(aligned_mask(7, 1), torch.ones(7, 7, dtype=torch.bool).tril())
    assert aligned_mask(7, 3).shape == (7, 21)


UNROLLED = [HassDrafter, Eagle3Drafter]  # HASS's aligned passes; EAGLE-3's training-time test


@pytest.mark.parametrize("method", UNROLLED, ids=["hass", "eagle3"])
def test_passes_read_their_own_previous_predictions(method, target):
    """HASS detaches what a pass reads from the pass before; EAGLE-3 lets the gradient through."""
    torch.manual_seed(1)
    net = method.new_network(target)  # training mode, parameters require grad
    feats, embeds = random_inputs(2, 7, seed=1)
    rec = Recorder(net)
    outs = list(aligned_passes(rec, feats, embeds, 3, method.loss.detach))
    assert len(outs) == len(rec.inputs) == 3
    assert torch.equal(rec.inputs[0], feats)
    for j in (1, 2):
        read, previous = rec.inputs[j], rec.outputs[j - 1][1]
        assert torch.equal(read[:, 0], feats[:, 0])
        assert torch.equal(read[:, 1:], previous[:, :-1])
        assert previous.requires_grad and read.requires_grad == (not method.loss.detach)


@pytest.mark.parametrize("method", UNROLLED, ids=["hass", "eagle3"])
def test_pass_j_equals_sequential_drafting(method, target):
    """Pass j at position t == depth j of a drafter that read the real features up to s = t - j + 1."""
    torch.manual_seed(2)
    net = method.new_network(target).eval()
    b, t_len, passes = 2, 8, 3
    feats, embeds = random_inputs(b, t_len, seed=2)
    with torch.no_grad():
        trained = list(aligned_passes(net, feats, embeds, passes))
        checked = 0
        for j in range(1, passes + 1):
            for t in range(j - 1, t_len):
                s = t - j + 1
                cache = DynamicCache()
                pos = torch.arange(s + 1)[None].expand(b, -1)
                head_in, feature = net(feats[:, : s + 1], embeds[:, : s + 1], pos, causal(s + 1), cache)
                head_in, feature = head_in[:, -1:], feature[:, -1:]
                for p in range(s + 1, t + 1):  # feed back its own prediction, one position at a time
                    allowed = torch.ones(1, p + 1, dtype=torch.bool)
                    head_in, feature = net(feature, embeds[:, p : p + 1], torch.full((b, 1), p),
                                           additive_mask(allowed), cache)
                torch.testing.assert_close(head_in[:, 0], trained[j - 1][0][:, t], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(feature[:, 0], trained[j - 1][1][:, t], atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == sum(t_len - j + 1 for j in range(1, passes + 1))
    # and the passes really differ (otherwise the check above proves little)
    assert not torch.allclose(trained[0][0][:, 2:], trained[2][0][:, 2:], atol=1e-3)


# -- FSPAD structure -------------------------------------------------------------------------------

def test_fspad_layers(target):
    net = FspadDrafter.new_network(target)
    h, i = HIDDEN, target.config.intermediate_size
    assert net.sampler_gate.weight.shape == net.sampler_up.weight.shape == (i, h)
    assert net.sampler_down.weight.shape == (h, i)
    assert net.mlp.down_proj.weight.shape == (2 * h, i)
    plain = Eagle2Drafter.new_network(target)
    assert not hasattr(plain, "sampler_down") and plain.mlp.down_proj.weight.shape == (h, i)


def test_fspad_split_halves_and_sampler_inputs(target):
    torch.manual_seed(3)
    net = FspadDrafter.new_network(target).eval()
    feats, embeds = random_inputs(1, 5, seed=3)
    seen = {}
    hooks = [capture(net.post_norm, "in", seen, "x"), capture(net.mlp, "out", seen, "mlp"),
             capture(net.sampler_gate, "in", seen, "gate_in"), capture(net.sampler_norm, "in", seen, "norm_in")]
    with torch.no_grad():
        head_in, feature = net(feats, embeds, torch.arange(5)[None], causal(5), DynamicCache())
        fused = net.fuse(torch.cat([feats, embeds], -1))
    for hook in hooks:
        hook.remove()
    x, out = seen["x"], seen["mlp"]
    assert out.shape[-1] == 2 * HIDDEN
    torch.testing.assert_close(head_in, x + out[..., :HIDDEN])  # first half -> LM head
    torch.testing.assert_close(feature, x + out[..., HIDDEN:])  # second half -> fed-back feature
    assert not torch.allclose(head_in, feature, atol=1e-3)
    # the token embedding gates, the fused feature is projected
    assert torch.equal(seen["gate_in"], embeds)
    torch.testing.assert_close(seen["norm_in"], fused)


def test_fspad_sampler_is_a_residual_branch(target):
    """With sampler_down zeroed the net equals one without a sampler and the same other weights."""
    torch.manual_seed(4)
    net = FspadDrafter.new_network(target).eval()
    bare = FeatureNet(layer_config(target.config), sampler=False, split=True).eval()
    missing, unexpected = bare.load_state_dict(net.state_dict(), strict=False)
    assert not missing and all(k.startswith("sampler_") for k in unexpected)
    feats, embeds = random_inputs(2, 5, seed=4)
    args = (feats, embeds, torch.arange(5)[None].expand(2, 5), causal(5))
    with torch.no_grad():
        with_sampler = net(*args, DynamicCache())
        without = bare(*args, DynamicCache())
        assert not torch.allclose(with_sampler[0], without[0], atol=1e-4)  # the sampler does something
        net.sampler_down.weight.zero_()
        zeroed = net(*args, DynamicCache())
    for a, b in zip(zeroed, without):
        torch.testing.assert_close(a, b)
