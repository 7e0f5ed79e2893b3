"""Acceptance rules: greedy path choice, losslessness of rejection sampling (chi-square), settings."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from conftest import chi2_pvalue
from specviz.core.errors import SettingsError
from specviz.core.tree import DraftTree
from specviz.core.verify import Acceptance, Sampling, accept, probabilities

# -- greedy --------------------------------------------------------------------------------------


def logits_with_argmax(best: list[int], vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(best), vocab, generator=g)
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


def test_greedy_follows_argmax_hand_built():
    #      root
    #     /    \
    #    1(5)  2(3)
    #    |     /   \
    #   3(7) 4(2)  5(9)
    #               |
    #              6(1)
    tree = DraftTree(torch.tensor([5, 3, 7, 2, 9, 1]), torch.tensor([0, 0, 1, 2, 2, 5]))
    # argmax: root -> 3 (node 2), node 2 -> 9 (node 5), node 5 -> 4 (no such child): bonus 4
    logits = logits_with_argmax([3, 7, 9, 0, 0, 4, 8], vocab=12)
    result = accept(tree, logits, Sampling())
    assert result.path == [2, 5] and result.bonus == 4
    # node 5 -> 1 accepts node 6 too; the bonus is then argmax at node 6
    logits = logits_with_argmax([3, 7, 9, 0, 0, 1, 8], vocab=12)
    assert accept(tree, logits, Sampling()) == Acceptance([2, 5, 6], 8)
    # root argmax matches no child: nothing accepted, bonus = root argmax
    logits = logits_with_argmax([6, 7, 9, 0, 0, 1, 8], vocab=12)
    assert accept(tree, logits, Sampling()) == Acceptance([], 6)
    # the empty tree: the bonus is the argmax of the only row
    assert accept(DraftTree.empty(), logits[:1], Sampling()) == Acceptance([], 6)
    assert accept(tree, logits, Sampling(), top=[3, 7, 9, 0, 0, 4, 8]) == Acceptance([2, 5], 4)  # read already


@pytest.mark.parametrize("seed", range(30))
def test_greedy_is_longest_argmax_path(seed):
    """Brute force over all root-to-node walks (trees without repeated sibling tokens)."""
    rng = random.Random(seed)
    vocab = 4
    parents, tokens = [], []
    for _ in range(rng.randint(1, 16)):
        p = rng.randint(0, len(tokens))
        used = {tokens[j] for j in range(len(tokens)) if parents[j] == p}
        free = [t for t in range(vocab) if t not in used]
        if free:  # no two siblings share a token
            parents.append(p)
            tokens.append(rng.choice(free))
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    logits = torch.randn(len(tree) + 1, vocab, generator=torch.Generator().manual_seed(seed))
    # bias argmax towards drafted tokens so long paths occur
    for i, (p, t) in enumerate(zip(parents, tokens), start=1):
        if rng.random() < 0.7:
            logits[p, t] += 3.0
    best = logits.argmax(-1).tolist()

    def walk(node):  # nodes whose whole path follows argmax
        return [c for c in tree.children()[node] if tokens[c - 1] == best[node]]

    longest, frontier = [], [[c] for c in walk(0)]
    while frontier:
        path = frontier.pop()
        if len(path) > len(longest):
            longest = path
        frontier += [path + [c] for c in walk(path[-1])]
    result = accept(tree, logits, Sampling(temperature=0.0, rule="rejection"))  # T=0 is greedy anyway
    assert result.path == longest
    assert result.bonus == best[longest[-1] if longest else 0]


# -- probabilities, settings -------------------------------------------------------------------


def test_probabilities_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(probabilities(logits, Sampling(temperature=t)), torch.softmax(logits / t, -1))
    greedy = probabilities(logits, Sampling())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


def test_probabilities_top_p_hand_example():
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = p.log()
    out = probabilities(logits, Sampling(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    torch.testing.assert_close(out, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    out = probabilities(logits, Sampling(temperature=1.0, top_p=0.85))  # needs the 0.15 too
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    out = probabilities(logits, Sampling(temperature=1.0, top_p=0.4))  # the top token alone
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("seed", range(10))
def test_probabilities_top_p_random(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 12, generator=g) * 2
    t, top_p = 0.5 + seed / 10, 0.3 + seed / 15
    out = probabilities(logits, Sampling(temperature=t, top_p=top_p))
    for row, got in zip(logits, out):
        full = torch.softmax(row / t, -1)
        keep, mass = [], 0.0
        for i in full.argsort(descending=True).tolist():
            if mass >= top_p:
                break
            keep.append(i)
            mass += float(full[i])
        expected = torch.zeros_like(full)
        expected[keep] = full[keep] / full[keep].sum()
        torch.testing.assert_close(got, expected)
        assert float(got.sum()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(rule="nucleus"), "unknown acceptance rule"),
    ],
)
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(SettingsError, match=match):
        Sampling(**kwargs)


def test_rules_and_losslessness():
    assert Sampling().resolved_rule == "greedy" and Sampling().greedy
    assert Sampling(temperature=0.7).resolved_rule == "rejection"
    assert Sampling(rule="typical").lossless is False
    assert Sampling(temperature=1.0, rule="typical").lossless is False
    assert Sampling(temperature=1.0).lossless and Sampling().lossless
    assert Sampling(temperature=1.0, rule="rejection").lossless


def test_typical_acceptance_keeps_typical_prefix():
    # chain 1 -> 2 -> 3; the target is confident in tokens 1 and 2 but not 3
    tree = DraftTree.chain([1, 2, 3])
    logits = torch.full((4, 6), -5.0)
    logits[0, 1] = logits[1, 2] = 5.0
    logits[2, 4] = 5.0  # node 2 wants 4, so token 3 is atypical
    logits[3, 0] = 5.0
    s = Sampling(temperature=0.7, rule="typical", seed=0)
    result = accept(tree, logits, s, torch.Generator().manual_seed(0))
    assert result.path == [1, 2]
    assert result.bonus == 4  # sampled from a distribution that is ~all on token 4


# -- rejection sampling: chi-square against the exact target distribution -------------------------

V = 6


class Tables:
    """Conditional distributions over V tokens for every prefix, made up deterministically (``sampling``:
    then put through its temperature and top-p)."""

    def __init__(self, seed: int, scale: float, zeros: int = 0, sampling: Sampling | None = None):
        self.seed, self.scale, self.zeros, self.memo, self.log_memo = seed, scale, zeros, {}, {}
        self.sampling = sampling

    def __call__(self, prefix) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self.memo:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + hash(key) % 1_000_000_007)
            p = torch.softmax(torch.randn(V, generator=g) * self.scale, -1)
            if self.zeros:  # the draft never proposes these tokens
                p[torch.randperm(V, generator=g)[: self.zeros]] = 0.0
                p = p / p.sum()
            self.memo[key] = p if self.sampling is None else probabilities(torch.log(p), self.sampling)
        return self.memo[key]

    def log(self, prefix) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self.log_memo:
            self.log_memo[key] = torch.log(self(key))
        return self.log_memo[key]


def draw(rnd: random.Random, dist: torch.Tensor) -> int:
    """One draft token from ``dist`` (the draft side uses Python's RNG: cheaper than torch's)."""
    return rnd.choices(range(V), weights=dist.tolist())[0]


class Drafted(NamedTuple):
    """A tree as drawn: its tokens and parents, and how to build it (``first_two`` builds each distinct one once)."""

    tokens: list[int]
    parents: list[int]
    build: Callable[[], DraftTree]


def chain_tree(ctx, q, rnd, depth=2):
    toks, dists = [], []
    for _ in range(depth):
        dist = q(ctx + toks)
        dists.append(dist)
        toks.append(draw(rnd, dist))
    rows = lambda: torch.stack(dists + [torch.zeros(V)])  # noqa: E731 - the leaf drafts no child
    return Drafted(toks, list(range(depth)), lambda: DraftTree.chain(toks, child_dists=rows()))


def fixed_children_tree(ctx, q, rnd):
    """Random shape, depth <= 3; each node's children are the top-k (k = 0..3) tokens of the draft
    distribution at that node, as fixed choices (no child_dists). The candidates must not be uniformly
    random: a rule that forgets to remove rejected candidates from the residual is exact for those."""
    tokens, parents, frontier = [], [], [(0, 0, [])]
    while frontier:
        node, depth, path = frontier.pop(0)
        if depth == 3:
            continue
        k = rnd.randint(1, 3) if node == 0 else rnd.randint(0, 2)
        for tok in q(ctx + path).topk(k).indices.tolist():
            tokens.append(tok)
            parents.append(node)
            frontier.append((len(tokens), depth + 1, path + [tok]))
    return Drafted(tokens, parents, lambda: DraftTree(torch.tensor(tokens), torch.tensor(parents)))


def without_replacement_tree(ctx, q, rnd):
    """Root children: 3 draws without replacement from q; each child gets 0 or 1 sampled child."""
    q0 = q(ctx)
    weights = q0.tolist()
    first = []
    for _ in range(min(3, sum(w > 0 for w in weights))):  # one after another, without replacement
        tok = rnd.choices(range(V), weights=weights)[0]
        first.append(tok)
        weights[tok] = 0.0
    tokens, parents, rows = list(first), [0] * len(first), {0: q0}
    for node, tok in enumerate(first, start=1):
        if rnd.random() < 0.6:
            dist = q(ctx + [tok])
            rows[node] = dist
            tokens.append(draw(rnd, dist))
            parents.append(node)
    dists = lambda: torch.stack([rows.get(i, torch.zeros(V)) for i in range(len(tokens) + 1)])  # noqa: E731
    return Drafted(tokens, parents, lambda: DraftTree(torch.tensor(tokens), torch.tensor(parents), child_dists=dists()))


def tree_logits(tree: DraftTree, ctx, p: Tables) -> torch.Tensor:
    """Verify logits: row i is log p(. | ctx + path to node i)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [[]]
    for tok, parent in zip(tokens, parents):
        paths.append(paths[parent] + [tok])
    return torch.stack([p.log(ctx + path) for path in paths])


