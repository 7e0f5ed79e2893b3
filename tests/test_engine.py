"""The decoding loop: every method is lossless token for token under greedy decoding. What the step records hold
and where a decode stops: ``test_engine_records.py``; sampling: ``test_engine_sampling.py``; one drafter object
serving interleaved decodes: ``test_interleaved.py``."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import drafters
from conftest import session_checkpoint
from drafters import build_drafter
from drafters.ar import AutoregressiveDrafter
from drafters.pld import PromptLookupSettings
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.engine import run
from specviz.core.protocol import Drafter, DraftRequest
from specviz.core.target import TargetModel, VerifyPadding
from specviz.core.tree import DraftTree

VOCAB = 32


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated segments, so prompt lookup has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 6))]
        b = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        prompts.append(a + b + a + b[:1])
    return prompts


PROMPTS = make_prompts(10, seed=0)
NEW_TOKENS = [random.Random(i).randint(24, 40) for i in range(len(PROMPTS))]
# The greedy checks over several prompts decode a prefix of each AR reference (greedy decoding of n tokens is the
# first n tokens of AR's longer decode) and compare with it token for token, every prompt's end included (drafts
# cut to the tokens left). test_every_method_is_lossless_greedy decodes two thirds: 145 to 188 verify steps per
# method over the ten prompts, and every method still accepts its deepest path of the whole decodes (5 tokens
# for semi-lstm, 4 for redrafter and semi-attn, 3 for skip and sps, 2 for the rest; at 3/5 prompt lookup's 2
# would go). The settings sweeps decode half. NEW_TOKENS stays the length of the single-decode tests (records,
# margins, EOS, random trees) and of test_interleaved.py's decodes.
METHOD_TOKENS = [2 * n // 3 for n in NEW_TOKENS]
SWEEP_TOKENS = [n // 2 for n in NEW_TOKENS]


def engine_target(tiny_llama) -> TargetModel:
    """The 4-layer target these tests decode with (``test_engine_records`` too)."""
    return TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4))


def ar_references(target) -> list[list[int]]:
    """AR's greedy output for every prompt at its full length."""
    ar = AutoregressiveDrafter()
    return [run(target, ar, p, n, stop_on_eos=False).output_ids for p, n in zip(PROMPTS, NEW_TOKENS)]


@pytest.fixture(scope="module")
def target(tiny_llama) -> TargetModel:
    return engine_target(tiny_llama)


@pytest.fixture(scope="module")
def ar_outputs(target) -> list[list[int]]:
    return ar_references(target)


def noisy_copy(model, std: float, seed: int):
    """An assistant close to the target: same weights plus noise (partial acceptance)."""
    other = type(model)(model.config).eval()  # a fresh module: no hooks the target added to its model
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return other


_SHARED: dict = {}  # (shared key, prompt index, tokens) -> RunResult


def check_greedy_equivalence(target, drafter, ar_outputs, prompts=range(len(PROMPTS)), tokens=SWEEP_TOKENS,
                             shared: str | None = None):
    """Decode ``tokens[i]`` tokens of each prompt and compare them with AR's, token for token. ``shared`` names
    a drafter configuration that several tests build identically (same method, settings and models): they
    share its decodes (at METHOD_TOKENS), each making its own assertions on them."""
    results = []
    for i in prompts:
        key = (shared, i, tokens[i])
        result = _SHARED.get(key) if shared else None
        if result is None:
            result = run(target, drafter, PROMPTS[i], tokens[i], stop_on_eos=False)
            if shared:
                _SHARED[key] = result
        assert result.output_ids == ar_outputs[i][: tokens[i]], \
            f"prompt {i}: {drafter.name} differs from autoregressive decoding"
        results.append(result)
    return results


def drafted_and_accepted(results) -> tuple[int, int]:
    drafted = sum(len(r.tree) for res in results for r in res.records)
    accepted = sum(r.accepted for res in results for r in res.records)
    return drafted, accepted


