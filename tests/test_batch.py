"""Decoding at batch size > 1 (``core.batch``, ``core.batch_cache``) on tiny fp32 targets: each row of a batched
forward equals its own sequence's forward; every sequence's output equals its own batch-1 decode, across prompts
of different lengths, limits and acceptance, with sequences finishing early and others joining in their place."""

from __future__ import annotations

import pytest
import torch

from conftest import session_checkpoint
from drafters import build_drafter
from specviz.core.batch import batch_mask, run_batch
from specviz.core.batch_cache import BatchSlabCache
from specviz.core.cache import SlabCache
from specviz.core.engine import output_ids, run
from specviz.core.protocol import Commit, DraftRequest
from specviz.core.target import TargetError
from specviz.core.tree import DraftTree
from specviz.core.verify import Sampling, follows_argmax

VOCAB = 64


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(VOCAB, seed=0, num_layers=2)


def prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 3 to 14 tokens; every other one repeats a piece of itself, so prompt lookup finds drafts."""
    gen, out = torch.Generator().manual_seed(seed), []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
        out.append(ids + ids if i % 2 else ids)
    return out


def random_tree(nodes: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = [int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree(torch.randint(0, VOCAB, (nodes,), generator=gen), torch.tensor(parents))


def batched_verify(target, trees: list[DraftTree], shared: bool = False):
    """Sequences of different contexts (one per tree) in a batch cache that grows (its layers' buffers slices of
    one store with ``shared``), each also in a one-sequence cache of its own, and one forward verifying every tree
    (root 7) in its row. Returns (batch cache, the one-sequence caches, the rows' pasts, the forward's logits)."""
    batch = BatchSlabCache(target.num_layers, batch=2, capacity=4, shared=shared)  # both grow
    singles = []
    for ids in prompts(len(trees), seed=1):
        single = SlabCache(target.num_layers, 64)
        target.prefill(ids, single)
        batch.adopt(batch.add(), single)
        singles.append(single)
    pasts, n = batch.lengths, max(len(tree) + 1 for tree in trees)
    ids = torch.zeros(len(trees), n, dtype=torch.long)
    positions = torch.zeros(len(trees), n, dtype=torch.long)
    for b, (tree, past) in enumerate(zip(trees, pasts)):
        ids[b, : len(tree) + 1], positions[b, : len(tree) + 1] = tree.input_ids(7), tree.positions(past)[0]
    mask = batch_mask(pasts, [tree.ancestors() for tree in trees], target.dtype)
    logits, _ = target.forward_rows(ids, positions, mask, batch)
    return batch, singles, pasts, logits


@pytest.mark.parametrize("shared", [True, False], ids=["store", "per-layer"])
def test_each_row_of_a_batched_verify_equals_its_own_sequence(target, shared):
    """Three sequences with different contexts verify trees of different sizes in one forward; each row's logits
    are what its own cache and ``target.verify`` give, and its cache after the commit equals its own."""
    trees = [random_tree(n, seed=n) for n in (5, 1, 9)]
    batch, singles, pasts, logits = batched_verify(target, trees, shared)
    assert batch.stored == shared
    for b, (tree, single, past) in enumerate(zip(trees, singles, pasts)):
        alone, _ = target.verify(7, tree, single)
        torch.testing.assert_close(logits[b, : len(tree) + 1], alone, rtol=1e-5, atol=1e-5)
        keep = [0] + tree.paths()[-1]  # a path that needs moving (not a prefix) in most trees
        batch.keep(b, past, keep)
        target.commit(single, past, keep)
        assert batch.lengths[b] == single.get_seq_length() == past + len(keep)
        for mine, own in zip(batch.layers, single.layers):
            torch.testing.assert_close(mine.keys[b, :, : past + len(keep)], own.keys[0])
    moved = batch.drop(0)  # the last row moves into the freed one
    assert moved == 2 and batch.lengths == [singles[2].get_seq_length(), singles[1].get_seq_length()]
    torch.testing.assert_close(batch.layers[0]._keys[0, :, : batch.lengths[0]], singles[2].layers[0].keys[0])


@pytest.mark.parametrize("method, settings", [("ar", {}), ("pld", {}), ("lookahead", {}), ("eagle2", {}),
                                               ("redrafter", dict(width=3, length=3)),
                                               ("redrafter", dict(width=3, length=3, tree_attention=0)), ("sps", {}),
                                               ("semi-attn", dict(width=2, length=4)), ("medusa", {})],
                         ids=["ar", "pld", "lookahead", "eagle2", "redrafter", "redrafter-apart", "sps", "semi-attn",
                              "medusa"])
def test_every_sequence_equals_its_own_batch_1_decode(target, method, settings):
    drafter = build_drafter(method, target, **settings) if method in ("ar", "pld", "lookahead") else build_drafter(
        method, target, checkpoint=str(session_checkpoint(target, method)), **settings)
    texts, limits = prompts(7, seed=2), [24, 5, 31, 1, 17, 24, 9]  # ones that end early make room for joiners
    alone = [run(target, drafter, ids, n, stop_on_eos=False).output_ids for ids, n in zip(texts, limits)]
    for batch_size in (2, 3, 7):
        records = run_batch(target, drafter, texts, limits, batch_size=batch_size, stop_on_eos=False)
        assert [output_ids(r) for r in records] == alone, batch_size
        assert [len(output_ids(r)) for r in records] == limits
        assert all(r[0].step == 0 and r[-1].finished == "length" for r in records)
    if settings.get("tree_attention") == 0:  # beams apart: every beam's every token is a node of its own
        assert all(len(s.tree) == 3 * s.tree.max_depth for r in records for s in r[1:])
    if method != "ar":  # the drafts were accepted, unevenly: the sequences advanced by different amounts
        accepted = [sum(s.accepted for s in r) for r in records]
        assert sum(accepted) > 0 and len(set(accepted)) > 1, accepted


def observed_lanes(drafter, target, rooms):
    """Drafter states after each prompt's prefill (prompts of different lengths) and requests with ``rooms``."""
    states, requests = [], []
    for ids, room in zip(prompts(len(rooms), seed=4), rooms):
        logits, feats = target.prefill(ids, target.new_cache(64))
        state, bonus = drafter.start(), int(logits.argmax())
        drafter.observe(state, Commit(torch.tensor(ids), feats, bonus))
        states.append(state)
        requests.append(DraftRequest(ids + [bonus], room, Sampling(), None))
    return states, requests


