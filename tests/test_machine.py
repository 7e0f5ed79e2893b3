"""Machine identity: the fingerprint leaves the thread count out, the tuner's key tells targets and dtypes apart."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llama
from specviz.apps import machine
from specviz.core.load import prepare
from specviz.core.target import TargetModel


def test_the_fingerprint_ignores_threads_and_the_description_names_them(monkeypatch):
    if torch.cuda.is_available():  # a GPU is named by its device alone
        assert machine.machine_fingerprint() == machine.machine_description() == torch.cuda.get_device_name()
        return
    threads = torch.get_num_threads()
    fingerprint = machine.machine_fingerprint()
    try:
        torch.set_num_threads(1)
        assert machine.machine_fingerprint() == fingerprint  # a pinned part and the full run: one machine
        assert machine.machine_description().endswith("1 threads")
    finally:
        torch.set_num_threads(threads)
    assert f"{torch.backends.cpu.get_cpu_capability()}" in fingerprint and "cores" in fingerprint


def test_the_tuners_key_tells_targets_dtypes_and_machines_apart(tiny_target, monkeypatch):
    target = tiny_target(vocab_size=32, seed=0)
    key = machine.machine_key(target)
    assert len(key) == 12 and machine.machine_key(target) == key  # stable
    other = tiny_target(vocab_size=32, seed=0)
    other.name = "another-target"
    assert machine.machine_key(other) != key
    half = TargetModel(make_llama(vocab_size=32, seed=0).to(torch.bfloat16))
    assert machine.machine_key(half) != key
    grouped = TargetModel(prepare(make_llama(vocab_size=32, seed=0)))  # its verifies cost otherwise
    assert grouped.config._attn_implementation != "sdpa" and machine.machine_key(grouped) != key
    monkeypatch.setattr(machine, "machine_description", lambda: "another machine")
    assert machine.machine_key(target) != key


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine is named by its device alone")
def test_the_bf16_units_are_named_where_the_cpu_has_them(monkeypatch):
    """bf16 speed turns on AMX or AVX-512 BF16, which torch's capability ("AVX512") does not tell apart."""
    for flags, named, unnamed in (({"avx2", "amx_bf16", "avx512_bf16"}, "AMX", "BF16"),
                                  ({"avx2", "avx512_bf16"}, "AVX-512 BF16", "AMX"), ({"avx2"}, None, "AMX")):
        monkeypatch.setattr(machine, "cpu_flags", lambda flags=flags: flags)
        fingerprint, description = machine.machine_fingerprint(), machine.machine_description()
        for text in (fingerprint, description):
            assert (named is None or f", {named})" in text) and unnamed not in text, text
