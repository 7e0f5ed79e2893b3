"""The app with a jointly trained target beside its own (``--joint``), in-process on the tiny app target: the
"(joint)" columns decode on the adapted target, each exact against that target's own AR, at the base budget."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState

from drafters import METHODS
from drafters.training.config import TrainConfig
from drafters.training.distill import self_distill
from drafters.training.features import FeatureSet
from drafters.training.joint import JointOptions, joint_class
from drafters.training.loop import train
from specviz.apps.web.handlers import Handlers
from specviz.apps.web.joint import load_joint
from specviz.apps.web.plan import column_labels, plan_race, setting_specs
from specviz.apps.web.state import load_state
from specviz.core.errors import SpecvizError


@pytest.fixture(scope="module")
def joint_folder(tiny_target_dir, tmp_path_factory):
    """semi-attn trained jointly with a LoRA on the tiny app target (λ 0.25), on its own greedy answers."""
    from specviz.core.load import load_target

    target = load_target(str(tiny_target_dir), "float32", "cpu")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(16)]
    answers = self_distill(target, prompts, 16, 8)
    seqs = [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, answers)]
    data = FeatureSet.build(seqs, [torch.zeros(s.numel(), 0) for s, _ in seqs])
    work = tmp_path_factory.mktemp("joint")
    cfg = TrainConfig(epochs=2, batch_tokens=128, lr=2e-2, draft_vocab=32, seed=0, save_every=1000)
    AcceleratorState._reset_state(reset_partial_state=True)
    method = joint_class(METHODS["semi-attn"][0], JointOptions(lam=0.25, rank=4))
    train(method, target, data, data, cfg, {"source": "random prompts"}, out=work / "checkpoint", work=work)
    return work / "checkpoint"


@pytest.fixture(scope="module")
def state(tiny_target_dir, joint_folder, tiny_checkpoint, tmp_path_factory):
    """The base target with a separately trained semi-attn, and the joint checkpoint's adapted target beside it."""
    from specviz.core.load import load_target

    drafters = tmp_path_factory.mktemp("drafters")
    base = load_target(str(tiny_target_dir), "float32", "cpu")
    shutil.copytree(tiny_checkpoint(base, "semi-attn", epochs=1, prompts=8), drafters / "semi-attn")
    state = load_state(str(tiny_target_dir), "float32", "cpu", tune="off", drafters=str(drafters))
    state.joint = load_joint(state, joint_folder)
    return state


def test_the_joint_columns_decode_on_the_adapted_target_each_exact_against_its_ar(state, ref_greedy):
    joint = state.joint.state
    with torch.no_grad():  # the LoRA moved the target, so running on the base one would show
        ids = torch.tensor([[5, 9, 2, 7]])
        assert (joint.target.model(ids).logits - state.target.model(ids).logits).abs().max() > 1e-4
    labels = ["ar", "semi-attn", "ar (joint)", "semi-attn (joint)", "pld (joint)"]
    assert set(labels[2:]) <= set(column_labels(state)) and "eagle2 (joint)" not in column_labels(state)
    unavailable = plan_race(state, "Hi", ["ar (joint)", "eagle2 (joint)"], 4, 0.0, 1.0, None).notes
    assert unavailable == ["eagle2 (joint) is unavailable on the joint target: only semi-attn's joint checkpoint "
                           "runs there (the others learned the base target)"]
    plan = plan_race(state, "Count to ten.", labels, 20, 0.0, 1.0, None)
    assert set(plan.targets) == set(labels[2:]) and all(t is joint.target for t in plan.targets.values())
    joint_settings, base_settings = (asdict(plan.drafters[m].settings) for m in ("semi-attn (joint)", "semi-attn"))
    assert joint_settings == {**base_settings, "checkpoint": str(state.joint.folder)}  # the base budget, its weights
    out = Handlers(state, setting_specs(state)).compare("Count to ten.", labels, 20)
    runs = out["methods"]
    prompt = state.target.text.encode_chat("Count to ten.")
    own = [t["token"] for t in runs["ar (joint)"]["tokens"]]
    assert own == ref_greedy(joint.target.model, prompt, 20)  # the adapted target's own greedy text
    assert [t["token"] for t in runs["ar"]["tokens"]] == ref_greedy(state.target.model, prompt, 20)
    assert runs["semi-attn (joint)"]["identical_to_ar"] and runs["pld (joint)"]["identical_to_ar"]
    assert runs["semi-attn (joint)"]["text"] == runs["ar (joint)"]["text"]
    assert runs["semi-attn"]["identical_to_ar"] and runs["semi-attn"]["text"] == runs["ar"]["text"]


def test_the_learn_tab_explains_the_joint_columns_only_where_there_are_some(state):
    from specviz.apps.web.views import learn_text

    assert "The (joint) columns" in learn_text(state, notes=False)
    assert "The (joint) columns" not in learn_text(replace(state, joint=None), notes=False)


def test_the_race_tab_badges_each_joint_column_against_its_own_ar(state):
    handlers = Handlers(state, setting_specs(state))
    labels = ["ar", "ar (joint)", "semi-attn (joint)"]
    final = list(handlers.race(SimpleNamespace(session_hash="j"), "Hi there", labels, 12, 0, 1, True, "auto", 0,
                               None, *[s.default for s in handlers.specs]))[-1]
    html = dict(zip(handlers.columns, final))
    assert "✅ identical to ar (joint)" in html["semi-attn (joint)"]
    runs = final[-1]
    base, adapted = runs["ar"]["records"], runs["ar (joint)"]["records"]
    same = [t for r in base for t in r.tokens] == [t for r in adapted for t in r.tokens]
    assert ("same text as the base target" if same else "adapted: parts from the base target's text") in \
        html["ar (joint)"]


def test_joint_columns_without_a_joint_target_and_bad_folders_say_why(tiny_target_dir, joint_folder, tmp_path):
    plain = load_state(str(tiny_target_dir), "float32", "cpu", tune="off", methods=["pld"])
    plan = plan_race(plain, "Hi", ["ar", "semi-attn (joint)"], 4, 0.0, 1.0, None)
    assert list(plan.drafters) == ["ar"] and "no jointly trained target here (start the app with --joint" in \
        plan.notes[0]
    separate = tmp_path / "separate"
    shutil.copytree(joint_folder, separate, ignore=shutil.ignore_patterns("target", "lora"))
    card = json.loads((separate / "card.json").read_text())
    (separate / "card.json").write_text(json.dumps({k: v for k, v in card.items() if k != "joint"}))
    with pytest.raises(SpecvizError, match="not a joint checkpoint"):
        load_joint(plain, separate)
    with pytest.raises(SpecvizError, match="no card.json there"):
        load_joint(plain, tmp_path)
    (separate / "card.json").write_text(json.dumps(card))
    with pytest.raises(SpecvizError, match="the adapted target .* is missing"):
        load_joint(plain, separate)


def test_the_precision_switch_loads_the_joint_target_in_its_precision_too(state):
    handlers = Handlers(state, setting_specs(state))
    out = handlers.compare("Count.", ["ar (joint)", "semi-attn (joint)"], 6, precision="bfloat16")
    fast = handlers.at("bfloat16")
    assert fast.joint is not None and fast.joint.state.target.dtype == torch.bfloat16
    assert fast.joint.state.target.model is not state.joint.state.target.model
    assert set(out["methods"]) == {"ar (joint)", "semi-attn (joint)"} and out["precision"] == "bfloat16"
    assert not any("no jointly trained target" in n for n in out["notes"]), out["notes"]
