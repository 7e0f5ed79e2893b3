"""Trained feature drafters' dynamic draft tree: it keeps the best candidates, matches step-by-step drafting,
and greedy decoding through it equals the target's own."""

from __future__ import annotations

import pytest
import torch
from trained_helpers import METHODS, VOCAB, Twin, causal, checkpoint_fixtures, load, prompts
from transformers import DynamicCache

from specviz.core.engine import run
from specviz.core.protocol import Commit, DraftRequest
from specviz.core.tree import additive_mask
from specviz.core.verify import Sampling

target, checkpoints = checkpoint_fixtures(VOCAB, METHODS)


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
    """Prefill the target and let the drafter observe the prompt into a new state; returns (its features,
    sequence + root, the drafter's state)."""
    cache = target.new_cache()
    logits, feats = target.prefill(prompt, cache)
    first = int(logits.argmax())
    state = drafter.start()
    drafter.observe(state, Commit(torch.tensor(prompt), feats, first))
    return feats, prompt + [first], state


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
        feats, seq, state = show_prompt(drafter, target, p)
        tree = drafter.propose(state, DraftRequest(seq, 16, Sampling()))
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
            feats, seq, state = show_prompt(drafter, target, p)
            logp, vocab_map = drafted_logp(drafter, target, feats, seq), drafter.frozen.vocab_map
            tree = drafter.propose(state, DraftRequest(seq, 16, Sampling()))
            n = min(k, total)
            assert len(tree) == n and bool((tree.parents == 0).all())
            top = logp.topk(n)
            assert tree.tokens.tolist() == vocab_map[top.indices].tolist()
            torch.testing.assert_close(tree.logprobs, top.values, atol=1e-5, rtol=1e-5)


def test_single_node_is_the_root_argmax(target, checkpoints):
    drafter = load(target, checkpoints, "fspad", depth=5, top_k=4, total_tokens=1)
    for p in prompts(3, seed=8):
        feats, seq, state = show_prompt(drafter, target, p)
        logp, vocab_map = drafted_logp(drafter, target, feats, seq), drafter.frozen.vocab_map
        tree = drafter.propose(state, DraftRequest(seq, 16, Sampling()))
        assert tree.tokens.tolist() == [int(vocab_map[logp.argmax()])] and tree.parents.tolist() == [0]


def test_request_max_depth_caps_the_tree(target, checkpoints):
    drafter = load(target, checkpoints, "eagle2", depth=5, top_k=2, total_tokens=40)
    p = prompts(1, seed=9)[0]
    _, seq, state = show_prompt(drafter, target, p)
    assert drafter.propose(state, DraftRequest(seq, 16, Sampling())).max_depth == 5
    for cap in (1, 2, 3):
        tree = drafter.propose(state, DraftRequest(seq, cap, Sampling()))
        assert tree.max_depth == cap and len(tree) == 2 + (cap - 1) * 4
    assert len(drafter.propose(state, DraftRequest(seq, 0, Sampling()))) == 0
    # proposing leaves the drafter's cache at the accepted length
    assert state.cache.get_seq_length() == len(p)


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
