"""Trained feature drafters (EAGLE-2, HASS, FSPAD, EAGLE-3): network, losses, checkpoints, dynamic tree, corpus."""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import DynamicCache

from conftest import train_tiny_drafter
from drafters import build_drafter, checkpoint, corpus
from drafters.checkpoint import CheckpointError
from drafters.eagle2 import (
    Eagle2Drafter,
    FeatureNet,
    aligned_mask,
    aligned_passes,
    feature_loss,
    layer_config,
    topk_distill_loss,
)
from drafters.eagle3 import Eagle3Drafter
from drafters.fspad import FspadDrafter
from drafters.hass import HassDrafter
from drafters.trained import TrainedDrafter
from drafters.vocab_head import FrozenTarget, draft_vocabulary
from specviz.core.engine import run
from specviz.core.errors import SpecvizError
from specviz.core.protocol import Commit, Drafter, DraftRequest
from specviz.core.target import TargetModel
from specviz.core.tree import additive_mask
from specviz.core.verify import Sampling

VOCAB, HIDDEN = 64, 64
METHODS = ("eagle2", "hass", "fspad", "eagle3")


@pytest.fixture(scope="module")
def target(tiny_target) -> TargetModel:
    return tiny_target(VOCAB, seed=0, num_layers=2)


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory) -> dict:
    """One tiny checkpoint per method, trained for ``target`` through the real pipeline."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {m: train_tiny_drafter(target, m, root / m) for m in METHODS}


def load(target, checkpoints, method: str, **settings):
    return build_drafter(method, target, checkpoint=str(checkpoints[method]), **settings)


def causal(t: int) -> torch.Tensor:
    return additive_mask(torch.ones(t, t, dtype=torch.bool).tril())


def random_inputs(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, HIDDEN, generator=g), torch.randn(b, t, HIDDEN, generator=g)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))] for _ in range(n)]


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


def test_topk_distill_loss_by_hand():
    # arbitrary offsets: the loss must normalise the logits itself
    target_logits = torch.tensor([[math.log(p) + 3.0 for p in P_TARGET]])
    draft_logits = torch.tensor([[math.log(q) - 1.0 for q in Q_DRAFT]])
    k2 = -(0.4 * math.log(0.1) + 0.3 * math.log(0.25))
    k5 = -sum(p * math.log(q) for p, q in zip(P_TARGET, Q_DRAFT))
    assert float(topk_distill_loss(target_logits, draft_logits, 2)[0]) == pytest.approx(k2, rel=1e-5)
    assert float(topk_distill_loss(target_logits, draft_logits, 5)[0]) == pytest.approx(k5, rel=1e-5)
    assert float(topk_distill_loss(target_logits, draft_logits, 50)[0]) == pytest.approx(k5, rel=1e-5)
    # per position over a batch: [B, T, V] -> [B, T]
    both = topk_distill_loss(target_logits.expand(2, 3, 5), draft_logits.expand(2, 3, 5), 2)
    assert both.shape == (2, 3)
    torch.testing.assert_close(both, torch.full((2, 3), k2))


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
    from drafters.train import TrainConfig, train

    seen = []
    original = HassDrafter.training_loss.__func__

    def spy(cls, net, frozen, tokens, feats, valid, evaluate=False, done=1.0):
        if not evaluate:
            seen.append(done)
        return original(cls, net, frozen, tokens, feats, valid, evaluate, done)

    monkeypatch.setattr(HassDrafter, "training_loss", classmethod(spy))
    gen = torch.Generator().manual_seed(5)
    data = corpus.extract_features(target, [(torch.randint(0, VOCAB, (12,), generator=gen), 4) for _ in range(6)])
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


# -- checkpoints -----------------------------------------------------------------------------------

class Twin(Drafter):
    """Drives two drafters on the same history; the first one's trees go to the engine."""

    name = "twin"

    def __init__(self, main, other):
        self.main, self.other, self.log = main, other, []

    def reset(self):
        self.main.reset()
        self.other.reset()

    def observe(self, commit):
        self.main.observe(commit)
        self.other.observe(commit)

    def propose(self, request):
        tree = self.main.propose(request)
        self.log.append((request.max_depth, tree, self.other.propose(request)))
        return tree


