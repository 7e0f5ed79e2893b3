"""TargetModel: prefill, commit of an accepted tree path (crop or gather), next verify after commit."""

from __future__ import annotations

import random

import pytest
import torch

from specviz.core.errors import SpecvizError
from specviz.core.target import TargetError, VerifyPadding, cache_kwarg
from specviz.core.text import ChatText, TextError, eos_token_ids
from specviz.core.tree import DraftTree


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def assert_cache_equal(got, expected) -> None:
    assert len(got) == len(expected)
    for (k, v), (ek, ev) in zip(got, expected):
        assert k.shape == ek.shape, (k.shape, ek.shape)
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)


# Input indices 0..8: root; 1 -> 2 -> 3 is a chain at the front of the input (a prefix),
# 4 hangs off the root, 5 and 6 off node 1, 7 off 5, 8 off 4.
TREE_PARENTS = [0, 1, 2, 0, 1, 1, 5, 4]
PREFIX_PATHS = [[], [1], [1, 2], [1, 2, 3]]
GATHER_PATHS = [[4], [4, 8], [1, 5], [1, 5, 7], [1, 6]]


def fixed_tree(seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    return DraftTree(torch.randint(0, 32, (len(TREE_PARENTS),), generator=g), torch.tensor(TREE_PARENTS))


@pytest.mark.parametrize("path", PREFIX_PATHS + GATHER_PATHS, ids=str)
def test_commit_equals_fresh_prefill(path, tiny_target, ref_logits):
    target = tiny_target(vocab_size=32, seed=1)
    cache = target.new_cache()
    prompt = [5, 9, 2, 7, 7, 1, 30]
    root = 11
    tree = fixed_tree(3)
    assert all(1 <= n <= len(tree) for n in path)
    for a, b in zip([0] + path, path):  # the path is a real root-to-node walk
        assert int(tree.parents[b - 1]) == a
    target.prefill(prompt, cache)
    past = cache.get_seq_length()
    target.verify(root, tree, cache)
    target.commit(cache, past, [0] + path)
    accepted = [int(tree.tokens[n - 1]) for n in path]
    assert cache.get_seq_length() == len(prompt) + 1 + len(path)
    committed = cache_kv(cache)

    # the cache after commit is the cache of a fresh prefill over the accepted sequence
    fresh = tiny_target(vocab_size=32, seed=1)
    fresh_cache = fresh.new_cache()
    fresh.prefill(prompt + [root] + accepted, fresh_cache)
    assert_cache_equal(committed, cache_kv(fresh_cache))

    # and the next verify sees exactly that sequence
    nxt = 4
    tree2 = DraftTree(torch.tensor([3, 8, 3]), torch.tensor([0, 1, 0]))
    logits, _ = target.verify(nxt, tree2, cache)
    seq = prompt + [root] + accepted + [nxt]
    for node, extra in [(0, []), (1, [3]), (2, [3, 8]), (3, [3])]:
        torch.testing.assert_close(logits[node], ref_logits(target.model, seq + extra)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_many_rounds_of_verify_and_commit(seed, tiny_target, ref_logits):
    """Random trees, random accepted paths, many rounds: every verify equals a cache-free forward."""
    rng = random.Random(seed)
    target = tiny_target(vocab_size=32, seed=seed)
    cache = target.new_cache()
    seq = [rng.randrange(32) for _ in range(rng.randint(1, 6))]
    target.prefill(seq, cache)
    root = rng.randrange(32)
    for _ in range(8):
        n = rng.randint(0, 10)
        tree = DraftTree(
            torch.tensor([rng.randrange(32) for _ in range(n)], dtype=torch.long),
            torch.tensor([rng.randint(0, i) for i in range(n)], dtype=torch.long),
        )
        past = cache.get_seq_length()
        assert past == len(seq)
        logits, _ = target.verify(root, tree, cache)
        # random root-to-node path, sometimes the root alone
        node = rng.randint(0, n)
        path = []
        while node:
            path.append(node)
            node = int(tree.parents[node - 1])
        path = path[::-1]
        tokens = [int(tree.tokens[i - 1]) for i in path]
        expected = ref_logits(target.model, seq + [root] + tokens)
        torch.testing.assert_close(logits[[0] + path], expected[len(seq):], atol=1e-4, rtol=1e-4)
        target.commit(cache, past, [0] + path)
        seq = seq + [root] + tokens
        root = rng.randrange(32)
    assert cache.get_seq_length() == len(seq)


def test_features_match_sequential_prefill(tiny_target):
    target = tiny_target(vocab_size=32, seed=2)
    cache = target.new_cache()
    prompt = [1, 2, 3, 4]
    tree = fixed_tree(0)
    _, prefill_feats = target.prefill(prompt, cache)
    assert prefill_feats.shape == (len(prompt), 64)
    _, feats = target.verify(9, tree, cache)
    for node in range(len(tree) + 1):
        path, n = [], node
        while n:
            path.append(int(tree.tokens[n - 1]))
            n = int(tree.parents[n - 1])
        other = tiny_target(vocab_size=32, seed=2)
        _, f = other.prefill(prompt + [9] + path[::-1], other.new_cache())
        torch.testing.assert_close(feats[node], f[-1], atol=1e-4, rtol=1e-4)


def test_prefill_resets_cache(tiny_target):
    target = tiny_target(vocab_size=32, seed=0)
    cache = target.new_cache()
    target.prefill([1, 2, 3, 4, 5], cache)
    target.verify(1, fixed_tree(0), cache)
    target.prefill([7, 8], cache)
    assert cache.get_seq_length() == 2


def test_context_limits(tiny_target):
    target = tiny_target(vocab_size=32, seed=0, max_positions=16)
    cache = target.new_cache()
    assert target.max_length == 16
    with pytest.raises(TargetError, match="empty"):
        target.prefill([], cache)
    with pytest.raises(TargetError, match="context"):
        target.prefill(list(range(16)), cache)
    target.prefill(list(range(12)), cache)
    target.verify(1, DraftTree.chain([1, 2, 3]), cache)  # positions 12..15: fits
    target.commit(cache, 12, [0])
    with pytest.raises(TargetError, match="exceeds the context"):
        target.verify(1, DraftTree.chain([1, 2, 3, 4]), cache)  # would need positions 13..17
    assert issubclass(TargetError, SpecvizError)


def test_model_properties(tiny_target):
    target = tiny_target(vocab_size=40, seed=0, num_layers=3)
    assert target.vocab_size == 40
    assert target.dtype == torch.float32
    assert target.device.type == "cpu"
    assert target.num_parameters == sum(p.numel() for p in target.model.parameters())
    assert target.text.eos_token_ids == set()
    with pytest.raises(TextError, match="tokenizer"):
        target.text.encode_chat("hi")
    assert target.text.decode([1, 2]) == "1 2"
    assert issubclass(TextError, SpecvizError)


@pytest.mark.parametrize("eos, expected", [(5, {5}), ([3, 4], {3, 4}), (0, {0})])
def test_eos_token_ids(eos, expected, tiny_target):
    target = tiny_target(vocab_size=16, seed=0, eos=eos)
    assert target.text.eos_token_ids == expected
    # generation_config unset: falls back to the model config
    target.model.generation_config.eos_token_id = None
    assert eos_token_ids(target.model) == ChatText.for_model(target.model).eos_token_ids == expected


def test_eos_token_id_zero_in_generation_config_only(tiny_target):
    """Token id 0 is a valid EOS: it must not be mistaken for 'unset' (``0 or ...``)."""
    target = tiny_target(vocab_size=16, seed=0)
    target.model.generation_config.eos_token_id = 0
    target.config.eos_token_id = None
    assert eos_token_ids(target.model) == {0}
    target.config.eos_token_id = 7  # generation_config wins over the model config
    assert eos_token_ids(target.model) == {0}


def test_a_bf16_target_runs_its_norm_and_head_in_fp32(tiny_llama):
    """Prepared (``load.prepare``), the body stays bf16; the final norm and an untied fp32 copy of the head make
    fp32 logits."""
    import copy

    from specviz.core.load import prepare
    from specviz.core.target import TargetModel

    model = tiny_llama(seed=4).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    target = TargetModel(prepare(model))
    assert target.dtype == torch.bfloat16 and model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()  # untied
    torch.testing.assert_close(model.lm_head.weight, plain.lm_head.weight.float())  # the same values, now fp32
    ids = [3, 7, 1, 9, 4]
    logits, feats = target.prefill(ids, target.new_cache())
    assert logits.dtype == feats.dtype == torch.float32
    seen = []  # the bf16 body's output, as the plain model's own final norm receives it
    plain.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.inference_mode():
        plain(input_ids=torch.tensor([ids]))
    h = seen[0][0, -1].float()
    normed = plain.model.norm.weight.float() * h * torch.rsqrt(h.pow(2).mean() + model.config.rms_norm_eps)
    torch.testing.assert_close(feats[-1], normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, normed @ plain.lm_head.weight.float().T, atol=1e-4, rtol=1e-4)


def test_a_target_leaves_the_callers_model_as_it_was(tiny_llama):
    """``TargetModel(model)`` only decodes: no fp32 head, no packing, no hook left behind, the config as given."""
    from specviz.core.target import TargetModel

    model = tiny_llama(seed=4).to(torch.bfloat16).train()
    before = {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}
    forwards = [type(m).forward for m in model.modules()]
    target = TargetModel(model)
    cache = target.new_cache()
    target.prefill([3, 7, 1], cache)
    target.verify(4, fixed_tree(1), cache)
    assert not model.training  # eval mode is the one change
    assert {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()} == before
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert all("forward" not in vars(m) for m in model.modules()) and forwards == [type(m).forward
                                                                                  for m in model.modules()]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert target.packed_linears == 0 and target.kernels == "default"


def test_the_feature_hook_lives_for_one_forward(tiny_target):
    """Features are captured by a hook removed after each forward, even one that fails."""
    target = tiny_target(vocab_size=32, seed=0)
    norm = target.model.model.norm
    cache = target.new_cache()
    _, feats = target.prefill([1, 2, 3], cache)
    assert feats.shape == (3, 64) and not norm._forward_hooks
    with pytest.raises(IndexError):
        target.verify(40, DraftTree.chain([1]), cache)  # a token beyond the vocabulary: the forward fails
    assert not norm._forward_hooks


@pytest.mark.parametrize("tree", [DraftTree.chain([4, 8, 15]), fixed_tree(5)], ids=["chain", "tree"])
def test_padded_verify_returns_what_the_plain_one_does_and_commits_the_same_cache(tree, tiny_target):
    """Filler nodes follow every real node, so no real node sees them; their rows and cache entries go."""
    prompt, root, n = [3, 1, 4, 1, 5, 9, 2], 6, len(tree) + 1
    outs = {}
    for name, padding in [("plain", {}), ("padded", {"chain": {n: n + 5}, "tree": {n: n + 5}})]:
        target = tiny_target(vocab_size=32, seed=2)
        cache = target.new_cache()
        target.prefill(prompt, cache)
        logits, feats = target.verify(root, tree, cache, VerifyPadding(**padding))
        assert cache.get_seq_length() == len(prompt) + n + (5 if padding else 0)
        keep = [0] + tree.paths()[-1]
        target.commit(cache, len(prompt), keep)
        nxt, _ = target.verify(7, DraftTree.chain([1, 2]), cache)
        outs[name] = logits, feats, nxt, cache_kv(cache)
    (logits, feats, nxt, kv), (p_logits, p_feats, p_nxt, p_kv) = outs["plain"], outs["padded"]
    assert p_logits.shape == logits.shape and p_feats.shape == feats.shape
    torch.testing.assert_close(p_logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_feats, feats, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_nxt, nxt, atol=1e-5, rtol=1e-5)
    assert_cache_equal(p_kv, kv)


def test_padding_never_pushes_a_chain_past_the_context(tiny_target):
    target = tiny_target(vocab_size=32, seed=0, max_positions=16)
    padding = VerifyPadding(chain={4: 8})
    cache = target.new_cache()
    target.prefill(list(range(10)), cache)  # positions 10..13 fit, 10..17 would not: verified unpadded
    logits, _ = target.verify(1, DraftTree.chain([1, 2, 3]), cache, padding)
    assert logits.shape[0] == 4 and cache.get_seq_length() == 14
    target.commit(cache, 10, [0])
    target.prefill(list(range(6)), cache)  # room for the padding now
    target.verify(1, DraftTree.chain([1, 2, 3]), cache, padding)
    assert cache.get_seq_length() == 6 + 8


def test_the_cache_goes_under_the_keyword_each_forward_takes():
    class Renamed(torch.nn.Module):
        def forward(self, x, cache=None, **kwargs):
            return cache

    class Older(torch.nn.Module):
        def forward(self, x, past_key_values=None, **kwargs):
            return past_key_values

    for module in (Renamed(), Older()):
        assert module(0, **cache_kwarg(module, "kv")) == "kv"
