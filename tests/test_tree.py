"""DraftTree: structure, mask/positions against sequential decoding, and beam merging."""

from __future__ import annotations

import random

import pytest
import torch

from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.tree import DraftTree, TreeError


def random_tree(rng: random.Random, vocab: int, max_nodes: int = 14) -> DraftTree:
    n = rng.randint(1, max_nodes)
    parents = [rng.randint(0, i) for i in range(n)]  # node i+1 (input index) has parent in 0..i
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def node_path(tree: DraftTree, node: int) -> list[int]:
    """Input indices from the root's child down to ``node`` (empty for the root), by walking parents."""
    path = []
    while node:
        path.append(node)
        node = int(tree.parents[node - 1])
    return path[::-1]


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    return [int(tree.tokens[i - 1]) for i in node_path(tree, node)]


# -- structure ------------------------------------------------------------------------------

def test_structure_of_hand_built_tree():
    #      root
    #     /    \
    #    1(5)  2(3)
    #    |     /   \
    #   3(7) 4(2)  5(9)
    #               |
    #              6(1)
    tree = DraftTree(torch.tensor([5, 3, 7, 2, 9, 1]), torch.tensor([0, 0, 1, 2, 2, 5]))
    assert len(tree) == 6
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.max_depth == 3
    assert tree.children() == [[1, 2], [3], [4, 5], [], [], [6], []]
    assert tree.paths() == [[1, 3], [2, 4], [2, 5, 6]]
    assert tree.input_ids(11).tolist() == [11, 5, 3, 7, 2, 9, 1]
    assert tree.positions(10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    anc = tree.ancestors()
    assert anc[6].nonzero().flatten().tolist() == [0, 2, 5, 6]
    assert anc[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert anc[0].nonzero().flatten().tolist() == [0]


def test_empty_and_chain():
    empty = DraftTree.empty()
    assert len(empty) == 0 and empty.max_depth == 0 and empty.paths() == []
    assert empty.positions(4).tolist() == [[4]]
    chain = DraftTree.chain([4, 5, 6], note="x")
    assert chain.parents.tolist() == [0, 1, 2]
    assert chain.depths.tolist() == [1, 2, 3]
    assert chain.paths() == [[1, 2, 3]]
    assert chain.info == {"note": "x"}


@pytest.mark.parametrize("seed", range(20))
def test_mask_and_positions_match_ancestry(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, vocab=5)
    past = rng.randint(0, 6)
    n = len(tree) + 1
    mask = tree.attention_mask(past)
    assert mask.shape == (1, 1, n, past + n)
    positions = tree.positions(past)[0].tolist()
    assert positions[0] == past
    for i in range(n):
        ancestors = set(node_path(tree, i)) | {0}
        assert positions[i] == past + len(node_path(tree, i))
        for j in range(past + n):
            allowed = j < past or (j - past) in ancestors
            assert (mask[0, 0, i, j] == 0) == allowed, (i, j)
            if not allowed:
                assert mask[0, 0, i, j] == torch.finfo(torch.float32).min
    # paths() are exactly the root-to-leaf walks
    leaves = [i for i in range(1, n) if not any(int(p) == i for p in tree.parents)]
    assert tree.paths() == [node_path(tree, leaf) for leaf in leaves]


# -- invalid trees ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([1, 2], [0, 2]),  # node 2 is its own parent
        ([1], [1]),  # node 1 is its own parent
        ([1, 2, 3], [0, 3, 1]),  # node 2's parent comes after it
        ([1, 2], [0, -1]),  # negative parent
        ([1, 2], [0]),  # fewer parents than tokens
        ([1], [0, 0]),  # more parents than tokens
    ],
)
def test_invalid_trees_raise(tokens, parents):
    with pytest.raises(TreeError):
        DraftTree(torch.tensor(tokens), torch.tensor(parents))


def test_invalid_extras_raise():
    with pytest.raises(TreeError, match="logprobs"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([0, 1]), logprobs=torch.zeros(3))
    with pytest.raises(TreeError, match="child_dists"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([0, 1]), child_dists=torch.zeros(2, 5))
    # a TreeError is a user-facing settings error
    assert issubclass(TreeError, SettingsError) and issubclass(TreeError, SpecvizError)


# -- verify: tree attention == sequential decoding ---------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_verify_logits_match_sequential_decoding(seed, tiny_target, ref_logits):
    target = tiny_target(vocab_size=32, seed=seed)
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    for _ in range(3):
        prompt = [rng.randrange(32) for _ in range(rng.randint(1, 12))]
        root = rng.randrange(32)
        tree = random_tree(rng, vocab=32 if rng.random() < 0.5 else 3)  # small vocab: repeated tokens
        cache = target.new_cache()
        target.prefill(prompt, cache)
        past = cache.get_seq_length()
        assert past == len(prompt)
        logits, feats = target.verify(root, tree, cache)
        assert logits.shape == (len(tree) + 1, 32)
        assert feats.shape[0] == len(tree) + 1
        assert cache.get_seq_length() == past + len(tree) + 1
        for node in range(len(tree) + 1):
            seq = prompt + [root] + path_tokens(tree, node)
            expected = ref_logits(target.model, seq)[-1]
            torch.testing.assert_close(logits[node].float(), expected, atol=1e-4, rtol=1e-4)


