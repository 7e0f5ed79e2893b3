"""Trained feature drafters: the protocol, the frozen target head, checkpoint round-trip and every checkpoint error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from trained_helpers import HIDDEN, METHODS, VOCAB, Twin, checkpoint_fixtures, load, prompts

from drafters import build_drafter, checkpoint
from drafters.checkpoint import CheckpointError
from drafters.trained import TrainedDrafter
from drafters.vocab_head import FrozenTarget, draft_vocabulary
from specviz.core.engine import run
from specviz.core.errors import SpecvizError
from specviz.core.protocol import Commit
from specviz.core.target import TargetModel

target, checkpoints = checkpoint_fixtures(VOCAB, METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_round_trip(method, target, checkpoints):
    folder = checkpoints[method]
    drafter = load(target, checkpoints, method, depth=3, top_k=3, total_tokens=8)
    saved = load_file(str(folder / "weights.safetensors"))
    assert saved["vocab_map"].dtype == torch.int32
    assert torch.equal(drafter.frozen.vocab_map, saved.pop("vocab_map").long())
    state = drafter.net.state_dict()
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(state[name], value.float()), name
    card = json.loads((folder / "card.json").read_text())
    assert card["method"] == method and drafter.card == card
    assert card["target"]["hidden_size"] == HIDDEN and card["target"]["vocab_size"] == VOCAB
    assert card["data"]["source"] and card["training"]["steps"] > 0
    assert card["parameters"]["extra_memory_pct"] > 0
    assert card["parameters"]["trained"] == sum(p.numel() for p in drafter.net.parameters())
    # a second load drafts the same trees on the same history
    twin = Twin(drafter, load(target, checkpoints, method, depth=3, top_k=3, total_tokens=8))
    run(target, twin, prompts(1, seed=5)[0], 12, stop_on_eos=False)
    assert len(twin.log) > 3
    for _, a, b in twin.log:
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)


# -- errors ----------------------------------------------------------------------------------------

def expect_error(target, method, folder, match):
    with pytest.raises(CheckpointError, match=match) as info:
        build_drafter(method, target, checkpoint=str(folder))
    assert isinstance(info.value, SpecvizError)
    assert build_drafter("pld", target).name == "pld"  # nothing else broke


def llama_target(vocab: int, hidden: int) -> TargetModel:
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return TargetModel(transformers.LlamaForCausalLM(config).float().eval())


def test_every_trained_method_is_a_trained_drafter_and_the_protocol_is_declared():
    from drafters import METHODS as ALL

    trained = {name for name, (cls, _) in ALL.items() if cls.trained}
    assert trained == {name for name, (cls, _) in ALL.items() if issubclass(cls, TrainedDrafter)}
    assert {"sps", "eagle2", "hass", "fspad", "eagle3", "medusa", "redrafter", "semi-attn", "semi-lstm"} == trained
    with pytest.raises(NotImplementedError):
        TrainedDrafter.new_network(None)
    with pytest.raises(NotImplementedError):
        TrainedDrafter.training_loss(None, None, None, None, None)


def test_trained_drafter_takes_the_targets_features_as_they_are(target, checkpoints):
    """Commit.features are the final-norm output: the drafter only moves them, it never normalises again."""
    drafter = load(target, checkpoints, "eagle2")
    feats = torch.randn(3, HIDDEN, dtype=torch.float64)
    moved = drafter.features(Commit(torch.tensor([1, 2, 3]), feats, 4))
    assert moved.dtype == target.dtype and torch.equal(moved, feats.to(target.dtype))
    assert drafter.num_parameters() == sum(p.numel() for p in drafter.net.parameters()) + drafter.frozen.head.numel()


def test_draft_vocabulary_is_the_most_frequent_tokens_plus_the_forced_ones():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 1, 1, 1, 1])
    assert draft_vocabulary(tokens, 2, 12).tolist() == [1, 5]  # sorted ids of the two most frequent
    assert draft_vocabulary(tokens, 2, 12, always=[11]).tolist() == [1, 11]
    assert draft_vocabulary(tokens, 0, 12).tolist() == list(range(12))


def test_frozen_target_head_is_the_targets_rows(target):
    vocab_map = torch.tensor([0, 3, 7, 40])
    frozen = FrozenTarget(target, vocab_map)
    x = torch.randn(2, HIDDEN)
    full = target.model.get_output_embeddings()(x)
    torch.testing.assert_close(frozen.logits(x), full[:, vocab_map])
    torch.testing.assert_close(frozen.embed(torch.tensor([3])), target.model.get_input_embeddings()(torch.tensor([3])))


def test_missing_checkpoint(target, tmp_path):
    expect_error(target, "eagle2", tmp_path / "nowhere", r"no eagle2 checkpoint at .*nowhere")


def test_checkpoint_of_another_method(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["hass"], tmp_path / "copy")
    expect_error(target, "eagle2", copy, r"holds a 'hass' checkpoint, not 'eagle2'")
    # FSPAD weights behind a card that claims eagle2: the tensors themselves do not fit
    other = shutil.copytree(checkpoints["fspad"], tmp_path / "other")
    card = json.loads((other / "card.json").read_text())
    (other / "card.json").write_text(json.dumps({**card, "method": "eagle2"}))
    expect_error(target, "eagle2", other, r"eagle2 checkpoint does not fit .*unexpected \['sampler_")


def test_checkpoint_for_another_hidden_size(checkpoints):
    narrow = llama_target(VOCAB, 32)
    expect_error(narrow, "eagle2", checkpoints["eagle2"], r"hidden_size=64 .*this target .*hidden_size=32")


def test_checkpoint_for_another_vocab(checkpoints, tiny_target, tmp_path):
    small = tiny_target(32, seed=0, num_layers=2)
    expect_error(small, "fspad", checkpoints["fspad"], r"vocab_size=64 .*this target .*vocab_size=32")
    # without the card's guard, the draft vocabulary itself is caught
    copy = shutil.copytree(checkpoints["fspad"], tmp_path / "copy")
    card = json.loads((copy / "card.json").read_text())
    del card["target"]["vocab_size"]
    (copy / "card.json").write_text(json.dumps(card))
    expect_error(small, "fspad", copy, r"draft vocabulary reaches id \d+, beyond this target's vocab of 32")


def test_corrupt_weights(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["eagle2"], tmp_path / "copy")
    weights = copy / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    expect_error(target, "eagle2", copy, r"unreadable \(corrupt or truncated\)")


def test_shipped_checkpoint_is_compressed_and_loads_the_same(target, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "ASSETS", tmp_path / "assets")
    stale = tmp_path / "assets" / "hass" / "weights.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older, uncompressed checkpoint")
    shipped = checkpoint.ship_checkpoint(checkpoints["hass"], "hass")
    assert sorted(f.name for f in shipped.iterdir()) == ["card.json", "weights.safetensors.xz"]
    plain = checkpoints["hass"] / "weights.safetensors"
    assert (shipped / "weights.safetensors.xz").stat().st_size < plain.stat().st_size
    a, b = (build_drafter("hass", target, checkpoint=str(f)) for f in (checkpoints["hass"], shipped))
    for (name, x), (_, y) in zip(a.net.state_dict().items(), b.net.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert torch.equal(a.frozen.vocab_map, b.frozen.vocab_map) and a.card == b.card
    xz = shipped / "weights.safetensors.xz"
    xz.write_bytes(xz.read_bytes()[:-100])
    expect_error(target, "hass", shipped, r"weights\.safetensors\.xz is unreadable \(corrupt or truncated\)")
    xz.unlink()
    expect_error(target, "hass", shipped, r"no hass checkpoint at .*train one with")


def test_invalid_card(target, checkpoints, tmp_path):
    copy = shutil.copytree(checkpoints["hass"], tmp_path / "copy")
    (copy / "card.json").write_text('{"method": "hass", "target": {')
    expect_error(target, "hass", copy, r"card .*card\.json is not valid JSON")


@pytest.mark.parametrize("text", ["[]", '"x"', '{"method": "eagle2", "target": null}'])
def test_cards_that_are_not_cards(tmp_path, text):
    from drafters.checkpoint import CheckpointError, read_card

    (tmp_path / "card.json").write_text(text)
    with pytest.raises(CheckpointError, match="not a card"):
        read_card(tmp_path)
