"""The decoding loop under sampling: every method's output distribution is the target's (chi-square, end to end).

Power. Each test decodes ``runs`` times (T = 1, seeds 0..runs-1, 4 new tokens after a fixed prompt) and makes
six Pearson chi-square tests of the outputs against the target's exact law, computed by enumerating every
continuation: t1, t2, t3, t4, (t1, t2) and (t2, t3) (``conftest.chi2_pvalue``: cells expected below 5 pooled).
It passes when all six p-values exceed ALPHA = 1e-3. A deviation of Cohen's w^2 = sum (p' - p)^2 / p in one of
them gives the statistic a non-central chi-square law (non-centrality runs * w^2), so the chance that a given
deviation slips through follows from ``runs`` (``scipy.stats.ncx2``; the w^2 of the wrong rules below come
from the exact law of the engine running them, enumerated over every draft, acceptance and token).

- The reference deviations are the two ways an exact rule goes subtly wrong: a chain rule that resamples
  from p instead of the residual max(p - q, 0) after a rejection (no-residual), and a tree rule that keeps a
  rejected fixed candidate in the residual (keeps-rejected-candidate). Both are subtle: they only move mass
  after rejections, and only part of it. The settings below are chosen to show them (a chain target over 5
  tokens and an assistant that drafts differently; trees whose candidates are the target's likeliest tokens:
  a rejected likely candidate is what the residual must remove).
- ``test_verify.py`` proves the rule itself on cheap tables (n = 5000 per case); these tests prove the engine
  around it: right verify rows, draft distributions, cache commits and drafter state under sampled paths.
  Such bugs draw tokens from the wrong context; in the 8-token target one wrong context token moves the next
  token's law by w^2 = 0.47 (median over contexts; 0.13 at the 10th percentile).
- The negative controls (``test_end_to_end_chi_square_has_power*``) run the very same decodes and checks with
  the two wrong rules and must fail far below ALPHA (p < 1e-6).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import NamedTuple

import pytest
import torch

from conftest import chi2_pvalue, session_checkpoint
from drafters import build_drafter
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.batch import run_batch
from specviz.core.engine import output_ids, run
from specviz.core.protocol import Drafter, DraftRequest
from specviz.core.target import TargetModel
from specviz.core.tree import DraftTree
from specviz.core.verify import Acceptance, Sampling, probabilities

ALPHA = 1e-3  # every check's significance level; the negative controls must fail below CONTROL_BOUND
CONTROL_BOUND = 1e-6


def trained(target, method: str, **settings):
    """A drafter from a tiny checkpoint trained for ``target`` through the real pipeline (once per test run)."""
    return build_drafter(method, target, checkpoint=str(session_checkpoint(target, method)), **settings)


# -- sampling: the output distribution is the target's (chi-square, end to end) -------------------

SMALL_V = 8  # the tree tests' target (the trained drafters are trained for it)
SAMPLING_PROMPT = [1, 2, 3, 4, 5]
CHAIN_V = 5  # the chain (sps) tests' target: fewer cells, so the same deviation costs fewer runs
CHAIN_PROMPT = [1, 2, 3, 4, 0]
MAX_NEW = 4


class Exact(NamedTuple):
    joint: dict  # (t1, .., t4) -> p
    conditionals: dict  # (t1, .., ti) for i < 4 -> [p(t | them) for every token t]


def enumerate_target(target: TargetModel, prompt: list[int]) -> Exact:
    """The target's exact law of the MAX_NEW tokens after ``prompt``, by enumerating every continuation
    (batched cache-free forwards)."""
    vocab = target.vocab_size
    joint, conditionals = {(): 1.0}, {}
    for _ in range(MAX_NEW):
        prefixes = list(joint)
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.inference_mode():
            probs = torch.softmax(target.model(batch, use_cache=False).logits[:, -1].double(), -1)
        conditionals.update({p: probs[k].tolist() for k, p in enumerate(prefixes)})
        joint = {p + (t,): joint[p] * float(probs[k, t]) for k, p in enumerate(prefixes) for t in range(vocab)}
    return Exact(joint, conditionals)


@pytest.fixture(scope="module")
def sampling_target(tiny_llama) -> TargetModel:
    return TargetModel(tiny_llama(SMALL_V, seed=3, num_layers=2, std=0.1))


@pytest.fixture(scope="module")
def exact_distributions(sampling_target) -> Exact:
    return enumerate_target(sampling_target, SAMPLING_PROMPT)


@pytest.fixture(scope="module")
def chain_target(tiny_llama) -> TargetModel:
    """One layer: the chain tests' runs cost less (the trained tree drafters need ``sampling_target``)."""
    return TargetModel(tiny_llama(CHAIN_V, seed=5, num_layers=1, std=0.2))