def test_verify_matches_incremental_cache_decoding(tiny_target):
    """Same check against a different reference: feeding root + path one token at a time in a cache."""
    target = tiny_target(vocab_size=32, seed=7)
    rng = random.Random(7)
    prompt = [rng.randrange(32) for _ in range(9)]
    tree = random_tree(rng, vocab=4, max_nodes=16)
    cache = target.new_cache()
    target.prefill(prompt, cache)
    logits, _ = target.verify(3, tree, cache)
    for node in range(len(tree) + 1):
        target.prefill(prompt, cache)
        for tok in [3] + path_tokens(tree, node):
            step, _ = target.verify(tok, DraftTree.empty(), cache)
        torch.testing.assert_close(logits[node], step[0], atol=1e-4, rtol=1e-4)


# -- from_beams ---------------------------------------------------------------------------------

def brute_trie(beams: list[list[int]]) -> set[tuple[int, ...]]:
    trie: dict[tuple[int, ...], int] = {}
    for beam in beams:
        for d in range(len(beam)):
            trie.setdefault(tuple(beam[: d + 1]), len(trie))
    return set(trie)


@pytest.mark.parametrize("seed", range(40))
def test_from_beams_matches_brute_force_trie(seed):
    rng = random.Random(seed)
    width, length = rng.randint(1, 8), rng.randint(1, 6)
    vocab = 2 if seed % 3 == 0 else 3
    beams = [[rng.randrange(vocab) for _ in range(length)] for _ in range(width)]
    if width > 1 and seed % 2:  # force exact duplicates and long shared prefixes
        beams[-1] = list(beams[0])
    logprobs = torch.randn(width, length, generator=torch.Generator().manual_seed(seed))
    tree = DraftTree.from_beams(torch.tensor(beams), logprobs)

    prefixes = [tuple(path_tokens(tree, node)) for node in range(1, len(tree) + 1)]
    trie = brute_trie(beams)
    assert len(prefixes) == len(set(prefixes)), "two nodes spell the same prefix"
    assert set(prefixes) == trie
    assert len(tree) == len(trie)
    assert all(int(p) < i for i, p in enumerate(tree.parents.tolist(), start=1))
    assert tree.depths.tolist() == sorted(tree.depths.tolist())  # ordered by depth
    assert tree.info["compression"] == pytest.approx(width * length / len(trie))
    beam_nodes = tree.info["beam_nodes"]
    assert beam_nodes.shape == (width, length)
    for i, beam in enumerate(beams):
        for d in range(length):
            node = int(beam_nodes[i, d])
            assert 1 <= node <= len(tree)
            assert path_tokens(tree, node) == beam[: d + 1]
        # the beam's last node is on exactly one root-to-node walk: the beam itself
        assert node_path(tree, int(beam_nodes[i, -1])) == beam_nodes[i].tolist()
    # each node's logprob is that of the first beam holding its prefix
    for node, prefix in enumerate(prefixes, start=1):
        first = next(i for i, b in enumerate(beams) if tuple(b[: len(prefix)]) == prefix)
        assert float(tree.logprobs[node - 1]) == float(logprobs[first, len(prefix) - 1])
    assert torch.equal(tree.info["beams"], torch.tensor(beams))


def test_from_beams_all_identical_and_all_distinct():
    same = DraftTree.from_beams(torch.tensor([[1, 2, 3]] * 4))
    assert len(same) == 3 and same.info["compression"] == 4.0
    assert same.info["beam_nodes"].tolist() == [[1, 2, 3]] * 4
    distinct = DraftTree.from_beams(torch.tensor([[0, 1], [1, 1], [2, 1]]))
    assert len(distinct) == 6 and distinct.info["compression"] == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_dedup_tree_gives_same_logits_as_each_beam(seed, tiny_target):
    target = tiny_target(vocab_size=32, seed=seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(32) for _ in range(6)]
    root = rng.randrange(32)
    beams = torch.tensor([[rng.randrange(3) for _ in range(5)] for _ in range(6)])
    tree = DraftTree.from_beams(beams)
    assert len(tree) < beams.numel()  # something was actually shared
    cache = target.new_cache()
    target.prefill(prompt, cache)
    merged, _ = target.verify(root, tree, cache)
    for i in range(beams.shape[0]):
        target.prefill(prompt, cache)
        chain, _ = target.verify(root, DraftTree.chain(beams[i]), cache)
        nodes = [0] + tree.info["beam_nodes"][i].tolist()
        torch.testing.assert_close(merged[nodes], chain, atol=1e-4, rtol=1e-4)


def test_beams_apart_share_nothing():
    beams = torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 7]])
    apart, merged = DraftTree.from_beams_apart(beams), DraftTree.from_beams(beams)
    assert len(apart) == 9 and len(merged) == 7 and apart.info["compression"] == 1.0
    assert [apart.tokens[[i - 1 for i in path]].tolist() for path in apart.paths()] == beams.tolist()
    assert apart.parents.tolist() == [0, 1, 2, 0, 4, 5, 0, 7, 8]


def test_greedy_follows_the_apart_beam_that_matches_longest():
    """Beams [1, 2, 3] and [1, 2, 4] kept apart: the target wants 1, 2, 4. The first beam matches two tokens, the
    second three; checked apart and the best kept, the second wins, as in the merged tree."""
    from specviz.core.verify import Sampling, accept

    apart = DraftTree.from_beams_apart(torch.tensor([[1, 2, 3], [1, 2, 4]]))
    wants = {0: 1, 1: 2, 2: 4, 3: 9, 4: 2, 5: 4, 6: 9}  # verify row -> the target's top token after it
    logits = torch.full((len(apart) + 1, 10), -1.0)
    for row, token in wants.items():
        logits[row, token] = 1.0
    result = accept(apart, logits, Sampling())
    assert result.path == [4, 5, 6] and result.bonus == 9