def first_two(rule, make_tree, p, q, s, gen, rnd, built: dict):
    """Emit tokens with repeated draft/accept steps (a mini engine) until two are out. Every step draws its
    tree and calls ``rule``; a tree drawn before (the same context, tokens and parents: the draft rows
    follow from them) reuses the DraftTree and verify logits ``built`` holds, which cost as much as ``rule``."""
    out = []
    while len(out) < 2:
        drafted = make_tree(out, q, rnd)
        key = (tuple(out), tuple(drafted.tokens), tuple(drafted.parents))
        if key not in built:
            tree = drafted.build()
            built[key] = tree, tree_logits(tree, out, p)
        tree, logits = built[key]
        result = rule(tree, logits, s, gen)
        out += [drafted.tokens[n - 1] for n in result.path] + [result.bonus]
    return tuple(out[:2])


def sample_pvalue(rule, make_tree, s, n, seed, p=None, q=None):
    p = p or Tables(seed=1, scale=1.3)
    q = q or Tables(seed=2, scale=1.3, zeros=2)
    gen, rnd, built = torch.Generator().manual_seed(seed), random.Random(seed), {}
    counts: dict = {}
    for _ in range(n):
        cell = first_two(rule, make_tree, p, q, s, gen, rnd, built)
        counts[cell] = counts.get(cell, 0) + 1
    pt = lambda ctx: probabilities(torch.log(p(ctx)), s)  # noqa: E731 - the target after T / top-p
    expected = {(a, b): float(pt([])[a] * pt([a])[b]) for a in range(V) for b in range(V)}
    first = {}
    for (a, _), c in counts.items():
        first[(a,)] = first.get((a,), 0) + c
    first_exp = {(a,): float(pt([])[a]) for a in range(V)}
    return chi2_pvalue(first, first_exp), chi2_pvalue(counts, expected)