@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_round_trip(method, target, checkpoints):
    folder = checkpoints[method]
    drafter = load(target, checkpoints, method, depth=3, top_k=3, total_tokens=8)
    saved = load_file(str(folder / "weights.safetensors"))
    assert saved["vocab_map"].dtype == torch.int32
    assert torch.equal(drafter.frozen.vocab_map, saved.pop("vocab_map").long())
    state = drafter.net.state_dict()
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(state[name], value.float()), name
    card = json.loads((folder / "card.json").read_text())
    assert card["method"] == method and drafter.card == card
    assert card["target"]["hidden_size"] == HIDDEN and card["target"]["vocab_size"] == VOCAB
    assert card["data"]["source"] and card["training"]["steps"] > 0
    assert card["parameters"]["extra_memory_pct"] > 0
    assert card["parameters"]["trained"] == sum(p.numel() for p in drafter.net.parameters())
    # a second load drafts the same trees on the same history
    twin = Twin(drafter, load(target, checkpoints, method, depth=3, top_k=3, total_tokens=8))
    run(target, twin, prompts(1, seed=5)[0], 12, stop_on_eos=False)
    assert len(twin.log) > 3
    for _, a, b in twin.log:
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)


# -- the dynamic draft tree -----------------------------------------------------------------------

def path_keys(tree) -> list[tuple[int, ...]]:
    """Each node's token path from the root (its identity across trees)."""
    keys = []
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        keys.append((keys[parent - 1] if parent else ()) + (tok,))
    return keys


def cumulative(tree) -> torch.Tensor:
    """Sum of draft log-probs along each node's path, accumulated as the drafter does."""
    score = []
    for lp, parent in zip(tree.logprobs, tree.parents.tolist()):
        score.append(lp if parent == 0 else score[parent - 1] + lp)
    return torch.stack(score) if score else torch.zeros(0)


def check_tree_shape(tree, depth: int, budget: int):
    assert 1 <= len(tree) <= budget
    assert tree.max_depth <= depth
    assert bool((tree.parents < torch.arange(1, len(tree) + 1)).all())
    keys = path_keys(tree)
    assert len(set(keys)) == len(keys), "duplicate (parent, token) siblings"
    score = cumulative(tree)
    for i, parent in enumerate(tree.parents.tolist()):
        if parent:
            assert score[i] <= score[parent - 1]


TREE_SETTINGS = [(4, 3, 10), (2, 5, 7), (6, 2, 8), (3, 1, 3), (5, 4, 1)]  # depth, top_k, total_tokens


