"""Published checkpoints (EAGLE-1/2 and HASS, EAGLE-3 in its two layouts, Medusa-1) load as specviz drafters and draft
what their own code computes; a wrong one gets a clear error and leaves the other methods working."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from published_refs import (
    DRAFT_VOCAB,
    PROMPT,
    VOCAB,
    eagle_chain,
    eagle_model,
    first_drafts,
    medusa_heads,
    prefill,
    propose,
    speculators_drafts,
    speculators_model,
    target_fixtures,
)
from safetensors.torch import load_file, save_file

from conftest import make_llama, reference_greedy
from drafters import build_drafter, checkpoint_sources, with_checkpoints
from drafters.checkpoint import CheckpointError
from specviz.core.engine import run
from specviz.core.errors import SettingsError
from specviz.core.target import TargetModel

target_dir, target = target_fixtures(seed=3)


def output(target, drafter, n: int = 20) -> list[int]:
    return run(target, drafter, PROMPT, n, stop_on_eos=False).output_ids


@pytest.mark.parametrize("method", ["eagle2", "hass"])
def test_an_eagle_checkpoint_drafts_what_eagles_own_network_drafts(target, tmp_path, method):
    reference = eagle_model(target, tmp_path / "eagle")
    drafter = build_drafter(method, target, checkpoint=str(tmp_path / "eagle"), depth=4, top_k=1, total_tokens=4)
    assert drafter.card["published"]["layout"] == "eagle"
    for cut in (3, 6, len(PROMPT)):
        tree = propose(drafter, target, PROMPT[:cut])
        assert tree.tokens.tolist() == eagle_chain(reference, target, PROMPT[:cut], 4)
    assert drafter.frozen.head.data_ptr() == target.model.lm_head.weight.data_ptr()  # the whole vocabulary, uncopied
    assert output(target, drafter) == reference_greedy(target.model, PROMPT, 20)


def test_a_speculators_checkpoint_drafts_what_the_speculators_package_drafts(target, target_dir, tmp_path):
    reference = speculators_model(target, target_dir)
    reference.save_pretrained(tmp_path / "spec")
    drafter = build_drafter("eagle3", target, checkpoint=str(tmp_path / "spec"), depth=1, top_k=1, total_tokens=1)
    assert drafter.card["features"]["tapped_layer_inputs"] == [1, 2, 4]
    assert drafter.frozen.vocab_map.numel() == DRAFT_VOCAB
    assert first_drafts(drafter, target, PROMPT) == speculators_drafts(reference, target, PROMPT)
    deep = build_drafter("eagle3", target, checkpoint=str(tmp_path / "spec"), depth=4, top_k=3, total_tokens=10)
    assert output(target, deep) == reference_greedy(target.model, PROMPT, 20)


def test_the_residual_after_the_hidden_norm_is_read_from_the_speculators_config(target, target_dir, tmp_path):
    reference = speculators_model(target, target_dir, norm_before_residual=True)
    reference.save_pretrained(tmp_path / "spec")
    drafter = build_drafter("eagle3", target, checkpoint=str(tmp_path / "spec"), depth=1, top_k=1, total_tokens=1)
    assert drafter.net.norm_before_residual
    assert first_drafts(drafter, target, PROMPT) == speculators_drafts(reference, target, PROMPT)


def test_eagle3s_own_layout_reads_as_the_speculators_converter_converts_it(target, target_dir, tmp_path):
    """The original layout (``midlayer.*``, ``LlamaForCausalLMEagle3``) loads, and gives the same drafts as the
    folder speculators' own converter makes of it."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    speculators_model(target, target_dir, aux=(2, 4, 5)).save_pretrained(tmp_path / "spec")
    original = tmp_path / "original"
    original.mkdir()
    state = load_file(tmp_path / "spec" / "model.safetensors")
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "embed_tokens.weight"},
              original / "model.safetensors")
    layer = json.loads((tmp_path / "spec" / "config.json").read_text())["transformer_layer_config"]
    (original / "config.json").write_text(json.dumps({**layer, "architectures": ["LlamaForCausalLMEagle3"],
                                                      "draft_vocab_size": DRAFT_VOCAB}))
    Eagle3Converter().convert(original, tmp_path / "converted", base_model=str(target_dir), validate=True)
    trees = {}
    for name in ("original", "converted", "spec"):
        drafter = build_drafter("eagle3", target, checkpoint=str(tmp_path / name), depth=3, top_k=2, total_tokens=6)
        assert drafter.card["features"]["tapped_layer_inputs"] == [2, 4, 5]  # EAGLE-3's default: 2, N/2, N-3
        trees[name] = [propose(drafter, target, PROMPT[:cut]).tokens.tolist() for cut in (4, len(PROMPT))]
    assert trees["original"] == trees["converted"] == trees["spec"]


@pytest.mark.parametrize("layers", [1, 2])
def test_a_medusa_checkpoint_drafts_each_heads_own_argmax(target, tmp_path, layers):
    heads = medusa_heads(target, tmp_path / "medusa", heads=3, layers=layers)
    drafter = build_drafter("medusa", target, checkpoint=str(tmp_path / "medusa"), heads=3, top_k=1, total_tokens=3)
    for cut in (2, 5, len(PROMPT)):
        feats, _ = prefill(target, PROMPT[:cut], taps=False)
        with torch.no_grad():
            expected = [int(head(feats[-1]).argmax()) for head in heads]
        assert propose(drafter, target, PROMPT[:cut]).tokens.tolist() == expected
    wide = build_drafter("medusa", target, checkpoint=str(tmp_path / "medusa"), heads=3, top_k=3, total_tokens=8)
    assert output(target, wide) == reference_greedy(target.model, PROMPT, 20)