# Power. The weakest negative control below (forgets-removal: w^2 = chi2 / n - df / n = 0.043 over the 36
# joint cells, measured at n = 5000) is missed by the 1e-3 test at n = 5000 with probability 3e-16 (non-central
# chi-square, df 35, lambda = n w^2 = 217), and by the controls' own 1e-6 bound with probability 1e-11; the others
# have w^2 >= 0.35. At n = 5000 a w^2 of 0.014 is caught 99 times in 100 (0.0036 at the 20,000 used before).
# With T = 0.7 and top-p the 9 joint cells give no-residual w^2 = 0.11: missed at n = 2500 with probability 5e-31.
N_SAMPLES = 5000


@pytest.mark.parametrize("make_tree", [chain_tree, fixed_children_tree, without_replacement_tree],
                         ids=["chain", "fixed-children", "without-replacement"])
def test_rejection_sampling_is_lossless(make_tree):
    s = Sampling(temperature=1.0)
    p_first, p_joint = sample_pvalue(accept, make_tree, s, N_SAMPLES, seed=123)
    assert p_first > 1e-3, p_first
    assert p_joint > 1e-3, p_joint


def test_rejection_sampling_is_lossless_with_temperature_and_top_p():
    """The target and draft distributions both go through T and top-p; the draft's q is processed too."""
    s = Sampling(temperature=0.7, top_p=0.85)
    q = Tables(seed=2, scale=1.3, sampling=s)
    p_first, p_joint = sample_pvalue(accept, chain_tree, s, N_SAMPLES // 2, seed=7, q=q)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


def accept_everything(tree, logits, s, gen):
    """Deliberately wrong rule: keep the first root-to-leaf path, bonus from its last node."""
    path = tree.paths()[0] if len(tree) else []
    last = path[-1] if path else 0
    return Acceptance(path, int(torch.multinomial(probabilities(logits[last], s), 1, generator=gen)))


def no_residual(tree, logits, s, gen):
    """Deliberately wrong chain rule: after a rejection, sample from p instead of max(p - q, 0)."""
    node, path = 0, []
    for child in range(1, len(tree) + 1):  # a chain: node i's child is node i + 1
        p = probabilities(logits[node], s)
        x = int(tree.tokens[child - 1])
        qx = float(tree.child_dists[node][x])
        if float(torch.rand((), generator=gen)) * qx >= float(p[x]):
            return Acceptance(path, int(torch.multinomial(p, 1, generator=gen)))
        path.append(child)
        node = child
    return Acceptance(path, int(torch.multinomial(probabilities(logits[node], s), 1, generator=gen)))


def forgets_removal(tree, logits, s, gen):
    """Deliberately wrong rule: a rejected candidate stays available. With child_dists, the children
    are treated as drawn with replacement (q keeps x); without, the residual keeps p(x)."""
    tokens, kids = tree.tokens.tolist(), tree.children()
    node, path = 0, []
    while True:
        p = probabilities(logits[node], s)
        q = None if tree.child_dists is None else tree.child_dists[node].float()
        chosen = None
        for child in kids[node]:
            x = tokens[child - 1]
            qx = 1.0 if q is None else float(q[x])
            if qx > 0 and float(torch.rand((), generator=gen)) * qx < float(p[x]):
                chosen = child
                break
            if q is not None:
                p = torch.clamp(p - q, min=0.0)
                if float(p.sum()) <= 0:
                    p = probabilities(logits[node], s)
                    break
                p = p / p.sum()
        if chosen is None:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=gen)))
        path.append(chosen)
        node = chosen


