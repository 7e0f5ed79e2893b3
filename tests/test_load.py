"""The embedded target's one-time conversion: two first runs at once (two benches on two cores) both load it."""

import threading

import transformers

from specviz.core import load


class SlowTokenizer:
    """Stands in for the GGUF's tokenizer; its save waits until both conversions are saving."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier

    def save_pretrained(self, folder):
        self.barrier.wait(timeout=30)
        (folder / "tokenizer.json").write_text("{}")


def test_two_first_runs_at_once_both_get_the_converted_folder(tmp_path, monkeypatch, tiny_llama):
    barrier = threading.Barrier(2)
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "embedded_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_llama())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SlowTokenizer(barrier))
    folders, errors = [], []

    def convert():
        try:
            folders.append(load.embedded_folder())
        except Exception as e:  # the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert folders == [tmp_path / "smollm2-135m-instruct"] * 2
    assert load.converted(folders[0]) and (folders[0] / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no temporary folder left
    monkeypatch.undo()
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[0])
    assert model.config.num_hidden_layers == tiny_llama().config.num_hidden_layers


def test_load_target_prepares_the_model_it_built_and_only_that(tiny_llama, monkeypatch):
    """``load_target`` prepares its own model (fp32 head, packed kernels); ``prepare`` changes only the model it
    is given, so a caller keeps an untouched original by preparing a copy."""
    import copy

    import torch

    from specviz.core.packing import pack, packed_count

    model = tiny_llama(seed=3).to(torch.bfloat16)
    original = copy.deepcopy(model)
    monkeypatch.setattr(load, "load_causal_lm", lambda spec, dtype, device: (model, None))
    target = load.load_target("tiny", "bfloat16", "cpu", pack=True)
    assert target.model is model and target.dtype == torch.bfloat16 and target.name == "tiny"
    assert model.lm_head.weight.dtype == torch.float32 and not model.config.tie_word_embeddings
    can_pack = pack(torch.ones(2, 2)) is not None  # the fp32 head at least, where this build packs
    assert (target.packed_linears > 0) == can_pack and target.packed_linears == packed_count(model)
    kept = copy.deepcopy(original)
    prepared = load.prepare(copy.deepcopy(original))
    assert prepared.lm_head.weight.dtype == torch.float32 and packed_count(prepared) == 0  # pack only when asked
    assert original.lm_head.weight.dtype == torch.bfloat16 and original.config.tie_word_embeddings
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), kept.state_dict().values()))
