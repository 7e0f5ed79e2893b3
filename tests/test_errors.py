"""User mistakes surface as SpecvizError subclasses with messages that say what is wrong."""

from __future__ import annotations

import pytest

from drafters import build_drafter
from drafters.ar import AutoregressiveDrafter
from drafters.sps import AssistantDrafter, AssistantSettings
from specviz.core.engine import run
from specviz.core.errors import SettingsError, SpecvizError
from specviz.core.load import LoadError, load_target, resolve_dtype
from specviz.core.verify import Sampling


@pytest.fixture(scope="module")
def target(tiny_llama):
    from specviz.core.target import TargetModel

    return TargetModel(tiny_llama(32, seed=0, num_layers=4, max_positions=16))


def test_error_family():
    assert issubclass(SettingsError, SpecvizError) and issubclass(SettingsError, ValueError)
    assert issubclass(LoadError, SpecvizError)


def test_empty_prompt(target):
    with pytest.raises(SettingsError, match="prompt is empty"):
        run(target, AutoregressiveDrafter(), [], 4)


@pytest.mark.parametrize("length", [16, 40])
def test_prompt_longer_than_context(target, length):
    with pytest.raises(SettingsError, match=f"prompt has {length} tokens.*context is 16"):
        run(target, AutoregressiveDrafter(), [1] * length, 1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", None])
def test_max_new_tokens_not_positive_int(target, bad):
    with pytest.raises(SettingsError, match="max_new_tokens must be a positive integer"):
        run(target, AutoregressiveDrafter(), [1, 2, 3], bad)


def test_max_new_tokens_beyond_context(target):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    with pytest.raises(SettingsError, match="max_new_tokens=7 does not fit.*leaving 6"):
        run(target, AutoregressiveDrafter(), prompt, 7)
    # exactly the room left is fine, even with a drafter that drafts deep
    drafter = AssistantDrafter(target, AssistantSettings(num_tokens=8), model=target.model)
    assert len(run(target, drafter, prompt, 6, stop_on_eos=False).output_ids) == 6


def test_unknown_method(target):
    with pytest.raises(SettingsError, match="unknown method 'nope'; choose from ar, pld, lookahead, skip, sps"):
        build_drafter("nope", target)


def test_unknown_setting(target):
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) \['depth'\]"):
        build_drafter("pld", target, depth=3)
    with pytest.raises(SettingsError, match="unknown setting"):
        build_drafter("ar", target, num_tokens=3)


@pytest.mark.parametrize("temperature", [-1.0, -1e-6, 101.0])
def test_bad_temperature(temperature):
    with pytest.raises(SettingsError, match=r"temperature must be 0 \(greedy\) or in"):
        Sampling(temperature=temperature)


@pytest.mark.parametrize("num_tokens", [0, 100, -1])
def test_pld_num_tokens_out_of_range(target, num_tokens):
    with pytest.raises(SettingsError, match=rf"num_tokens must be in \[1, 64\], got {num_tokens}"):
        build_drafter("pld", target, num_tokens=num_tokens)


def test_pld_min_ngram_above_max(target):
    with pytest.raises(SettingsError, match=r"min_ngram \(3\) must not exceed max_ngram \(2\)"):
        build_drafter("pld", target, min_ngram=3, max_ngram=2)
    build_drafter("pld", target, min_ngram=2, max_ngram=2)  # equal is fine


@pytest.mark.parametrize("layers", [0, -2])
def test_skip_layers_below_one(target, layers):
    with pytest.raises(SettingsError, match="layers must be in"):
        build_drafter("skip", target, layers=layers)


@pytest.mark.parametrize("layers", [4, 5, 100])
def test_skip_layers_not_below_target_depth(target, layers):
    with pytest.raises(SettingsError, match=rf"skip layers must be in \[1, 3\] for this 4-layer target, got {layers}"):
        build_drafter("skip", target, layers=layers)


def test_skip_num_tokens_out_of_range(target):
    with pytest.raises(SettingsError, match="num_tokens must be in"):
        build_drafter("skip", target, layers=2, num_tokens=0)


def test_sps_without_assistant(target):
    with pytest.raises(SpecvizError, match="trained for a target with .*; or give sps any assistant LM"):
        build_drafter("sps", target)  # the shipped assistant is the embedded target's
    with pytest.raises(SettingsError, match="num_tokens must be in"):
        build_drafter("sps", target, assistant="x", num_tokens=33)


def test_sps_with_smaller_vocab(target, tiny_llama):
    small = tiny_llama(24, seed=1)
    with pytest.raises(SettingsError, match="the assistant has 24 vocabulary rows; the target needs 32"):
        AssistantDrafter(target, AssistantSettings(num_tokens=2), model=small)
    # a larger assistant vocabulary is accepted (extra rows are ignored when drafting)
    AssistantDrafter(target, AssistantSettings(num_tokens=2), model=tiny_llama(40, seed=1))


def test_sps_assistant_that_cannot_load(target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LoadError, match="could not load model '/nonexistent/assistant'"):
        build_drafter("sps", target, assistant="/nonexistent/assistant")


def test_load_target_missing_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(LoadError, match="could not load model '/nonexistent/folder': no such folder"):
        load_target("/nonexistent/folder")
    for path in ("./no/such", "no/such/folder", "~/no-such-model"):  # a path, never asked of the hub
        with pytest.raises(LoadError, match="no such folder"):
            load_target(path)


def test_load_target_folder_without_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LoadError, match="could not load model"):
        load_target(str(tmp_path))


def test_unknown_dtype():
    with pytest.raises(LoadError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")


def test_a_carried_gguf_replaces_the_installed_one(tmp_path, monkeypatch):
    from specviz.core.load import embedded_gguf

    monkeypatch.setenv("SPECVIZ_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(LoadError, match="is not a file"):
        embedded_gguf()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("SPECVIZ_GGUF", str(tmp_path / "model.gguf"))
    assert embedded_gguf() == tmp_path / "model.gguf"
