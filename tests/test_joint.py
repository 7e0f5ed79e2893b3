"""Joint training of a LoRA on the target with its drafter (semi-AR §4.2): the gradient reaches both, λ = 1 is
separate training bit for bit, and the adapted target with its drafter decodes exactly as its own AR."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from drafters import METHODS, build_drafter
from drafters.training.batches import make_batch
from drafters.training.config import TrainConfig
from drafters.training.distill import self_distill
from drafters.training.features import FeatureSet
from drafters.training.joint import JointOptions, joint_class
from drafters.training.loop import train
from drafters.vocab_head import FrozenTarget
from specviz.apps import training_cli
from specviz.core.engine import run
from specviz.core.errors import SettingsError
from specviz.core.target import TargetModel

VOCAB = 48
SEMI = METHODS["semi-attn"][0]


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(VOCAB, seed=1, num_layers=2)


@pytest.fixture(scope="module")
def data(target) -> FeatureSet:
    """Random prompts with the target's own answers, tokens only: features are computed on the fly."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(24)]
    answers = self_distill(target, prompts, 16, 8)
    seqs = [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, answers)]
    return FeatureSet.build(seqs, [torch.zeros(s.numel(), 0) for s, _ in seqs])


def fit(method, target, data, work, lr=3e-3, epochs=2):
    cfg = TrainConfig(epochs=epochs, batch_tokens=128, lr=lr, draft_vocab=32, seed=0, save_every=1000)
    AcceleratorState._reset_state(reset_partial_state=True)
    return train(method, target, data, data, cfg, {"source": "random prompts"}, out=work / "checkpoint", work=work)


def test_the_joint_gradient_reaches_the_lora_and_the_drafter(target, data):
    net = joint_class(SEMI, JointOptions(lam=0.25)).new_network(target)
    tokens, feats, valid = make_batch(data, list(range(6)), 64)
    frozen = FrozenTarget(target, torch.arange(32))
    loss, stats = joint_class(SEMI, JointOptions(lam=0.25)).training_loss(net, frozen, tokens, feats, valid)
    loss.backward()
    lora_b = [p for n, p in net.lm.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None for p in lora_b) and any(p.grad.abs().sum() > 0 for p in lora_b)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.drafter.parameters() if p.dim() > 1)
    assert stats["lm_loss"] > 0 and not any(p.requires_grad for n, p in net.lm.named_parameters() if "lora_" not in n)
    separate = joint_class(SEMI, JointOptions(lam=1.0))
    net = separate.new_network(target)
    separate.training_loss(net, frozen, tokens, feats, valid)[0].backward()
    assert all(p.grad is None for n, p in net.lm.named_parameters() if "lora_" in n)  # λ = 1: nothing reaches it
    with pytest.raises(SettingsError, match="lambda"):
        JointOptions(lam=1.5)
    with pytest.raises(SettingsError, match="reads other inputs"):
        joint_class(METHODS["eagle3"][0], JointOptions())


def test_lambda_one_is_separate_training_bit_for_bit(target, data, tmp_path):
    fit(SEMI, target, data, tmp_path / "separate")
    card = fit(joint_class(SEMI, JointOptions(lam=1.0)), target, data, tmp_path / "joint")
    alone = load_file(str(tmp_path / "separate" / "state" / "network.safetensors"))
    joint = load_file(str(tmp_path / "joint" / "state" / "network.safetensors"))
    assert set(joint) == {f"drafter.{k}" for k in alone} | {k for k in joint if "lora_" in k}
    for key, value in alone.items():
        assert torch.equal(joint[f"drafter.{key}"], value), key
    assert all(not v.any() for k, v in joint.items() if "lora_B" in k)  # the target never moved
    assert card["joint"]["lam"] == 1.0 and card["joint"]["lora_parameters"] > 0


def test_the_adapted_target_with_its_drafter_is_exact(target, data, tmp_path, ref_greedy):
    card = fit(joint_class(SEMI, JointOptions(lam=0.25, rank=4)), target, data, tmp_path, lr=2e-2, epochs=3)
    folder = tmp_path / "checkpoint"
    saved = json.loads((folder / "card.json").read_text())
    assert saved["method"] == "semi-attn" and saved["joint"]["target"] == "target" and card["joint"]["rank"] == 4
    adapted = TargetModel(AutoModelForCausalLM.from_pretrained(folder / "target", torch_dtype=torch.float32).eval())
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        moved = (adapted.model(ids).logits - target.model(ids).logits).abs().max()
    assert moved > 1e-4, "the LoRA left the target unchanged: the exactness check below would be vacuous"
    drafter = build_drafter("semi-attn", adapted, checkpoint=str(folder), width=2, length=4)
    accepted = 0
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]):
        result = run(adapted, drafter, prompt, 20, stop_on_eos=False)
        assert result.output_ids == ref_greedy(adapted.model, prompt, 20)
        accepted += sum(r.accepted for r in result.records)
    assert accepted > 0
    assert (folder / "lora" / "adapter_config.json").exists()


def test_train_joint_on_a_domain_slice_from_the_command_line(tiny_target_dir, tmp_path, monkeypatch, capsys):
    from specviz.apps.cli import main

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "joint"
    code = main(["train", "--drafter", "semi-attn", "--joint", "--lambda", "0.5", "--lora-rank", "2",
                 "--target", str(tiny_target_dir), "--samples", "6", "--domain", "code", "--no-self-distill",
                 "--answer-tokens", "8", "--epochs", "1", "--draft-vocab", "256", "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    card = json.loads((out / "card.json").read_text())
    assert card["data"]["domain"] == "code" and not card["data"]["self_distilled"]
    assert card["joint"]["lam"] == 0.5 and card["joint"]["rank"] == 2 and (out / "target" / "config.json").exists()
    assert main(["train", "--drafter", "semi-attn", "--joint", "--ship", "--target", str(tiny_target_dir)]) == 2
    assert "not shipped" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    training_cli.add_parsers(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):  # a slice is one of the stated rules
        parser.parse_args(["train", "--drafter", "semi-attn", "--domain", "cooking"])
    assert parser.parse_args(["train", "--drafter", "semi-attn", "--joint"]).lam == 0.25
