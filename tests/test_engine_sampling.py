"""The decoding loop under sampling: every method's output distribution is the target's (chi-square, end to end)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from conftest import chi2_pvalue, session_checkpoint
from drafters import build_drafter
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.engine import run
from specviz.core.protocol import Drafter, DraftRequest
from specviz.core.target import TargetModel
from specviz.core.tree import DraftTree
from specviz.core.verify import Sampling


def trained(target, method: str, **settings):
    """A drafter from a tiny checkpoint trained for ``target`` through the real pipeline (once per test run)."""
    return build_drafter(method, target, checkpoint=str(session_checkpoint(target, method)), **settings)


# -- sampling: the output distribution is the target's (chi-square, end to end) -------------------

SMALL_V = 8
SAMPLING_PROMPT = [1, 2, 3, 4, 5]
MAX_NEW = 4


@pytest.fixture(scope="module")
def sampling_target(tiny_llama) -> TargetModel:
    return TargetModel(tiny_llama(SMALL_V, seed=3, num_layers=2, std=0.1))


@pytest.fixture(scope="module")
def exact_distributions(sampling_target):
    """p(t1), p(t1, t2), ... of the target by enumerating every continuation (batched forwards)."""
    model = sampling_target.model
    joint = {(): 1.0}
    for _ in range(MAX_NEW):
        prefixes = list(joint)
        batch = torch.tensor([SAMPLING_PROMPT + list(p) for p in prefixes])
        with torch.inference_mode():
            probs = torch.softmax(model(batch, use_cache=False).logits[:, -1].double(), -1)
        joint = {p + (t,): joint[p] * float(probs[k, t]) for k, p in enumerate(prefixes) for t in range(SMALL_V)}
    return joint


def marginal(joint: dict, positions: tuple[int, ...]) -> dict:
    out: dict = {}
    for seq, prob in joint.items():
        key = tuple(seq[i] for i in positions)
        out[key] = out.get(key, 0.0) + prob
    return out


def sample_outputs(target, make_drafter, runs: int) -> list[list[int]]:
    outputs = []
    for seed in range(runs):
        result = run(target, make_drafter(seed), SAMPLING_PROMPT, MAX_NEW, Sampling(temperature=1.0, seed=seed),
                     stop_on_eos=False)
        assert len(result.output_ids) == MAX_NEW
        outputs.append(result.output_ids)
    return outputs


def target_pvalues(outputs, joint) -> dict[str, float]:
    """Chi-square p-values of several marginals of the sampled outputs against the exact ones."""
    checks = {"t1": (0,), "t2": (1,), "t3": (2,), "t4": (3,), "(t1, t2)": (0, 1), "(t2, t3)": (1, 2)}
    return {name: chi2_pvalue(Counter(tuple(o[i] for i in pos) for o in outputs), marginal(joint, pos))
            for name, pos in checks.items()}


SAMPLING_RUNS = 3000


def test_sps_sampling_matches_target_distribution(sampling_target, exact_distributions, tiny_llama):
    assistant = tiny_llama(SMALL_V, seed=4, num_layers=2, std=0.1)
    # the assistant really is a different distribution, so a lossy engine would show
    with torch.inference_mode():
        p = torch.softmax(sampling_target.model(torch.tensor([SAMPLING_PROMPT])).logits[0, -1], -1)
        q = torch.softmax(assistant(torch.tensor([SAMPLING_PROMPT])).logits[0, -1], -1)
    assert 0.5 * float((p - q).abs().sum()) > 0.2

    def make(seed):
        return AssistantDrafter(sampling_target, AssistantSettings(num_tokens=3), model=assistant)

    outputs = sample_outputs(sampling_target, make, SAMPLING_RUNS)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > 1e-3, pvalues


class FixedChildrenDrafter(Drafter):
    """Random tree shapes whose children are fixed choices (child_dists None), up to 3 per node.

    The candidates follow a fixed token order (not uniformly random: for uniform candidates even a
    rule that forgets to remove rejected candidates from the residual would be exact)."""

    name = "fixed-children"
    ORDER = [5, 2, 7, 0, 3]

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, state, request: DraftRequest) -> DraftTree:
        tokens, parents, frontier = [], [], [(0, 0)]
        while frontier:
            node, depth = frontier.pop(0)
            if depth == request.max_depth:
                continue
            start = self.rng.randrange(2)
            for tok in self.ORDER[start : start + self.rng.randint(0, 3)]:
                tokens.append(tok)
                parents.append(node)
                frontier.append((len(tokens), depth + 1))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def test_tree_sampling_matches_target_distribution(sampling_target, exact_distributions):
    outputs = sample_outputs(sampling_target, FixedChildrenDrafter, SAMPLING_RUNS // 2)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > 1e-3, pvalues


@pytest.mark.parametrize("method, settings", [("eagle2", dict(depth=3, top_k=3, total_tokens=8)),
                                               ("eagle3", dict(depth=3, top_k=3, total_tokens=8)),
                                               ("redrafter", dict(width=3, length=3))],
                         ids=["eagle2", "eagle3", "redrafter"])
def test_trained_tree_sampling_matches_target_distribution(method, settings, sampling_target, exact_distributions):
    """Trained tree drafters (deterministic top-k / beam children) under T=1 sampling."""
    drafter = trained(sampling_target, method, **settings)
    outputs = sample_outputs(sampling_target, lambda seed: drafter, SAMPLING_RUNS // 2)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > 1e-3, pvalues


def test_lookahead_sampling_matches_target_distribution(sampling_target, exact_distributions):
    """Lookahead's two branches are fixed children of one tree: rejection sampling keeps the target's law."""
    drafter = build_drafter("lookahead", sampling_target, window=3, ngram=2, guesses=3)
    outputs = sample_outputs(sampling_target, lambda seed: drafter, SAMPLING_RUNS // 2)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) > 1e-3, pvalues


def test_end_to_end_chi_square_has_power(sampling_target, exact_distributions, tiny_llama, monkeypatch):
    """Negative control: an engine whose rejection forgets the residual max(p - q, 0) (it resamples
    from p after a rejection) is caught by the same check, with fewer runs."""
    import specviz.core.engine as engine
    from specviz.core.verify import Acceptance, probabilities

    def no_residual(tree, logits, s, gen=None):
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

    monkeypatch.setattr(engine, "accept", no_residual)
    assistant = tiny_llama(SMALL_V, seed=4, num_layers=2, std=0.1)
    settings = AssistantSettings(num_tokens=3)
    outputs = sample_outputs(sampling_target, lambda seed: AssistantDrafter(sampling_target, settings, model=assistant),
                             600)
    pvalues = target_pvalues(outputs, exact_distributions)
    assert min(pvalues.values()) < 1e-6, pvalues