# -- greedy: every method == autoregressive --------------------------------------------------------

def test_ar_engine_matches_plain_greedy(target, ar_outputs, ref_greedy):
    """The baseline itself: engine AR == greedy decoding with cache-free full forwards."""
    for i in (0, 3, 7):
        assert ar_outputs[i] == ref_greedy(target.model, PROMPTS[i], NEW_TOKENS[i])
        assert len(ar_outputs[i]) == NEW_TOKENS[i]


def test_ar_logits_have_no_near_ties(target, ar_outputs, ref_logits):
    """Guard for the token-for-token tests: argmax decisions are far from ties in this model."""
    gaps = []
    for i in (0, 5):
        logits = ref_logits(target.model, PROMPTS[i] + ar_outputs[i])[len(PROMPTS[i]) - 1:]
        top2 = logits.topk(2, -1).values
        gaps.append((top2[:, 0] - top2[:, 1]).min())
    assert min(gaps) > 1e-3


def trained(target, method: str, **settings):
    """A drafter from a tiny checkpoint trained for ``target`` through the real pipeline (once per test run)."""
    return build_drafter(method, target, checkpoint=str(session_checkpoint(target, method)), **settings)


def noisy_assistant(t: TargetModel):
    """The sps assistant of ``GREEDY_BUILDERS`` and ``test_sps_greedy[noisy-*]``: the target plus a little noise."""
    return noisy_copy(t.model, 0.03, 1)


GREEDY_BUILDERS = {
    "ar": lambda t: build_drafter("ar", t),
    "pld": lambda t: build_drafter("pld", t),
    "lookahead": lambda t: build_drafter("lookahead", t, window=4, ngram=3, guesses=4),
    "skip": lambda t: build_drafter("skip", t, layers=2, num_tokens=3),
    "sps": lambda t: AssistantDrafter(t, AssistantSettings(num_tokens=3), model=noisy_assistant(t)),
    "eagle2": lambda t: trained(t, "eagle2", depth=4, top_k=3, total_tokens=10),
    "hass": lambda t: trained(t, "hass", depth=3, top_k=4, total_tokens=8),
    "fspad": lambda t: trained(t, "fspad", depth=5, top_k=2, total_tokens=6),
    "eagle3": lambda t: trained(t, "eagle3", depth=5, top_k=3, total_tokens=12),
    "medusa": lambda t: trained(t, "medusa", heads=4, top_k=3, total_tokens=10),
    "redrafter": lambda t: trained(t, "redrafter", width=4, length=4),
    "semi-attn": lambda t: trained(t, "semi-attn", length=4),
    "semi-lstm": lambda t: trained(t, "semi-lstm", width=3, length=5),
}


@pytest.mark.parametrize("method", sorted(drafters.METHODS))
def test_every_method_is_lossless_greedy(method, target, ar_outputs):
    assert method in GREEDY_BUILDERS, f"add a builder for the new method {method!r} to this test"
    drafter = GREEDY_BUILDERS[method](target)
    assert isinstance(drafter, drafters.METHODS[method][0])
    results = check_greedy_equivalence(target, drafter, ar_outputs, tokens=METHOD_TOKENS, shared=method)
    drafted, accepted = drafted_and_accepted(results)
    if method != "ar":
        assert drafted > 0 and accepted > 0, f"{method} never had a draft accepted: the check is vacuous"


@pytest.mark.parametrize("settings", [dict(), dict(num_tokens=1), dict(num_tokens=3, max_ngram=2),
                                      dict(num_tokens=12, max_ngram=5, min_ngram=2)], ids=str)
