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