@pytest.mark.parametrize("depth, top_k, total", TREE_SETTINGS)
def test_dynamic_tree_keeps_the_best_candidates(depth, top_k, total, target, checkpoints):
    """Every tree against the full candidate tree (same drafter, budget 256) on the same history."""
    drafter = load(target, checkpoints, "eagle2", depth=depth, top_k=top_k, total_tokens=total)
    full = load(target, checkpoints, "eagle2", depth=depth, top_k=top_k, total_tokens=256)
    twin = Twin(drafter, full)
    for p in prompts(2, seed=6):
        run(target, twin, p, 16, stop_on_eos=False)
    assert len(twin.log) > 4
    for max_depth, tree, every in twin.log:
        d = min(depth, max_depth)
        count = top_k + (d - 1) * top_k * top_k  # top_k roots, then top_k frontier nodes x top_k children
        assert len(every) == count  # the full tree keeps every candidate
        check_tree_shape(every, d, 256)
        check_tree_shape(tree, d, total)
        assert len(tree) == min(total, count)
        # per depth, exactly the top_k best nodes were expanded, each into top_k children
        score, kids = cumulative(every), every.children()
        for level in range(1, d):
            at = (every.depths == level).nonzero().flatten().tolist()
            grown = [n for n in at if kids[n + 1]]
            assert len(grown) == min(top_k, len(at)) and all(len(kids[n + 1]) == top_k for n in grown)
            rest = [n for n in at if n not in grown]
            if rest:
                assert float(score[grown].min()) >= float(score[rest].max()) - 1e-6
        # the kept nodes are the best of all candidates by cumulative log-prob
        keys, all_keys = path_keys(tree), path_keys(every)
        index = {k: n for n, k in enumerate(all_keys)}
        assert set(keys) <= set(index)
        kept = [index[k] for k in keys]
        torch.testing.assert_close(tree.logprobs, every.logprobs[kept])
        dropped = [n for n in range(len(every)) if n not in set(kept)]
        if dropped:  # up to a 1e-4-per-depth tie-break that favours parents
            assert float(score[kept].min()) >= float(score[dropped].max()) - 2e-3


@torch.inference_mode()
def show_prompt(drafter, target, prompt):
    """Prefill the target and let the drafter observe the prompt; returns (its features, sequence + root)."""
    cache = target.new_cache()
    logits, feats = target.prefill(prompt, cache)
    first = int(logits.argmax())
    drafter.reset()
    drafter.observe(Commit(torch.tensor(prompt), feats, first))
    return feats, prompt + [first]


@torch.inference_mode()
def drafted_logp(drafter, target, feats, seq, path=()):
    """Draft log-probs (over the draft vocabulary) computed step by step, independently of ``propose``:
    read the real features and next tokens of the prompt, then feed back its own predicted feature
    with each token of ``path``, one position at a time."""
    net, emb, t = drafter.net, target.model.get_input_embeddings(), len(seq) - 1
    cache = DynamicCache()
    entry = drafter.features(Commit(torch.tensor(seq[:-1]), feats, seq[-1]))  # EAGLE-3: its fused taps
    head_in, feature = net(entry[None], emb(torch.tensor(seq[1:]))[None],
                           torch.arange(t)[None], causal(t), cache)
    head_in, feature = head_in[:, -1:], feature[:, -1:]
    for i, tok in enumerate(path):
        head_in, feature = net(feature, emb(torch.tensor([[tok]])), torch.tensor([[t + i]]),
                               additive_mask(torch.ones(1, t + i + 1, dtype=torch.bool)), cache)
    head = target.model.get_output_embeddings().weight[drafter.frozen.vocab_map]
    return torch.log_softmax(head_in[0, -1] @ head.T, -1)


@pytest.mark.parametrize("method", METHODS)
def test_tree_matches_step_by_step_drafting(method, target, checkpoints):
    """Every expanded node's children are the top_k of the drafter run sequentially along its path."""
    depth, k = 4, 3
    drafter = load(target, checkpoints, method, depth=depth, top_k=k, total_tokens=256)
    vocab_map = drafter.frozen.vocab_map
    for p in prompts(2, seed=11):
        feats, seq = show_prompt(drafter, target, p)
        tree = drafter.propose(DraftRequest(seq, 16, Sampling()))
        keys, kids, checked = path_keys(tree), tree.children(), 0
        for node, children in enumerate(kids):
            if not children:
                continue
            top = drafted_logp(drafter, target, feats, seq, keys[node - 1] if node else ()).topk(k)
            assert [int(tree.tokens[c - 1]) for c in children] == vocab_map[top.indices].tolist()
            torch.testing.assert_close(tree.logprobs[[c - 1 for c in children]], top.values, atol=1e-4, rtol=1e-4)
            checked += 1
        assert checked == 1 + (depth - 1) * k  # the root, then top_k expanded nodes per inner depth


