"""The decoding loop's step records (what each step drafted, kept, emitted and timed; the display observers'
extras) and where a decode stops (EOS, the token limit, the context), on ``test_engine``'s target and prompts."""

from __future__ import annotations

import pytest
import torch
from test_engine import GREEDY_BUILDERS, NEW_TOKENS, PROMPTS, VOCAB, RandomTreeDrafter, ar_references, engine_target

from drafters import build_drafter
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.engine import DISPLAY, generate, hover, margins, run
from specviz.core.target import TargetModel
from specviz.core.verify import Sampling, probabilities


@pytest.fixture(scope="module")
def target(tiny_llama) -> TargetModel:
    return engine_target(tiny_llama)


@pytest.fixture(scope="module")
def ar_outputs(target) -> list[list[int]]:
    return ar_references(target)


@pytest.mark.parametrize("method", ["ar", "pld", "sps", "eagle2"])
def test_step_records(method, target, ar_outputs):
    drafter = GREEDY_BUILDERS[method](target) if method != "sps" else AssistantDrafter(
        target, AssistantSettings(num_tokens=4), model=target.model)
    result = run(target, drafter, PROMPTS[2], NEW_TOKENS[2], stop_on_eos=False, observers=DISPLAY)
    records = result.records
    first = records[0]
    assert first.step == 0 and len(first.tree) == 0 and first.path == [] and first.accepted == 0  # no draft
    assert first.tokens == [first.bonus] and len(first.node_target_p) == 0
    assert [r.step for r in records] == list(range(len(records)))
    assert result.output_ids == [t for r in records for t in r.tokens] == ar_outputs[2]
    assert result.prompt_ids == PROMPTS[2] and result.method == method
    for r in records:
        assert r.timings.verify > 0 and r.timings.accept > 0  # every step ran a forward and the rule
        if len(r.tree):
            assert r.timings.draft > 0  # the drafter's work is timed where it drafted
        assert r.node_target_p.shape == (len(r.tree),)
        assert bool(((r.node_target_p >= 0) & (r.node_target_p <= 1)).all())
        assert 0 < r.bonus_target_p <= 1
        assert r.tokens == [int(r.tree.tokens[n - 1]) for n in r.path] + [r.bonus]
        assert r.accepted == len(r.path) and len(r.tokens) == r.accepted + 1  # no cut: stop_on_eos off, exact fit
    assert sum(len(r.tokens) for r in records) == len(result.output_ids) == NEW_TOKENS[2]
    assert sum(r.timings.total for r in records) <= result.wall_s  # phases never overlap or count twice
    assert (sum(len(r.tree) for r in records) > 0) == (method != "ar")
    if method == "sps":  # the target as its own assistant: every draft is accepted
        assert all(r.accepted == len(r.tree) for r in records)
    assert [r.finished for r in records] == [None] * (len(records) - 1) + ["length"]


@pytest.mark.parametrize("method", ["ar", "eagle2"])
def test_margins_are_the_targets_top2_gaps_per_emitted_token(method, target, ar_outputs, ref_logits):
    """Each emitted token's margin is the target's top-1 minus top-2 logit where it chose that token."""
    from specviz.core.metrics import divergence, token_margins

    i = 2
    result = run(target, GREEDY_BUILDERS[method](target), PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False,
                 observers=(margins,))
    logits = ref_logits(target.model, PROMPTS[i] + result.output_ids)[len(PROMPTS[i]) - 1: -1]
    top2 = logits.topk(2, -1).values
    got = token_margins(result.records)
    assert len(got) == len(result.output_ids)
    torch.testing.assert_close(torch.tensor(got), top2[:, 0] - top2[:, 1], atol=1e-4, rtol=1e-4)
    # a wrong token planted where AR's choice was closest / furthest from a tie
    ids = result.output_ids
    close, far = min(range(len(got)), key=got.__getitem__), max(range(len(got)), key=got.__getitem__)
    tolerance = (got[close] + got[far]) / 2
    for at, kind in ((close, "near-tie"), (far, "clear")):
        planted = ids[:at] + [(ids[at] + 1) % VOCAB] + ids[at + 1:]
        d = divergence(planted, ids, got, tolerance)
        assert (d.kind, d.at) == (kind, at)


def test_benches_skip_the_hover_probabilities_and_nothing_else(target, ar_outputs):
    drafter = GREEDY_BUILDERS["eagle2"](target)
    shown = run(target, drafter, PROMPTS[4], NEW_TOKENS[4], stop_on_eos=False, observers=DISPLAY)
    bare = run(target, drafter, PROMPTS[4], NEW_TOKENS[4], stop_on_eos=False, observers=(margins,))
    assert bare.output_ids == shown.output_ids == ar_outputs[4]
    assert [r.margins for r in bare.records] == [r.margins for r in shown.records]
    assert [(r.tree.tokens.tolist(), r.path) for r in bare.records] == [(r.tree.tokens.tolist(), r.path)
                                                                        for r in shown.records]
    assert all(r.node_target_p.numel() == 0 and r.bonus_target_p is None for r in bare.records)
    assert all(r.node_target_p.numel() == len(r.tree) for r in shown.records)
    lean = run(target, drafter, PROMPTS[4], NEW_TOKENS[4], stop_on_eos=False)  # no observer: no margins either
    assert lean.output_ids == ar_outputs[4] and all(r.margins == [] for r in lean.records)


