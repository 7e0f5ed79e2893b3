"""``python -m specviz export``: drafters trained here written in the layouts vLLM and SGLang serve; read back they
draft exactly as before, the speculators package loads its layout, and methods without a serving layout say so."""

from __future__ import annotations

import json

import pytest
import torch
from published_refs import PROMPT, VOCAB, first_drafts, propose, randomise, speculators_drafts, target_fixtures
from safetensors.torch import load_file

from drafters import METHODS, build_drafter
from drafters.checkpoint import CheckpointError, save_checkpoint, target_signature
from drafters.published import export
from specviz.apps.cli import main

TREE = {"eagle2": {"depth": 3, "top_k": 2, "total_tokens": 6}, "hass": {"depth": 3, "top_k": 2, "total_tokens": 6},
        "eagle3": {"depth": 3, "top_k": 2, "total_tokens": 6}, "medusa": {"heads": 4, "top_k": 2, "total_tokens": 8}}


target_dir, target = target_fixtures(seed=5)


def native_checkpoint(target, method: str, folder, draft_vocab: int = VOCAB):
    """A random network of ``method`` saved as specviz saves a trained one (float32, so a round trip is exact)."""
    cls = METHODS[method][0]
    net = cls.new_network(target)
    randomise(net, seed=len(method))
    vocab_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:draft_vocab].sort().values
    card = {"method": method, "target": target_signature(target),
            "features": {"final_norm_output": True, "tapped_layer_inputs": list(cls.tapped_layers(target.num_layers))}}
    save_checkpoint(folder, {**net.state_dict(), "vocab_map": vocab_map}, card, dtype=torch.float32)
    return folder


def trees(drafter, target) -> list[tuple[list[int], list[int]]]:
    out = []
    for cut in (2, 5, len(PROMPT)):
        tree = propose(drafter, target, PROMPT[:cut])
        out.append((tree.tokens.tolist(), tree.parents.tolist()))
    return out


@pytest.mark.parametrize("method,fmt,draft_vocab", [
    ("eagle2", "eagle", VOCAB), ("hass", "eagle", VOCAB), ("eagle3", "eagle3", 30), ("eagle3", "speculators", 30),
    ("eagle3", "speculators", VOCAB), ("medusa", "medusa", VOCAB)])
def test_an_export_read_back_drafts_exactly_as_the_checkpoint_it_came_from(target, tmp_path, method, fmt, draft_vocab):
    native = native_checkpoint(target, method, tmp_path / "native", draft_vocab)
    done = export(method, native, fmt, tmp_path / "out", target, "tiny", dtype="float32")
    assert sorted(p.name for p in done.folder.iterdir()) == sorted(done.files)
    before = build_drafter(method, target, checkpoint=str(native), **TREE[method])
    after = build_drafter(method, target, checkpoint=str(done.folder), **TREE[method])
    assert after.card["published"]["layout"] == fmt
    assert trees(after, target) == trees(before, target)


def test_the_speculators_package_loads_an_export_and_drafts_as_specviz_does(target, target_dir, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    native = native_checkpoint(target, "eagle3", tmp_path / "native", draft_vocab=30)
    export("eagle3", native, "speculators", tmp_path / "out", target, str(target_dir), dtype="float32")
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "out")
    loaded.config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, is for GPUs
    eager = Eagle3DraftModel(loaded.config)
    eager.load_state_dict(loaded.state_dict())
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert not loaded.config.norm_before_residual
    assert not torch.isnan(loaded.lm_head.weight).any() and not torch.isnan(loaded.embed_tokens.weight).any()
    drafter = build_drafter("eagle3", target, checkpoint=str(native), depth=1, top_k=1, total_tokens=1)
    assert speculators_drafts(eager.float().eval(), target, PROMPT) == first_drafts(drafter, target, PROMPT)


def test_the_layouts_say_what_each_server_reads(target, tmp_path):
    native = native_checkpoint(target, "eagle2", tmp_path / "eagle2", draft_vocab=40)
    vllm = export("eagle2", native, "eagle", tmp_path / "vllm", target, "tiny")
    sglang = export("eagle2", native, "eagle", tmp_path / "sglang", target, "tiny", server="sglang")
    assert json.loads((vllm.folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    config = json.loads((sglang.folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and "bias" not in config  # read as attention bias
    assert any("drops fc.bias" in note for note in vllm.notes) and not any("drops" in n for n in sglang.notes)
    assert any("drafts over all 48 tokens" in note for note in vllm.notes)
    medusa = export("medusa", native_checkpoint(target, "medusa", tmp_path / "medusa"), "medusa", tmp_path / "m",
                    target, "tiny")
    config = json.loads((medusa.folder / "config.json").read_text())
    assert config["medusa_fc_bias"] and config["model_type"] == "medusa" and "num_attention_heads" not in config
    keys = set(load_file(medusa.folder / "medusa_lm_head.safetensors"))
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "3.1.weight"} <= keys


@pytest.mark.parametrize("method,fmt,server,message", [
    ("redrafter", "eagle", "vllm", "TensorRT-LLM"), ("fspad", "eagle", "vllm", "hass .*exports with --format eagle"),
    ("semi-attn", "medusa", "vllm", "no serving equivalent"), ("eagle3", "eagle", "vllm", "--format eagle3 or "
                                                                                          "speculators"),
    ("eagle2", "eagle3", "vllm", "--format eagle"), ("pld", "eagle", "vllm", "no trained weights"),
    ("medusa", "medusa", "sglang", "SGLang has no Medusa"), ("eagle3", "speculators", "sglang", "--format eagle3")])
def test_a_method_without_that_serving_layout_is_told_why(target, tmp_path, method, fmt, server, message):
    source = native_checkpoint(target, method, tmp_path / method) if method in ("medusa", "eagle3") else None
    with pytest.raises(CheckpointError, match=message):
        export(method, source, fmt, tmp_path / "out", target, "tiny", server=server)
    assert not (tmp_path / "out").exists()


def test_the_shipped_eagle3_exports_in_eagle3s_layout(tmp_path, capsys):
    from specviz.core.load import embedded_folder

    assert main(["export", "eagle3", "--format", "eagle3", "--out", str(tmp_path / "e3")]) == 0
    printed = capsys.readouterr().out
    assert "\"method\": \"eagle3\"" in printed and "Q4_1 GGUF" in printed
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    state = load_file(tmp_path / "e3" / "model.safetensors")
    h = config["hidden_size"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["num_hidden_layers"] == 1
    assert state["fc.weight"].shape == (h, 3 * h) and state["fc.weight"].dtype == torch.bfloat16
    assert state["lm_head.weight"].shape == (config["draft_vocab_size"], h)
    assert state["d2t"].shape == (config["draft_vocab_size"],) and state["t2d"].shape == (config["vocab_size"],)
    assert {"norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight"} <= set(state)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    base = str(embedded_folder())
    assert main(["export", "eagle3", "--format", "speculators", "--out", str(tmp_path / "s"), "--base", base]) == 0
    from speculators.models.eagle3 import Eagle3DraftModel

    assert Eagle3DraftModel.from_pretrained(tmp_path / "s").config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert main(["export", "redrafter", "--format", "eagle", "--out", str(tmp_path / "r")]) == 2
    assert "TensorRT-LLM" in capsys.readouterr().err