@pytest.mark.parametrize("method, settings, depth", [("redrafter", dict(width=3, length=3), 3),
                                                     ("eagle2", dict(depth=3, top_k=3, total_tokens=8), 3)])
def test_a_batch_of_drafts_gives_each_lane_its_own_tree(target, method, settings, depth):
    """``propose_batch`` runs every lane's network in one call per depth (beams for the heads; the queue, then the
    tree levels for the feature drafters); each lane gets the tree ``propose`` drafts for it alone, lanes near
    their limit draft shallower, and a lane with no room drafts nothing."""
    drafter = build_drafter(method, target, checkpoint=str(session_checkpoint(target, method)), **settings)
    rooms = (5, 2, 0, 5, 1)
    states, requests = observed_lanes(drafter, target, rooms)
    together = drafter.propose_batch(states, requests)
    lone_states, _ = observed_lanes(drafter, target, rooms)
    for state, request, tree in zip(lone_states, requests, together):
        alone = drafter.propose(state, request) if request.max_depth else DraftTree.empty()
        assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)
        torch.testing.assert_close(tree.logprobs, alone.logprobs, atol=1e-4, rtol=1e-4)
        deepest = min(depth, request.max_depth)  # a dynamic tree's rerank may leave its last level out
        assert tree.max_depth == deepest if method == "redrafter" else 0 < tree.max_depth <= deepest or not deepest
    if method == "eagle2":  # each lane's drafter cache holds its own committed positions, and only those
        for batched, lone, request in zip(states, lone_states, requests):
            if not request.max_depth:  # drafted nothing alone, so fed nothing yet
                continue
            assert batched.cache.get_seq_length() == lone.cache.get_seq_length()
            torch.testing.assert_close(batched.cache.layers[0].keys, lone.cache.layers[0].keys, atol=1e-5, rtol=1e-5)