def test_a_checkpoint_for_another_target_is_refused_plainly(target, target_dir, tmp_path):
    eagle_model(target, tmp_path / "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    with pytest.raises(CheckpointError, match="trained for a target with vocab_size=32000"):
        build_drafter("eagle2", target, checkpoint=str(tmp_path / "eagle"))
    deeper = TargetModel(make_llama(VOCAB, seed=3, num_layers=4))
    speculators_dir = tmp_path / "spec"
    speculators_model(target, target_dir, aux=(2, 4, 5)).save_pretrained(speculators_dir)
    with pytest.raises(CheckpointError, match="inputs of layers \\[2, 4, 5\\].*4 decoder layers"):
        build_drafter("eagle3", deeper, checkpoint=str(speculators_dir))


def test_a_layout_runs_only_as_its_method_and_a_weights_file_holds_only_tensors(target, tmp_path):
    eagle_model(target, tmp_path / "eagle")
    with pytest.raises(CheckpointError, match="runs as eagle2 or hass, not eagle3"):
        build_drafter("eagle3", target, checkpoint=str(tmp_path / "eagle"))
    shutil.copytree(tmp_path / "eagle", tmp_path / "norms")  # HASS's variant with extra norms: not EAGLE's network
    state = torch.load(tmp_path / "norms" / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "embedding_layernorm.weight": torch.ones(64)}, tmp_path / "norms" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no place for: \\['embedding_layernorm.weight'\\]"):
        build_drafter("hass", target, checkpoint=str(tmp_path / "norms"))
    shutil.copytree(tmp_path / "eagle", tmp_path / "code")
    torch.save({"fc.weight": torch.zeros(2), "hook": torch.nn.Linear(2, 2)}, tmp_path / "code" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="unreadable|not plain tensors"):
        build_drafter("eagle2", target, checkpoint=str(tmp_path / "code"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no weights"):
        build_drafter("eagle2", target, checkpoint=str(tmp_path / "empty"))


def test_a_hub_id_that_cannot_be_fetched_says_so(target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="no folder nobody/no-such-eagle.*model hub.*pass the folder"):
        build_drafter("eagle3", target, checkpoint="nobody/no-such-eagle")


def test_drafter_options_name_trained_methods_and_add_their_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e3").mkdir()
    sources = checkpoint_sources(["eagle3=./e3", "medusa = owner/medusa-heads"])
    assert sources == {"eagle3": "./e3", "medusa": "owner/medusa-heads"}
    assert with_checkpoints(["ar", "eagle3:depth=3", "medusa:checkpoint=mine", "hf"], sources) == [
        "ar", "eagle3:depth=3:checkpoint=./e3", "medusa:checkpoint=mine", "hf"]
    for bad, message in (("eagle3", "METHOD=FOLDER_OR_HUB_ID"), ("pld=./x", "loads no checkpoint"),
                         ("nope=./x", "unknown method"), ("eagle3=./no-e3", "no such folder"),
                         ("medusa=runs/no/heads", "no such folder")):
        with pytest.raises(SettingsError, match=message):
            checkpoint_sources([bad])


def test_the_app_races_a_published_drafter_beside_the_shipped_ones(tiny_target_dir, tmp_path):
    from specviz.apps.teaching import checkpoint_facts
    from specviz.apps.web.state import load_state
    from specviz.core.load import load_target

    eagle_model(load_target(str(tiny_target_dir), "float32", "cpu"), tmp_path / "eagle")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    state = load_state(str(tiny_target_dir), "float32", "cpu", tune="off",
                       checkpoints={"eagle2": str(tmp_path / "eagle"), "medusa": str(tmp_path / "broken")})
    assert state.drafters["eagle2"].card["published"]["source"] == str(tmp_path / "eagle")
    assert "published checkpoint" in checkpoint_facts(state.drafters["eagle2"].card)
    assert "no weights" in state.unavailable["medusa"]
    assert {"ar", "pld", "eagle2"} <= set(state.drafters)


def test_layouts_are_told_apart_by_their_config_and_weight_names():
    from drafters.published import DETECTION
    from drafters.published.eagle import Eagle
    from drafters.published.eagle3 import Original, Speculators
    from drafters.published.files import HUB_ID
    from drafters.published.llama import layer_weights, published_layer
    from drafters.published.medusa import Medusa

    assert set(DETECTION) == {Eagle, Original, Speculators, Medusa}

    def detect(config, keys):
        return next(layout.NAME for layout in DETECTION if layout.matches(config, set(keys)))

    layer = ["layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight"]
    assert detect({}, ["fc.weight", "embed_tokens.weight", *layer]) == "eagle"
    assert detect({"draft_vocab_size": 32}, ["fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight"]) == "eagle3"
    assert detect({"speculators_model_type": "eagle3"}, ["fc.weight", "lm_head.weight", *layer]) == "speculators"
    assert detect({}, ["0.0.linear.weight", "0.1.weight"]) == detect({"medusa_num_heads": 2}, []) == "medusa"
    assert [bool(HUB_ID.match(s)) for s in ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "./eagle", "a/b/c", "/abs/x")] == [
        True, False, False, False]
    names = {f"layers.0.{k}": torch.ones(1) for k in ("self_attn.q_proj.weight", "mlp.up_proj.weight",
                                                      "post_attention_layernorm.weight")}
    assert published_layer(layer_weights(names, "layers.0."), "layers.0.") == names