def test_pld_greedy(settings, target, ar_outputs):
    # the default settings are test_every_method_is_lossless_greedy[pld]'s drafter: its decodes are shared
    same = not settings
    results = check_greedy_equivalence(target, build_drafter("pld", target, **settings), ar_outputs,
                                       tokens=METHOD_TOKENS if same else SWEEP_TOKENS, shared="pld" if same else None)
    nonempty = sum(1 for res in results for r in res.records if len(r.tree))
    drafted, accepted = drafted_and_accepted(results)
    assert nonempty > 0 and accepted > 0, "prompt lookup never proposed/accepted anything"
    assert all(len(r.tree) <= settings.get("num_tokens", PromptLookupSettings().num_tokens)
               for res in results for r in res.records)


# num_tokens 2 and 4 were cut: the chain drafter runs the same code for every depth above 1 (3 and 5 cover it,
# and the cut to the tokens left at each prompt's end); 1 is the one-token draft (no feed between drafts).
@pytest.mark.parametrize("layers, num_tokens", list(itertools.product([1, 2, 3], [1, 3, 5])))
def test_skip_greedy(layers, num_tokens, target, ar_outputs):
    drafter = build_drafter("skip", target, layers=layers, num_tokens=num_tokens)
    # layers=2, num_tokens=3 is test_every_method_is_lossless_greedy[skip]'s drafter: its decodes are shared
    same = (layers, num_tokens) == (2, 3)
    results = check_greedy_equivalence(target, drafter, ar_outputs, prompts=[layers, 4 + num_tokens],
                                       tokens=METHOD_TOKENS if same else SWEEP_TOKENS, shared="skip" if same else None)
    assert all(len(r.tree) <= num_tokens for res in results for r in res.records)
    assert drafted_and_accepted(results)[0] > 0
    # the view did not break the target: it still has all its layers
    assert len(target.model.get_decoder().layers) == 4


# random-3 was cut: the chain drafter runs the same code for every depth above 1, and random-5 covers it (noisy-3
# is test_every_method_is_lossless_greedy[sps]'s drafter, so its decodes cost nothing here).
@pytest.mark.parametrize("assistant, num_tokens", [("random", 1), ("random", 5), ("noisy", 1), ("noisy", 3),
                                                   ("noisy", 5)], ids=lambda v: str(v))
def test_sps_greedy(assistant, num_tokens, target, ar_outputs, tiny_llama, ref_greedy):
    # the random assistant has one layer (its drafts cost less; it is no less unrelated to the target)
    model = tiny_llama(VOCAB, seed=11, num_layers=1) if assistant == "random" else noisy_assistant(target)
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=num_tokens), model=model)
    same = (assistant, num_tokens) == ("noisy", 3)  # GREEDY_BUILDERS["sps"]
    results = check_greedy_equivalence(target, drafter, ar_outputs, tokens=METHOD_TOKENS if same else SWEEP_TOKENS,
                                       shared="sps" if same else None)
    drafted, accepted = drafted_and_accepted(results)
    assert accepted > 0, f"the {assistant} assistant never had a draft accepted: the check is vacuous"
    if assistant == "noisy":  # the target's weights plus noise: its first drafts are accepted well above chance
        steps = [r for res in results for r in res.records if len(r.tree)]
        hits = sum(1 for r in steps if r.accepted)
        assert hits / len(steps) > 2 / VOCAB, f"{hits} of {len(steps)} steps accepted a draft"
        return
    # a random assistant: every draft is the assistant's own greedy continuation, as deep as the run allowed
    for i, res in zip((0, 1), results):
        seq, produced = list(PROMPTS[i]), 0
        for r in res.records:
            if r.step:
                depth = min(num_tokens, SWEEP_TOKENS[i] - produced - 1)
                assert r.tree.tokens.tolist() == ref_greedy(model, seq, depth), f"prompt {i}, step {r.step}"
            seq += r.tokens
            produced += len(r.tokens)