def test_depth_one_tree_is_the_root_top_k(target, checkpoints):
    for k, total in ((1, 1), (3, 10), (6, 4), (5, 1)):
        drafter = load(target, checkpoints, "hass", depth=1, top_k=k, total_tokens=total)
        for p in prompts(3, seed=7):
            feats, seq = show_prompt(drafter, target, p)
            logp, vocab_map = drafted_logp(drafter, target, feats, seq), drafter.frozen.vocab_map
            tree = drafter.propose(DraftRequest(seq, 16, Sampling()))
            n = min(k, total)
            assert len(tree) == n and bool((tree.parents == 0).all())
            top = logp.topk(n)
            assert tree.tokens.tolist() == vocab_map[top.indices].tolist()
            torch.testing.assert_close(tree.logprobs, top.values, atol=1e-5, rtol=1e-5)


def test_single_node_is_the_root_argmax(target, checkpoints):
    drafter = load(target, checkpoints, "fspad", depth=5, top_k=4, total_tokens=1)
    for p in prompts(3, seed=8):
        feats, seq = show_prompt(drafter, target, p)
        logp, vocab_map = drafted_logp(drafter, target, feats, seq), drafter.frozen.vocab_map
        tree = drafter.propose(DraftRequest(seq, 16, Sampling()))
        assert tree.tokens.tolist() == [int(vocab_map[logp.argmax()])] and tree.parents.tolist() == [0]


def test_request_max_depth_caps_the_tree(target, checkpoints):
    drafter = load(target, checkpoints, "eagle2", depth=5, top_k=2, total_tokens=40)
    p = prompts(1, seed=9)[0]
    _, seq = show_prompt(drafter, target, p)
    assert drafter.propose(DraftRequest(seq, 16, Sampling())).max_depth == 5
    for cap in (1, 2, 3):
        tree = drafter.propose(DraftRequest(seq, cap, Sampling()))
        assert tree.max_depth == cap and len(tree) == 2 + (cap - 1) * 4
    assert len(drafter.propose(DraftRequest(seq, 0, Sampling()))) == 0
    # proposing leaves the drafter's cache at the accepted length
    assert drafter.cache.get_seq_length() == len(p)


# -- greedy decoding through the engine is lossless ------------------------------------------------

GREEDY_SETTINGS = {
    "eagle2": [dict(depth=4, top_k=3, total_tokens=10), dict(depth=2, top_k=6, total_tokens=20)],
    "hass": [dict(depth=3, top_k=4, total_tokens=8), dict(depth=6, top_k=2, total_tokens=12)],
    "fspad": [dict(depth=5, top_k=2, total_tokens=6), dict(depth=3, top_k=5, total_tokens=16)],
    "eagle3": [dict(depth=6, top_k=3, total_tokens=14), dict(depth=2, top_k=4, total_tokens=6)],
}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equivalence(method, target, checkpoints, ref_greedy):
    cases = prompts(3, seed=10)
    expected = [ref_greedy(target.model, p, 30) for p in cases]
    for settings in GREEDY_SETTINGS[method]:
        drafter = load(target, checkpoints, method, **settings)
        accepted = 0
        for p, want in zip(cases, expected):
            result = run(target, drafter, p, 30, stop_on_eos=False)
            assert result.output_ids == want, f"{method} {settings} differs from greedy decoding"
            accepted += sum(r.accepted for r in result.records)
            assert all(len(r.tree) <= settings["total_tokens"] for r in result.records)
        assert accepted > 0, f"{method} {settings}: no draft token was ever accepted (vacuous check)"


# -- errors ----------------------------------------------------------------------------------------

def expect_error(target, method, folder, match):
    with pytest.raises(CheckpointError, match=match) as info:
        build_drafter(method, target, checkpoint=str(folder))
    assert isinstance(info.value, SpecvizError)
    assert build_drafter("pld", target).name == "pld"  # nothing else broke


