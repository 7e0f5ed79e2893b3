"""EAGLE-3: the target's tapped layers, their fusion, the same taps in training and decoding, the network."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from conftest import train_tiny_drafter
from drafters import build_drafter
from drafters.eagle3 import Eagle3Drafter, FusedNet, fusion_layers
from drafters.training.features import LayerTaps
from specviz.core.engine import run
from specviz.core.errors import SpecvizError
from specviz.core.protocol import Commit
from specviz.core.target import TargetError
from specviz.core.tree import DraftTree, additive_mask

VOCAB = 48


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(VOCAB, seed=3, num_layers=6)


def reference_hidden(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_fusion_layers_are_low_middle_high():
    assert fusion_layers(30) == (2, 15, 27)  # SmolLM2-135M: inputs of layers 2, L/2, L-3
    assert fusion_layers(32) == (2, 16, 29)
    for n in range(1, 8):
        assert all(0 <= i < n for i in fusion_layers(n))


def test_tapped_layers_follow_the_features(tiny_target):
    target = tiny_target(VOCAB, seed=4, num_layers=5)
    prompt = [3, 9, 1, 40, 7, 22]
    plain = target.prefill(prompt, target.new_cache())[1]
    assert target.tap([3, 1]) == [1, 2]
    assert target.tap([1, 4]) == [2, 3]  # a second drafter shares the first one's taps
    logits, feats = target.prefill(prompt, target.new_cache())
    h = target.config.hidden_size
    assert feats.shape == (len(prompt), 4 * h)
    assert torch.equal(feats[:, :h], plain)
    hidden = reference_hidden(target.model, prompt)
    for block, layer in enumerate((3, 1, 4), start=1):
        torch.testing.assert_close(feats[:, block * h:(block + 1) * h], hidden[layer][0])
    with pytest.raises(TargetError, match="5 decoder layers"):
        target.tap([5])


def test_tree_verify_taps_each_node_as_a_sequential_forward(tiny_target):
    target = tiny_target(VOCAB, seed=5, num_layers=4)
    target.tap([2])
    prompt, root = [5, 6, 7], 8
    tree = DraftTree(torch.tensor([10, 11, 12]), torch.tensor([0, 0, 1]), torch.zeros(3))  # root->10->12, root->11
    cache = target.new_cache()
    target.prefill(prompt, cache)
    _, feats = target.verify(root, tree, cache)
    h = target.config.hidden_size
    for node, path in ((0, []), (1, [10]), (2, [11]), (3, [10, 12])):
        hidden = reference_hidden(target.model, prompt + [root] + path)
        torch.testing.assert_close(feats[node, h:], hidden[2][0, -1], atol=1e-4, rtol=1e-4)


def test_training_taps_equal_the_decoding_taps(target):
    """What EAGLE-3 trains on (stored features + layers computed on the fly, right-padded batch) is what the
    target hands it while decoding."""
    layers = fusion_layers(target.num_layers)
    columns = target.tap(layers)
    seqs = [[4, 8, 15, 16, 23, 42], [1, 2, 3]]
    width = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    h = target.config.hidden_size
    stored = torch.zeros(len(seqs), width, h)
    decoded = []
    for row, s in enumerate(seqs):
        tokens[row, :len(s)] = torch.tensor(s)
        feats = target.prefill(s, target.new_cache())[1]
        stored[row, :len(s)] = feats[:, :h]
        decoded.append(torch.cat([feats[:, c * h:(c + 1) * h] for c in columns], dim=-1))
    trained = LayerTaps(target, layers)(tokens, stored)
    assert trained.shape == (len(seqs), width, 4 * h)
    for row, s in enumerate(seqs):
        torch.testing.assert_close(trained[row, :len(s), h:], decoded[row], atol=1e-4, rtol=1e-4)


def test_training_on_tokens_alone_ends_where_stored_features_take_it(target):
    """``prepare(features=False)``: the taps' forward supplies the final-norm features too (rounded to
    float16 as stored ones are), so EAGLE-3 trains to the same weights without a feature cache."""
    from drafters import METHODS
    from drafters.training.config import TrainConfig
    from drafters.training.distill import self_distill
    from drafters.training.features import FeatureSet, extract_features
    from drafters.training.loop import train

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(16)]
    seqs = [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, self_distill(target, prompts, 12, 8))]
    stored = extract_features(target, seqs)
    alone = FeatureSet.build(seqs, [torch.zeros(s.numel(), 0) for s, _ in seqs])
    cfg = TrainConfig(epochs=1, batch_tokens=128, lr=3e-3, draft_vocab=VOCAB, seed=0)
    first, second = (train(METHODS["eagle3"][0], target, data, data, cfg, {"source": "test"})["history"][-1]
                     for data in (stored, alone))
    assert second["val"] == pytest.approx(first["val"], abs=1e-6)  # the same agreement at every depth
    assert second["train"] == pytest.approx(first["train"], rel=1e-3) and first["train"]


def test_fused_net_reads_embedding_and_hidden_side_by_side(target):
    torch.manual_seed(0)
    net = Eagle3Drafter.new_network(target).eval()
    h = target.config.hidden_size
    assert isinstance(net, FusedNet) and net.fc.in_features == 3 * h and net.attn.q_proj.in_features == 2 * h
    hidden, embeds = torch.randn(2, 5, h), torch.randn(2, 5, h)
    mask = additive_mask(torch.ones(5, 5, dtype=torch.bool).tril())
    positions = torch.arange(5)[None].expand(2, 5)
    with torch.no_grad():
        head_in, out = net(hidden, embeds, positions, mask, DynamicCache())
        torch.testing.assert_close(head_in, net.out_norm(out))
        for module in (net.attn.o_proj, net.mlp.down_proj):  # both branches off: the residual carries the hidden
            module.weight.zero_()
        _, out = net(hidden, embeds, positions, mask, DynamicCache())
    torch.testing.assert_close(out, hidden)


def test_pipeline_trains_on_the_tapped_layers_and_decodes_exactly(target, tmp_path, ref_greedy):
    folder = train_tiny_drafter(target, "eagle3", tmp_path / "eagle3")
    card = json.loads((folder / "card.json").read_text())
    assert card["features"]["tapped_layer_inputs"] == list(fusion_layers(target.num_layers)) == [2, 3, 3]
    assert set(card["history"][-1]["val"]) >= {"acc1", "acc2", "acc3", "acc4"}
    drafter = build_drafter("eagle3", target, checkpoint=str(folder), depth=4, top_k=3, total_tokens=10)
    assert set(target.taps) >= {2, 3}
    accepted = 0
    for prompt in ([1, 5, 9, 2], [30, 31, 7, 7, 19]):
        result = run(target, drafter, prompt, 24, stop_on_eos=False)
        assert result.output_ids == ref_greedy(target.model, prompt, 24)
        accepted += sum(r.accepted for r in result.records)
    assert accepted > 0


def test_features_are_the_fused_taps(target, tmp_path):
    folder = train_tiny_drafter(target, "eagle3", tmp_path / "eagle3", epochs=1)
    drafter = build_drafter("eagle3", target, checkpoint=str(folder))
    feats = target.prefill([1, 2, 3], target.new_cache())[1]
    h = target.config.hidden_size
    taps = torch.cat([feats[:, c * h:(c + 1) * h] for c in drafter.columns], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(drafter.features(Commit(torch.tensor([1, 2, 3]), feats, 4)), drafter.net.fc(taps))


def test_a_missing_checkpoint_taps_nothing(tiny_target, tmp_path):
    target = tiny_target(VOCAB, seed=6, num_layers=4)
    with pytest.raises(SpecvizError, match="no eagle3 checkpoint"):
        build_drafter("eagle3", target, checkpoint=str(tmp_path / "nowhere"))
    assert target.taps == () and target.prefill([1, 2], target.new_cache())[1].shape[-1] == target.config.hidden_size