@pytest.fixture(scope="module")
def chain_exact(chain_target) -> Exact:
    return enumerate_target(chain_target, CHAIN_PROMPT)


@pytest.fixture(scope="module")
def chain_assistant(tiny_llama):
    """A one-layer assistant that drafts differently from ``chain_target`` (3 first drafts in 4 accepted)."""
    return tiny_llama(CHAIN_V, seed=7, num_layers=1, std=0.1)


def marginal(joint: dict, positions: tuple[int, ...]) -> dict:
    out: dict = {}
    for seq, prob in joint.items():
        key = tuple(seq[i] for i in positions)
        out[key] = out.get(key, 0.0) + prob
    return out


def sample_outputs(target, make_drafter, runs: int, prompt: list[int] = SAMPLING_PROMPT) -> list[list[int]]:
    outputs = []
    for seed in range(runs):
        result = run(target, make_drafter(seed), prompt, MAX_NEW, Sampling(temperature=1.0, seed=seed),
                     stop_on_eos=False)
        assert len(result.output_ids) == MAX_NEW
        outputs.append(result.output_ids)
    return outputs


def target_pvalues(outputs, exact: Exact) -> dict[str, float]:
    """Chi-square p-values of several marginals of the sampled outputs against the exact ones."""
    checks = {"t1": (0,), "t2": (1,), "t3": (2,), "t4": (3,), "(t1, t2)": (0, 1), "(t2, t3)": (1, 2)}
    return {name: chi2_pvalue(Counter(tuple(o[i] for i in pos) for o in outputs), marginal(exact.joint, pos))
            for name, pos in checks.items()}


# -- chains: two-model speculative sampling -----------------------------------------------------------

# Power. No-residual on this chain setting (exact law): w^2 = 0.314 in (t2, t3) (df 17 at 400 runs), 0.148 in t2
# and 0.110 in t3 (df 4). At 400 runs the ALPHA test misses it with probability 4e-9 on (t2, t3) alone (1e-4 on t2
# alone), and the control's 1e-6 bound with probability 8e-6. Any deviation of w^2 >= 0.10 in one token (df 4),
# or >= 0.143 in a pair (df 17), is caught 99 times in 100. (Before: 3000 runs on the 8-token target, where
# no-residual is w^2 = 0.13 in (t2, t3): its control, at 600 runs, missed the 1e-6 bound with probability 0.17.)
CHAIN_RUNS = 400


def sps_outputs(target, assistant, runs: int) -> list[list[int]]:
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=3), model=assistant)  # its state is per run
    return sample_outputs(target, lambda seed: drafter, runs, CHAIN_PROMPT)


def test_sps_sampling_matches_target_distribution(chain_target, chain_assistant, chain_exact):
    # the assistant really is a different distribution, so a lossy engine would show
    with torch.inference_mode():
        p = torch.softmax(chain_target.model(torch.tensor([CHAIN_PROMPT])).logits[0, -1], -1)
        q = torch.softmax(chain_assistant(torch.tensor([CHAIN_PROMPT])).logits[0, -1], -1)
    assert 0.5 * float((p - q).abs().sum()) > 0.2

    pvalues = target_pvalues(sps_outputs(chain_target, chain_assistant, CHAIN_RUNS), chain_exact)
    assert min(pvalues.values()) > ALPHA, pvalues