@pytest.mark.parametrize(
    "rule, make_tree",
    [(accept_everything, chain_tree), (no_residual, chain_tree), (forgets_removal, without_replacement_tree),
     (forgets_removal, fixed_children_tree)],
    ids=["accept-everything", "no-residual", "forgets-removal", "keeps-rejected-candidate"],
)
def test_chi_square_has_power(rule, make_tree):
    """Negative controls: the same test with a wrong acceptance rule fails decisively (p < 1e-6, not 1e-3)."""
    s = Sampling(temperature=1.0)
    p_first, p_joint = sample_pvalue(rule, make_tree, s, N_SAMPLES, seed=123)
    assert min(p_first, p_joint) < 1e-6, (p_first, p_joint)


@pytest.mark.parametrize("vocab", [50, 5000])
@pytest.mark.parametrize("scale", [0.01, 0.3, 1.0, 8.0])  # flat (the nucleus passes both k: full sort), to peaked
def test_the_nucleus_equals_the_full_sorts(vocab, scale, monkeypatch):
    from specviz.core import verify

    monkeypatch.setattr(verify, "NUCLEUS_FIRST_K", 64)  # so its three paths run at these sizes
    monkeypatch.setattr(verify, "NUCLEUS_MORE_K", 512)
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(9, vocab, generator=gen) * scale, -1)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(-1) - ordered >= top_p  # the definition: the smallest prefix reaching top_p
        expected = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        expected = expected / expected.sum(-1, keepdim=True)
        got = verify.nucleus(probs, top_p)
        assert torch.equal(got > 0, expected > 0) and torch.allclose(got, expected, atol=1e-7), top_p