def llama_target(vocab: int, hidden: int) -> TargetModel:
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return TargetModel(transformers.LlamaForCausalLM(config).float().eval())


def test_every_trained_method_is_a_trained_drafter_and_the_protocol_is_declared():
    from drafters import METHODS as ALL

    trained = {name for name, (cls, _) in ALL.items() if cls.trained}
    assert trained == {name for name, (cls, _) in ALL.items() if issubclass(cls, TrainedDrafter)}
    assert {"eagle2", "hass", "fspad", "eagle3", "medusa", "redrafter", "semi-attn", "semi-lstm"} == trained
    with pytest.raises(NotImplementedError):
        TrainedDrafter.new_network(None)
    with pytest.raises(NotImplementedError):
        TrainedDrafter.training_loss(None, None, None, None, None)


def test_trained_drafter_takes_the_targets_features_as_they_are(target, checkpoints):
    """Commit.features are the final-norm output: the drafter only moves them, it never normalises again."""
    drafter = load(target, checkpoints, "eagle2")
    feats = torch.randn(3, HIDDEN, dtype=torch.float64)
    moved = drafter.features(Commit(torch.tensor([1, 2, 3]), feats, 4))
    assert moved.dtype == target.dtype and torch.equal(moved, feats.to(target.dtype))
    assert drafter.num_parameters() == sum(p.numel() for p in drafter.net.parameters()) + drafter.frozen.head.numel()


def test_draft_vocabulary_is_the_most_frequent_tokens_plus_the_forced_ones():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 1, 1, 1, 1])
    assert draft_vocabulary(tokens, 2, 12).tolist() == [1, 5]  # sorted ids of the two most frequent
    assert draft_vocabulary(tokens, 2, 12, always=[11]).tolist() == [1, 11]
    assert draft_vocabulary(tokens, 0, 12).tolist() == list(range(12))


def test_frozen_target_head_is_the_targets_rows(target):
    vocab_map = torch.tensor([0, 3, 7, 40])
    frozen = FrozenTarget(target, vocab_map)
    x = torch.randn(2, HIDDEN)
    full = target.model.get_output_embeddings()(x)
    torch.testing.assert_close(frozen.logits(x), full[:, vocab_map])
    torch.testing.assert_close(frozen.embed(torch.tensor([3])), target.model.get_input_embeddings()(torch.tensor([3])))


def test_missing_checkpoint(target, tmp_path):
    expect_error(target, "eagle2", tmp_path / "nowhere", r"no eagle2 checkpoint at .*nowhere")


def test_checkpoint_of_another_method(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["hass"], tmp_path / "copy")
    expect_error(target, "eagle2", copy, r"holds a 'hass' checkpoint, not 'eagle2'")
    # FSPAD weights behind a card that claims eagle2: the tensors themselves do not fit
    other = shutil.copytree(checkpoints["fspad"], tmp_path / "other")
    card = json.loads((other / "card.json").read_text())
    (other / "card.json").write_text(json.dumps({**card, "method": "eagle2"}))
    expect_error(target, "eagle2", other, r"eagle2 checkpoint does not fit .*unexpected \['sampler_")


def test_checkpoint_for_another_hidden_size(checkpoints):
    narrow = llama_target(VOCAB, 32)
    expect_error(narrow, "eagle2", checkpoints["eagle2"], r"hidden_size=64 .*this target .*hidden_size=32")


def test_checkpoint_for_another_vocab(checkpoints, tiny_target, tmp_path):
    small = tiny_target(32, seed=0, num_layers=2)
    expect_error(small, "fspad", checkpoints["fspad"], r"vocab_size=64 .*this target .*vocab_size=32")
    # without the card's guard, the draft vocabulary itself is caught
    copy = shutil.copytree(checkpoints["fspad"], tmp_path / "copy")
    card = json.loads((copy / "card.json").read_text())
    del card["target"]["vocab_size"]
    (copy / "card.json").write_text(json.dumps(card))
    expect_error(small, "fspad", copy, r"draft vocabulary reaches id \d+, beyond this target's vocab of 32")


