"""Trained hidden-state drafters at decode time: ReDrafter's merged beam tree, semi-AR's single target forward
per step, Medusa's static tree, and their checkpoints and settings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from trained_helpers import checkpoint_fixtures

from drafters import build_drafter
from drafters.checkpoint import CheckpointError
from drafters.medusa import tree_choices
from specviz.core.engine import run
from specviz.core.errors import SettingsError
from specviz.core.metrics import summarize
from specviz.core.protocol import Commit, DraftRequest
from specviz.core.tree import DraftTree
from specviz.core.verify import Sampling

VOCAB, HIDDEN = 64, 64
METHODS = ("medusa", "redrafter", "semi-attn", "semi-lstm")


target, checkpoints = checkpoint_fixtures(VOCAB, METHODS, epochs=4)


def test_redrafter_tree_is_its_beams_merged_and_verified_once(target, checkpoints):
    drafter = build_drafter("redrafter", target, checkpoint=str(checkpoints["redrafter"]), width=6, length=4)
    prompt = [3, 17, 42, 8, 5]
    result = run(target, drafter, prompt, 20, stop_on_eos=False)
    steps = [r for r in result.records if r.step > 0 and len(r.tree)]
    assert steps
    shared = 0
    for r in steps:
        beams = r.tree.info["beams"]
        assert beams.shape[0] == 6 and len({tuple(b) for b in beams.tolist()}) == 6  # distinct beams
        assert r.tree.info["compression"] == beams.numel() / len(r.tree) >= 1.0
        shared += len(r.tree) < beams.numel()
        for b, nodes in zip(beams, r.tree.info["beam_nodes"]):  # each beam is a root-to-node path
            assert r.tree.input_ids(0)[nodes].tolist() == b.tolist()
    assert shared, "no step shared a prefix: the dedup check is vacuous"
    ratios = [r.tree.info["compression"] for r in steps]
    assert summarize(result.records).mean_compression == pytest.approx(sum(ratios) / len(ratios))
    # the merged tree's verify logits equal verifying one drafted beam alone
    r = max(steps, key=lambda s: s.tree.info["compression"])
    history = prompt + [t for rec in result.records[: r.step] for t in rec.tokens]
    root = history[-1]
    cache = target.new_cache()
    target.prefill(history[:-1], cache)
    merged, _ = target.verify(root, r.tree, cache)
    for beam, nodes in zip(r.tree.info["beams"], r.tree.info["beam_nodes"]):
        target.prefill(history[:-1], cache)
        alone, _ = target.verify(root, DraftTree.chain(beam), cache)
        torch.testing.assert_close(merged[[0] + nodes.tolist()], alone, atol=1e-4, rtol=1e-4)


def test_width_one_is_a_chain(target, checkpoints):
    drafter = build_drafter("semi-lstm", target, checkpoint=str(checkpoints["semi-lstm"]), length=4)
    result = run(target, drafter, [1, 2, 3, 4], 12, stop_on_eos=False)
    trees = [r.tree for r in result.records if len(r.tree)]
    assert trees and all(t.is_chain and len(t) <= 4 for t in trees)


# -- semi-AR reads h_p from the verify: one target forward per step -------------------------------

@pytest.mark.parametrize("method", ["semi-attn", "semi-lstm"])
def test_semi_ar_calls_the_target_once_per_step(method, target, checkpoints):
    drafter = build_drafter(method, target, checkpoint=str(checkpoints[method]), length=4)
    calls = []
    hook = target.model.get_decoder().register_forward_pre_hook(lambda *_: calls.append(1))  # once a forward
    try:
        result = run(target, drafter, [9, 8, 7, 6, 5], 24, stop_on_eos=False)
    finally:
        hook.remove()
    assert len(calls) == len(result.records)  # prefill + one verify per step, none from the drafter
    assert sum(r.accepted for r in result.records) > 0
    assert max(len(r.tree) for r in result.records) == 4


# -- Medusa's static tree --------------------------------------------------------------------------

def test_medusa_tree_choices_by_hand():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.05]]
    chosen = tree_choices(acc, top_k=3, total=5)
    # products: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.18 (0,0,0)=.12 ... the best five, parents first
    assert chosen == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert tree_choices(acc, top_k=1, total=3) == [(0,), (0, 0), (0, 0, 0)]  # top_k 1: a chain
    big = tree_choices(acc, top_k=3, total=20)
    assert len(big) == 20 and all(c[:-1] in big for c in big if len(c) > 1)


def observe_random_state(drafter, seed: int = 0):
    """A new decode state that has observed random features; returned."""
    g, state = torch.Generator().manual_seed(seed), drafter.start()
    drafter.observe(state, Commit(torch.tensor([1, 2]), torch.randn(2, HIDDEN, generator=g), 3))
    return state


@torch.inference_mode()
def test_medusa_tree_takes_each_choice_from_its_heads_ranks(target, checkpoints):
    drafter = build_drafter("medusa", target, checkpoint=str(checkpoints["medusa"]), heads=3, top_k=3, total_tokens=9)
    state = observe_random_state(drafter)
    tree = drafter.propose(state, DraftRequest([1, 2, 3], 10, Sampling()))
    choices = tree.info["choices"]
    assert len(tree) == 9 and [len(c) for c in choices] == tree.depths.tolist()
    ranked = [drafter.frozen.logits(drafter.net.heads[d](state.x))[0].argsort(descending=True) for d in range(3)]
    for node, c in enumerate(choices, start=1):
        assert int(tree.parents[node - 1]) == (0 if len(c) == 1 else choices.index(c[:-1]) + 1)
        assert int(tree.tokens[node - 1]) == int(drafter.frozen.vocab_map[ranked[len(c) - 1][c[-1]]])
    short = drafter.propose(state, DraftRequest([1, 2, 3], 1, Sampling()))  # one token left: depth-1 nodes only
    assert short.max_depth == 1 and len(short) == sum(len(c) == 1 for c in choices)


# -- checkpoints and settings -----------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_round_trip(method, target, checkpoints):
    folder = checkpoints[method]
    drafter = build_drafter(method, target, checkpoint=str(folder))
    saved = load_file(str(folder / "weights.safetensors"))
    assert torch.equal(drafter.frozen.vocab_map, saved.pop("vocab_map").long())
    state = drafter.net.state_dict()
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(state[name], value.float()), name
    card = json.loads((folder / "card.json").read_text())
    assert card["method"] == method
    assert card["parameters"]["trained"] == sum(p.numel() for p in drafter.net.parameters())
    assert {f"rank1_{r}" for r in range(8)} <= set(card["history"][-1]["val"])
    twin = build_drafter(method, target, checkpoint=str(folder))
    a = run(target, drafter, [5, 6, 7], 16, stop_on_eos=False)
    b = run(target, twin, [5, 6, 7], 16, stop_on_eos=False)
    for x, y in zip(a.records, b.records):
        assert torch.equal(x.tree.tokens, y.tree.tokens) and torch.equal(x.tree.parents, y.tree.parents)


@pytest.mark.parametrize("method, other",
                         [("medusa", "redrafter"), ("semi-attn", "semi-lstm"), ("redrafter", "medusa")])
def test_checkpoint_of_another_network(method, other, target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints[other], tmp_path / "copy")
    with pytest.raises(CheckpointError, match=f"holds a '{other}' checkpoint, not '{method}'"):
        build_drafter(method, target, checkpoint=str(copy))
    card = json.loads((copy / "card.json").read_text())
    (copy / "card.json").write_text(json.dumps({**card, "method": method}))
    with pytest.raises(CheckpointError, match=f"{method} checkpoint does not fit this target: missing"):
        build_drafter(method, target, checkpoint=str(copy))
    assert build_drafter("pld", target).name == "pld"


def test_missing_checkpoint_and_bad_settings(target, checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="no semi-lstm checkpoint at .*nowhere"):
        build_drafter("semi-lstm", target, checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(SettingsError, match="semi-attn drafts at most 4 tokens"):
        build_drafter("semi-attn", target, checkpoint=str(checkpoints["semi-attn"]), length=5)
    with pytest.raises(SettingsError, match="width must be in"):
        build_drafter("redrafter", target, checkpoint=str(checkpoints["redrafter"]), width=0)
    with pytest.raises(SettingsError, match="heads must be in"):
        build_drafter("medusa", target, checkpoint=str(checkpoints["medusa"]), heads=9)