# num_tokens 2 was cut: every depth above 1 runs the same code, and 4 covers it (7: drafts cut to the tokens left)
@pytest.mark.parametrize("num_tokens", [1, 4, 7])
def test_self_speculation_accepts_everything(num_tokens, target, ar_outputs):
    """The target as its own assistant: every draft is accepted, tau = k + 1 except near the end."""
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=num_tokens), model=target.model)
    for res, i in zip(check_greedy_equivalence(target, drafter, ar_outputs), range(len(PROMPTS))):
        produced = len(res.records[0].tokens)
        for r in res.records[1:]:
            depth = min(num_tokens, SWEEP_TOKENS[i] - produced - 1)
            assert len(r.tree) == depth
            assert r.accepted == depth, f"step {r.step}: {r.accepted} of {depth} accepted"
            assert len(r.tokens) == depth + 1
            produced += len(r.tokens)
        assert produced == SWEEP_TOKENS[i]


class RandomTreeDrafter(Drafter):
    """Random trees of random shapes; one walk spells (a prefix of) the true greedy continuation."""

    name = "random-tree"

    def __init__(self, prompt, reference, seed, max_nodes=12, vocab=VOCAB, sampled=False):
        self.prompt, self.reference = prompt, reference
        self.rng = random.Random(seed)
        self.max_nodes, self.vocab = max_nodes, vocab
        self.shapes: set[tuple[int, ...]] = set()

    def propose(self, state, request: DraftRequest) -> DraftTree:
        rng, limit = self.rng, request.max_depth
        done = len(request.tokens) - len(self.prompt)
        truth = self.reference[done : done + limit] if self.reference is not None else []
        parents, tokens, depth = [], [], [0]

        def add(parent, token):
            parents.append(parent)
            tokens.append(token)
            depth.append(depth[parent] + 1)
            return len(tokens)

        def noise(count):
            for _ in range(count):
                candidates = [i for i in range(len(tokens) + 1) if depth[i] < limit]
                add(rng.choice(candidates), rng.randrange(self.vocab))

        noise(rng.randint(0, self.max_nodes // 2))
        if truth and rng.random() < 0.85:
            node = 0
            for tok in truth[: rng.randint(1, len(truth))]:
                if rng.random() < 0.1:  # a wrong token: the walk stops being accepted here
                    tok = (tok + 1) % self.vocab
                node = add(node, tok)
        noise(rng.randint(0, self.max_nodes // 2))
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        assert tree.max_depth <= limit
        self.shapes.add(tuple(parents))
        return tree


def test_random_tree_drafter_greedy(target, ar_outputs):
    shapes, accepted, branching = set(), 0, 0
    for i in range(len(PROMPTS)):
        drafter = RandomTreeDrafter(PROMPTS[i], ar_outputs[i], seed=i)
        result = run(target, drafter, PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False)
        assert result.output_ids == ar_outputs[i], f"prompt {i}"
        shapes |= drafter.shapes
        accepted += sum(r.accepted for r in result.records)
        branching += sum(1 for r in result.records if any(len(k) > 1 for k in r.tree.children()))
    assert len(shapes) > 30 and branching > 20
    assert accepted > sum(NEW_TOKENS) // 4  # paths deep in the trees were accepted


def test_padded_verifies_stay_lossless(target, ar_outputs):
    """Every verify padded with filler nodes (as a machine whose kernels prefer larger sizes would)."""
    padding = VerifyPadding({n: n + 3 for n in range(1, 40)}, {n: n + 3 for n in range(2, 40)})
    pld = build_drafter("pld", target, num_tokens=3)
    for i in range(len(PROMPTS)):
        n, reference = SWEEP_TOKENS[i], ar_outputs[i][: SWEEP_TOKENS[i]]
        assert run(target, pld, PROMPTS[i], n, stop_on_eos=False, padding=padding).output_ids == reference
        drafter = RandomTreeDrafter(PROMPTS[i], reference, seed=100 + i)
        assert run(target, drafter, PROMPTS[i], n, stop_on_eos=False, padding=padding).output_ids == reference