def test_lane_by_lane_drafting_drafts_the_same_trees_one_call_per_lane(target):
    """The A/B arm ``batched_drafting=0``: the drafter's own batched call, on one lane at a time."""
    from specviz.apps.batching import lane_by_lane

    settings = dict(depth=3, top_k=3, total_tokens=8)
    batched = build_drafter("eagle2", target, checkpoint=str(session_checkpoint(target, "eagle2")), **settings)
    rooms = (5, 2, 0, 5)
    states, requests = observed_lanes(batched, target, rooms)
    together = batched.propose_batch(states, requests)
    lanes = build_drafter("eagle2", target, checkpoint=str(session_checkpoint(target, "eagle2")), **settings)
    calls = []
    inner = lanes.propose_batch
    lanes.propose_batch = lambda s, r: calls.append(len(s)) or inner(s, r)
    lane_by_lane(lanes)
    apart = lanes.propose_batch(*observed_lanes(lanes, target, rooms))
    assert calls == [1] * len(rooms)
    for a, b in zip(together, apart):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_end_of_sequence_ends_a_lane_and_the_next_prompt_joins(target):
    texts = prompts(6, seed=3)
    alone = [run(target, build_drafter("pld", target), ids, 40, stop_on_eos=False).output_ids for ids in texts]
    eos = alone[0][3]  # the first prompt's fourth token: that sequence stops there, others wherever it appears
    target.text.eos_token_ids = frozenset({eos})
    try:
        expected = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in alone]
        records = run_batch(target, build_drafter("pld", target), texts, 40, batch_size=2)
    finally:
        target.text.eos_token_ids = frozenset()
    assert [output_ids(r) for r in records] == expected and len(expected[0]) == 4
    assert records[0][-1].finished == "eos"


def test_only_the_greedy_rule_follows_the_argmax():
    """``follows_argmax``, which ``generate_batch`` asks before it reads every lane's argmax in one copy, holds
    exactly where ``accept`` runs the greedy rule (the batched outputs above equal AR's either way)."""
    assert [follows_argmax(Sampling(**k)) for k in ({}, {"rule": "rejection"}, {"temperature": 1.0},
                                                     {"rule": "typical"})] == [True, True, False, False]


def test_a_seeded_sampled_sequence_is_its_batch_1_decode(target):
    """At T = 1 each lane draws from its own generator, so a sequence sampled in a batch is the very decode it is
    alone at the same seed (a stronger check than its distribution; ``test_engine_sampling`` has that too)."""
    drafter = build_drafter("sps", target, checkpoint=str(session_checkpoint(target, "sps")), num_tokens=3)
    texts, seeds, sampling = prompts(5, seed=4), [11, 12, 13, 14, 15], Sampling(temperature=1.0, top_p=0.9)
    alone = [run(target, drafter, ids, 20, Sampling(temperature=1.0, top_p=0.9, seed=s), stop_on_eos=False).output_ids
             for ids, s in zip(texts, seeds)]
    records = run_batch(target, drafter, texts, 20, sampling, batch_size=3, stop_on_eos=False, seeds=seeds)
    assert [output_ids(r) for r in records] == alone


def test_requests_that_cannot_run_are_clear_errors(target):
    with pytest.raises(TargetError, match="batch_size must be at least 1"):
        run_batch(target, build_drafter("ar", target), [[1, 2]], 4, batch_size=0)
    with pytest.raises(TargetError, match="2 token limits for 1 prompts"):
        run_batch(target, build_drafter("ar", target), [[1, 2]], [4, 5])
    with pytest.raises(Exception, match="prompt is empty"):
        run_batch(target, build_drafter("ar", target), [[1, 2], []], 4)