def test_corrupt_weights(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["eagle2"], tmp_path / "copy")
    weights = copy / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    expect_error(target, "eagle2", copy, r"unreadable \(corrupt or truncated\)")


def test_shipped_checkpoint_is_compressed_and_loads_the_same(target, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "ASSETS", tmp_path / "assets")
    stale = tmp_path / "assets" / "hass" / "weights.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older, uncompressed checkpoint")
    shipped = checkpoint.ship_checkpoint(checkpoints["hass"], "hass")
    assert sorted(f.name for f in shipped.iterdir()) == ["card.json", "weights.safetensors.xz"]
    plain = checkpoints["hass"] / "weights.safetensors"
    assert (shipped / "weights.safetensors.xz").stat().st_size < plain.stat().st_size
    a, b = (build_drafter("hass", target, checkpoint=str(f)) for f in (checkpoints["hass"], shipped))
    for (name, x), (_, y) in zip(a.net.state_dict().items(), b.net.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert torch.equal(a.frozen.vocab_map, b.frozen.vocab_map) and a.card == b.card
    xz = shipped / "weights.safetensors.xz"
    xz.write_bytes(xz.read_bytes()[:-100])
    expect_error(target, "hass", shipped, r"weights\.safetensors\.xz is unreadable \(corrupt or truncated\)")
    xz.unlink()
    expect_error(target, "hass", shipped, r"no hass checkpoint at .*train one with")


def test_invalid_card(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["hass"], tmp_path / "copy")
    (copy / "card.json").write_text('{"method": "hass", "target": {')
    expect_error(target, "hass", copy, r"card .*card\.json is not valid JSON")


# -- the training corpus ---------------------------------------------------------------------------

def conversation(i: int, first: str = "human", second: str = "gpt") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"question {i}"},
                                              {"from": second, "value": f"answer {i}"}]}


def test_read_sharegpt_stops_at_the_cut(tmp_path):
    items = [conversation(0), conversation(1)]
    text = json.dumps(items + [conversation(2)], indent=1)
    cut = text.index("question 2") + 4  # inside the third item
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut], encoding="utf-8")
    assert list(corpus.read_sharegpt(path)) == items
    path.write_text(json.dumps(items), encoding="utf-8")  # a complete file reads whole too
    assert list(corpus.read_sharegpt(path)) == items


def test_first_turns_skips_conversations_not_opened_by_a_human(tmp_path, monkeypatch):
    items = [conversation(0), conversation(1, first="system"), conversation(2), conversation(3, first="gpt"),
             conversation(4, second="human"), conversation(0)]  # the last repeats a prompt
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(corpus, "sharegpt_file", lambda: path)
    got = list(corpus.first_turns())
    assert [(e.id, e.prompt, e.answer) for e in got] == [("c0", "question 0", "answer 0"),
                                                          ("c2", "question 2", "answer 2")]
    assert [e.id for e in corpus.first_turns(limit=1)] == ["c0"]