def test_sampled_hovers_are_the_sampling_distribution_at_each_parent(target):
    """At T > 0 with top-p, each shown probability is the sampling distribution (temperature and nucleus) of
    the whole row it was chosen at, though the observer computes only the rows it shows."""
    seen = []
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=5)
    drafter = RandomTreeDrafter(PROMPTS[1], None, seed=4)
    records = list(generate(target, drafter, PROMPTS[1], 8, sampling, stop_on_eos=False,
                            observers=(seen.append, hover)))
    assert len(seen) == len(records) and any(len(v.record.tree) > 1 for v in seen)  # the prefill too
    for v in seen:
        full = probabilities(v.logits, v.sampling)
        rows = torch.cat([v.record.tree.parents, torch.tensor([v.keep[-1]])])
        cols = torch.cat([v.record.tree.tokens, torch.tensor([v.record.bonus])])
        expected = full[rows, cols]
        torch.testing.assert_close(v.record.node_target_p, expected[:-1])
        assert v.record.bonus_target_p == pytest.approx(float(expected[-1]))


def test_step_records_node_probabilities(target):
    """node_target_p is the target's probability of each draft token given its parent."""
    prompt = PROMPTS[1]
    drafter = RandomTreeDrafter(prompt, None, seed=3)
    records = list(generate(target, drafter, prompt, 8, stop_on_eos=False, observers=(hover,)))
    seq, checked = list(prompt) + records[0].tokens, 0
    for r in records[1:]:
        expected = []
        for i, tok in enumerate(r.tree.tokens.tolist(), start=1):
            path, n = [], int(r.tree.parents[i - 1])
            while n:
                path.append(int(r.tree.tokens[n - 1]))
                n = int(r.tree.parents[n - 1])
            with torch.inference_mode():
                logits = target.model(torch.tensor([seq + path[::-1]])).logits[0, -1]
            expected.append(float(torch.softmax(logits, -1)[tok]))
        torch.testing.assert_close(r.node_target_p, torch.tensor(expected).reshape(-1), atol=1e-4, rtol=1e-4)
        checked += len(expected)
        seq += r.tokens
    assert checked > 5


@pytest.mark.parametrize("method", ["ar", "pld", "sps"])
def test_eos_stops_right_after_it(method, tiny_llama, ar_outputs):
    # pick a prompt whose greedy output contains a token first seen after a few steps
    for i, out in enumerate(ar_outputs):
        fresh = [j for j, tok in enumerate(out) if j >= 3 and tok not in out[:j]]
        if fresh:
            cut = fresh[0]
            break
    else:
        pytest.fail("no usable EOS candidate")
    eos = ar_outputs[i][cut]
    target = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4, eos=eos))
    assert target.text.eos_token_ids == {eos}
    drafter = build_drafter(method, target) if method != "sps" else AssistantDrafter(
        target, AssistantSettings(num_tokens=5), model=target.model)
    result = run(target, drafter, PROMPTS[i], NEW_TOKENS[i])
    assert result.output_ids == ar_outputs[i][: cut + 1]
    assert result.records[-1].finished == "eos"
    assert all(r.finished is None for r in result.records[:-1])
    # stop_on_eos=False runs through it
    assert run(target, drafter, PROMPTS[i], NEW_TOKENS[i], stop_on_eos=False).output_ids == ar_outputs[i]


def test_max_new_tokens_one_and_two(target, ar_outputs):
    for n in (1, 2):
        drafter = AssistantDrafter(target, AssistantSettings(num_tokens=4), model=target.model)
        result = run(target, drafter, PROMPTS[0], n, stop_on_eos=False)
        assert result.output_ids == ar_outputs[0][:n]
        assert result.records[-1].finished == "length"
        assert len(result.records) == n  # n == 2: step 1 has max_depth 0, so it drafts nothing
        assert all(len(r.tree) == 0 for r in result.records)


def test_generation_fills_the_context(tiny_llama, ref_greedy):
    target = TargetModel(tiny_llama(VOCAB, seed=0, num_layers=4, max_positions=40))
    prompt = PROMPTS[0]
    n = target.max_length - len(prompt)
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=5), model=target.model)
    result = run(target, drafter, prompt, n, stop_on_eos=False)
    assert result.output_ids == ref_greedy(target.model, prompt, n)


@pytest.mark.parametrize("method", ["ar", "eagle2"])
def test_the_display_fetches_what_hover_and_margins_fetch_apart(method, target):
    """``display``, the app's observer, computes the hovers and the margins on the device and copies them to the
    host at once: the records hold exactly what the two observers fill apart."""
    together, apart = (run(target, GREEDY_BUILDERS[method](target), PROMPTS[1], NEW_TOKENS[1], stop_on_eos=False,
                           observers=observers).records for observers in (DISPLAY, (hover, margins)))
    assert len(together) == len(apart) and any(len(r.tree) for r in together) == (method != "ar")
    for a, b in zip(together, apart):
        assert torch.equal(a.node_target_p, b.node_target_p) and a.bonus_target_p == b.bonus_target_p
        assert a.margins == b.margins and len(a.margins) == len(a.tokens)
