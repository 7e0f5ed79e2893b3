"""Training variants (the papers' ablations): each builds the network it names, trains through the real
pipeline into a checkpoint its base method decodes, keeps the base's run keys apart from its own, and is
exact against AR in fp32."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from drafters import METHODS, build_drafter
from drafters.eagle2 import FeatureNet, layer_config
from drafters.redrafter import RecurrentHead
from drafters.training.config import TrainConfig, run_key
from drafters.variants import VARIANTS, trained_class, trained_names
from specviz.core.engine import run
from specviz.core.errors import SettingsError
from specviz.core.files import content_key

VOCAB, HIDDEN = 48, 64


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(VOCAB, seed=0, num_layers=2)


def test_every_variant_names_a_trained_base_and_changes_something():
    trained = {n for n, (c, _) in METHODS.items() if getattr(c, "trained", False)}
    for name, v in VARIANTS.items():
        assert v.base in trained and (v.loss or v.network), name
        cls = trained_class(name)
        assert issubclass(cls, METHODS[v.base][0]) and cls.name == v.base and cls.variant_name == name
        for key, value in v.loss.items():
            assert getattr(cls.loss, key) == value
    assert trained_names()[-len(VARIANTS):] == list(VARIANTS)
    with pytest.raises(SettingsError, match="neither a trained method nor a variant"):
        trained_class("eagle9")


def test_a_variant_is_another_run_and_the_bases_keys_are_unchanged():
    cfg = TrainConfig()
    base = METHODS["fspad"][0]
    assert run_key(base, "k", cfg) == content_key(["fspad", "k", {k: v for k, v in vars(cfg).items()
                                                                  if k not in ("save_every", "validate_every")},
                                                   base.loss])  # the key the shipped runs were saved under
    keys = {run_key(trained_class(n), "k", cfg) for n in ("fspad", "fspad-no-sampler", "fspad-no-pad",
                                                          "fspad-paper-sampler")}
    assert len(keys) == 4
    assert run_key(trained_class("hass-beta0.5"), "k", cfg) != run_key(METHODS["hass"][0], "k", cfg)


def test_feature_networks_the_fspad_variants_build(target):
    h, i = HIDDEN, target.config.intermediate_size
    no_sampler = trained_class("fspad-no-sampler").new_network(target, sampler=False)
    assert not hasattr(no_sampler, "sampler_gate") and no_sampler.mlp.down_proj.weight.shape == (2 * h, i)
    no_pad = trained_class("fspad-no-pad").new_network(target, split=False)
    assert hasattr(no_pad, "sampler_gate") and no_pad.mlp.down_proj.weight.shape == (h, i)
    paper = trained_class("fspad-paper-sampler").new_network(target, sampler="gate")
    assert not hasattr(paper, "fuse") and paper.sampler == "gate"
    with pytest.raises(ValueError, match="sampler"):
        FeatureNet(layer_config(target.config), sampler="conv")


def test_the_papers_sampler_gates_the_feature_itself(target):
    """sampler='gate': the attention reads f + down(SiLU(gate(e)) * up(norm(f))), with no fc connector."""
    torch.manual_seed(5)
    net = FeatureNet(layer_config(target.config), sampler="gate", split=True).eval()
    g = torch.Generator().manual_seed(5)
    feats, embeds = torch.randn(1, 4, HIDDEN, generator=g), torch.randn(1, 4, HIDDEN, generator=g)
    seen = {}
    hook = net.attn.register_forward_pre_hook(lambda _m, args, kwargs: seen.__setitem__("x", args[0].clone())
                                              if args else seen.__setitem__("x", kwargs["hidden_states"].clone()),
                                              with_kwargs=True)
    mask = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        net(feats, embeds, torch.arange(4)[None], mask, DynamicCache())
        want = feats + net.sampler_down(torch.nn.functional.silu(net.sampler_gate(embeds))
                                        * net.sampler_up(net.sampler_norm(feats)))
    hook.remove()
    torch.testing.assert_close(seen["x"], want)


def test_redrafter_without_the_rnn_sums_the_embeddings():
    net = RecurrentHead(HIDDEN, recurrent=False)
    assert not hasattr(net, "U") and not hasattr(net, "W")
    e0, e1, e2 = torch.randn(3, 2, HIDDEN).unbind(0)
    state = net.advance(net.advance(net.start(None, e0), e1, 1), e2, 2)
    torch.testing.assert_close(state[0], e0 + e1 + e2)
    assert len(RecurrentHead(HIDDEN, blocks=4).blocks) == 4


ARCHITECTURES = ["fspad-no-sampler", "fspad-no-pad", "fspad-paper-sampler", "redrafter-no-rnn",
                 "redrafter-4blocks", "hass-beta0.5", "semi-hq-last", "semi-hq-tf2"]
SETTINGS = {"fspad": dict(depth=3, top_k=3, total_tokens=8), "hass": dict(depth=3, top_k=3, total_tokens=8),
            "redrafter": dict(width=3, length=3), "semi-attn": dict(width=2, length=4)}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_variant_checkpoint_decodes_through_its_base_exactly(name, target, tiny_checkpoint, ref_greedy):
    folder = tiny_checkpoint(target, name)
    card = json.loads((folder / "card.json").read_text())
    v = VARIANTS[name]
    assert card["method"] == v.base and card["variant"] == name
    assert card.get("network", {}) == {**METHODS[v.base][0].network_kwargs, **v.network}
    drafter = build_drafter(v.base, target, checkpoint=str(folder), **SETTINGS[v.base])
    assert type(drafter.net) is type(trained_class(name).new_network(target, **v.network))
    g = torch.Generator().manual_seed(11)
    accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
        result = run(target, drafter, prompt, 24, stop_on_eos=False)
        assert result.output_ids == ref_greedy(target.model, prompt, 24), f"{name} differs from greedy decoding"
        accepted += sum(r.accepted for r in result.records)
    assert accepted > 0, f"{name}: no draft token was accepted (a vacuous check)"