def test_continuation_chunks_give_their_first_human_turn(tmp_path, monkeypatch):
    chunk = {"id": "c7", "conversations": [{"from": "gpt", "value": "earlier reply"},
                                           {"from": "human", "value": "follow-up"}, {"from": "gpt", "value": "ok"}]}
    long_prompt = {"id": "c8", "conversations": [{"from": "human", "value": "x" * 2000}, {"from": "gpt", "value": "y"}]}
    items = [conversation(0), chunk, conversation(3, first="gpt"), long_prompt, conversation(0)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(corpus, "sharegpt_file", lambda: path)
    got = [(e.id, e.prompt, e.answer) for e in corpus.first_turns(max_chars=None, continuations=True)]
    assert got == [("c0", "question 0", "answer 0"), ("c7", "follow-up", "ok"), ("c8", "x" * 2000, "y")]
    assert [e.id for e in corpus.first_turns()] == ["c0"]  # the default keeps the human-opened, short ones


def test_validation_split_is_stable_and_sized():
    ids = [f"conv-{i}" for i in range(2000)]
    split = [corpus.is_validation(i, 0.1) for i in ids]
    assert split == [corpus.is_validation(i, 0.1) for i in ids]
    assert 140 <= sum(split) <= 260
    # a larger fraction only adds ids, so the held-out slice never loses any
    wider = [corpus.is_validation(i, 0.3) for i in ids]
    assert all(w for s, w in zip(split, wider) if s) and 500 <= sum(wider) <= 700
    assert not any(corpus.is_validation(i, 0.0) for i in ids)


@pytest.mark.parametrize("text", ["[]", '"x"', '{"method": "eagle2", "target": null}'])
def test_cards_that_are_not_cards(tmp_path, text):
    from drafters.checkpoint import CheckpointError, read_card

    (tmp_path / "card.json").write_text(text)
    with pytest.raises(CheckpointError, match="not a card"):
        read_card(tmp_path)


def test_sharegpt_file_that_is_not_a_list(tmp_path):
    from drafters.corpus import DataError, read_sharegpt

    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(DataError, match="not a JSON list"):
        list(read_sharegpt(path))


RECIPE = corpus.DataRecipe(8, max_new_tokens=6, val_fraction=0.2, batch_size=4)


def test_prepare_reuses_saved_sequences(target, tmp_path, monkeypatch):
    """The slow self-distillation runs once: its token file (cache or shipped) rebuilds identical features."""
    items = [conversation(i) for i in range(12)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(corpus, "sharegpt_file", lambda: path)
    monkeypatch.setattr(target, "encode_chat", lambda text: [3 + int(text.split()[-1]) % 50, 1, 2], raising=False)
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    first, first_val, meta = corpus.prepare(target, RECIPE,
                                            cache=cache, shipped=shipped)
    assert len(first) == 8 and len(first_val) >= 1 and meta["train_samples"] == 8
    (sequences,) = cache.glob("sequences-*.safetensors")
    for features in cache.glob("train-*"):
        features.unlink()  # the feature cache is gone (a new machine) ...
    shipped.mkdir()
    sequences.rename(shipped / sequences.name)  # ... but the project ships the sequences

    def no_distilling(*args, **kwargs):
        raise AssertionError("self-distilled again")

    monkeypatch.setattr(corpus, "self_distill", no_distilling)
    again, again_val, meta_again = corpus.prepare(target, RECIPE,
                                                  cache=cache, shipped=shipped)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.answer_starts, first.answer_starts)
    assert torch.equal(again.features, first.features) and torch.equal(again_val.tokens, first_val.tokens)
    assert meta_again["answer_tokens"] == meta["answer_tokens"]
    for features in cache.glob("*-*.safetensors"):
        features.unlink()
    alone, alone_val, meta_alone = corpus.prepare(target, RECIPE, cache=cache, shipped=shipped, features=False)
    assert torch.equal(alone.tokens, first.tokens) and torch.equal(alone.offsets, first.offsets)
    assert alone.features.shape == (first.num_tokens, 0) and alone_val.features.shape[1] == 0
    assert meta_alone["features_on_the_fly"] and meta_alone["answer_tokens"] == meta["answer_tokens"]
    assert not list(cache.glob("train-*")) and not list(cache.glob("features-*"))  # nothing extracted or cached
    (shipped / sequences.name).write_bytes(b"not safetensors")
    for features in cache.glob("*-*.safetensors"):
        features.unlink()
    with pytest.raises(corpus.DataError, match="unreadable"):
        corpus.prepare(target, RECIPE, cache=cache, shipped=shipped)