# -- trees ------------------------------------------------------------------------------------------

class TopChildrenDrafter(Drafter):
    """Random tree shapes whose children are fixed choices (child_dists None): each node gets its 1 to 3
    likeliest tokens under the target (as EAGLE's top-k would with a perfect draft model).

    Likely candidates are what makes a rule that forgets to remove rejected candidates from the residual show
    (for uniformly random candidates it would even be exact): p(x) of a rejected x is large."""

    name = "top-children"

    def __init__(self, conditionals: dict, seed: int):
        self.conditionals = conditionals
        self.rng = random.Random(seed)

    def propose(self, state, request: DraftRequest) -> DraftTree:
        done = tuple(request.tokens[len(SAMPLING_PROMPT):])  # the output so far, the pending root last
        tokens, parents, frontier = [], [], [(0, 0, done)]
        while frontier:
            node, depth, context = frontier.pop(0)
            if depth == request.max_depth:
                continue
            p = self.conditionals[context]
            for tok in sorted(range(len(p)), key=lambda t: -p[t])[: self.rng.randint(1, 3)]:
                tokens.append(tok)
                parents.append(node)
                frontier.append((len(tokens), depth + 1, context + (tok,)))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


# Power. Keeps-rejected-candidate on these trees (exact law): w^2 = 0.257 in (t2, t3) (df 33 at 500 runs). At
# 500 runs the ALPHA test misses it with probability 2e-7, the control's 1e-6 bound with probability 2e-4. Any
# deviation of w^2 >= 0.09 in one token (df 7), or >= 0.14 in a pair (df 33), is caught 99 times in 100.
# (Before: 1500 runs of trees with fixed-order candidates, where this bug is w^2 = 0.036 in t3 and 0.06 in
# (t2, t3): missed with probability 2e-3 and 3e-3, and it had no control.)
TREE_RUNS = 500


def top_children_outputs(target, exact: Exact, runs: int) -> list[list[int]]:
    return sample_outputs(target, lambda seed: TopChildrenDrafter(exact.conditionals, seed), runs)


def test_tree_sampling_matches_target_distribution(sampling_target, exact_distributions):
    outputs = top_children_outputs(sampling_target, exact_distributions, TREE_RUNS)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > ALPHA, pvalues


# Power. The real tree drafters' trees are fixed choices too, verified by the same rule as TopChildrenDrafter's;
# what these runs add is each drafter's own trees and state under sampled paths. At 400 runs any deviation of
# w^2 >= 0.113 in one token (df 7), or >= 0.17 in a pair (df 31), is caught 99 times in 100: a token drawn from
# a wrong context (w^2 ~ 0.47, see the top) in half the runs or more (w^2 grows as the square of that share).
# They draft the target's likely tokens, so the subtle rule bug shows too: keeps-rejected-candidate through these
# very runs (seeds 0..399) gives p = 5e-19 (eagle2), 6e-14 (eagle3), 5e-21 (redrafter), 5e-6 (lookahead; 2e-4
# at 350 runs: its n-gram candidates agree least with the target, so it sets this size).
DRAFTER_RUNS = 400


@pytest.mark.parametrize("method, settings", [("eagle2", dict(depth=3, top_k=3, total_tokens=8)),
                                               ("eagle3", dict(depth=3, top_k=3, total_tokens=8)),
                                               ("redrafter", dict(width=3, length=3))],
                         ids=["eagle2", "eagle3", "redrafter"])
def test_trained_tree_sampling_matches_target_distribution(method, settings, sampling_target, exact_distributions):
    """Trained tree drafters (deterministic top-k / beam children) under T=1 sampling."""
    drafter = trained(sampling_target, method, **settings)
    outputs = sample_outputs(sampling_target, lambda seed: drafter, DRAFTER_RUNS)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_trained_assistant_sampling_matches_target_distribution(sampling_target, exact_distributions):
    """sps with the assistant trained here: a chain of sampled drafts, each with its draft distribution."""
    drafter = trained(sampling_target, "sps", num_tokens=3)
    pvalues = target_pvalues(sample_outputs(sampling_target, lambda seed: drafter, DRAFTER_RUNS), exact_distributions)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_batched_sampling_matches_target_distribution(sampling_target, exact_distributions):
    """At batch size 8 (``core.batch``): the same runs, seeds and power as the tree drafters' above, each run a
    lane beside seven others, each drafting its own trees at its own lengths."""
    drafter = trained(sampling_target, "eagle2", depth=3, top_k=3, total_tokens=8)
    records = run_batch(sampling_target, drafter, [SAMPLING_PROMPT] * DRAFTER_RUNS, MAX_NEW, Sampling(temperature=1.0),
                        batch_size=8, stop_on_eos=False, seeds=range(DRAFTER_RUNS))
    outputs = [output_ids(r) for r in records]
    assert all(len(o) == MAX_NEW for o in outputs)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_lookahead_sampling_matches_target_distribution(sampling_target, exact_distributions):
    """Lookahead's two branches are fixed children of one tree: rejection sampling keeps the target's law."""
    drafter = build_drafter("lookahead", sampling_target, window=3, ngram=2, guesses=3)
    outputs = sample_outputs(sampling_target, lambda seed: drafter, DRAFTER_RUNS)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > ALPHA, pvalues


# -- negative controls: the same decodes and checks with a wrong rule fail far below ALPHA ------------

def no_residual(tree, logits, s, gen=None, explain=False, top=None):
    """Wrong chain rule: after a rejection, resample from p instead of the residual max(p - q, 0)."""
    node, path = 0, []
    for child in range(1, len(tree) + 1):  # sps trees are chains
        p = probabilities(logits[node], s)
        x = int(tree.tokens[child - 1])
        if float(torch.rand((), generator=gen)) * float(tree.child_dists[node][x]) >= float(p[x]):
            break
        path.append(child)
        node = child
    p = probabilities(logits[node], s)
    return Acceptance(path, int(torch.multinomial(p, 1, generator=gen)))


def keeps_rejected_candidate(tree, logits, s, gen=None, explain=False, top=None):
    """Wrong rule for fixed children: a rejected candidate stays in the residual (p is never updated)."""
    tokens, kids = tree.tokens.tolist(), tree.children()
    node, path = 0, []
    while True:
        p = probabilities(logits[node], s)
        chosen = next((c for c in kids[node] if float(torch.rand((), generator=gen)) < float(p[tokens[c - 1]])),
                      None)
        if chosen is None:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=gen)))
        path.append(chosen)
        node = chosen


def test_end_to_end_chi_square_has_power(chain_target, chain_assistant, chain_exact, monkeypatch):
    """Negative control: an engine whose rejection forgets the residual max(p - q, 0) (it resamples from p
    after a rejection) fails test_sps_sampling_matches_target_distribution's decodes and checks decisively."""
    import specviz.core.engine as engine

    monkeypatch.setattr(engine, "accept", no_residual)
    pvalues = target_pvalues(sps_outputs(chain_target, chain_assistant, CHAIN_RUNS), chain_exact)
    assert min(pvalues.values()) < CONTROL_BOUND, pvalues


def test_end_to_end_chi_square_has_power_on_trees(sampling_target, exact_distributions, monkeypatch):
    """Negative control: an engine whose tree rule keeps rejected candidates in the residual fails
    test_tree_sampling_matches_target_distribution's decodes and checks decisively."""
    import specviz.core.engine as engine

    monkeypatch.setattr(engine, "accept", keeps_rejected_candidate)
    pvalues = target_pvalues(top_children_outputs(sampling_target, exact_distributions, TREE_RUNS),
                             exact_distributions)
    assert min(pvalues.values()) < CONTROL_BOUND, pvalues
