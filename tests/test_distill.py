"""Self-distillation at scale: the lean batched loop is greedy decoding, and a killed sharded run
resumes to exactly what an unbroken run writes."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import make_llama, reference_greedy
from drafters.training import features, sequences, sharegpt
from drafters.training.distill import (
    GROUPED,
    ShardedDistill,
    distill_model,
    greedy_answers,
    grouped_attention,
    prompt_batches,
)
from drafters.training.shards import Shards
from specviz.core.files import content_key

EOS = 5


@pytest.fixture(scope="module")
def model():
    return make_llama(40, seed=3, eos=EOS)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 40) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def test_batched_loop_is_greedy_decoding_cut_at_eos(model):
    prompts = random_prompts(12, seed=0)
    answers = greedy_answers(model, prompts, 20, {EOS})
    ended = 0
    for prompt, answer in zip(prompts, answers):
        expected = reference_greedy(model, prompt, 20)
        if EOS in expected:
            expected, ended = expected[: expected.index(EOS) + 1], ended + 1
        assert answer == expected
    assert 0 < ended < len(prompts)  # rows left the batch early and others went on


def test_prompt_batches_cover_every_prompt_once():
    prompts = random_prompts(23, seed=1)
    batches = prompt_batches(prompts, 5)
    assert sorted(i for b in batches for i in b) == list(range(23)) and max(map(len, batches)) == 5
    lengths = [len(prompts[i]) for b in batches for i in b]
    assert lengths == sorted(lengths, reverse=True)


class Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_unbroken_result(model, tmp_path):
    prompts = random_prompts(30, seed=2)
    whole = ShardedDistill(tmp_path / "a", prompts, 12, batch_size=4, shard_size=8).run(model, {EOS}, progress=False)

    def kill_after_second(i: int) -> None:
        if i == 1:
            raise Killed

    broken = ShardedDistill(tmp_path / "b", prompts, 12, batch_size=4, shard_size=8)
    with pytest.raises(Killed):
        broken.run(model, {EOS}, progress=False, after_shard=kill_after_second)
    assert broken.finished() == [0, 1] and not list(broken.folder.glob("*.partial"))
    calls = []
    resumed = ShardedDistill(tmp_path / "b", prompts, 12, batch_size=4, shard_size=8)
    assert resumed.run(model, {EOS}, progress=False, after_shard=calls.append) == whole
    assert calls == [2, 3]  # only the missing shards ran
    assert len(whole) == 30 and all(1 <= len(a) <= 12 for a in whole)


def test_another_recipe_gets_its_own_folder(tmp_path):
    prompts = random_prompts(4, seed=3)
    a = ShardedDistill(tmp_path, prompts, 12)
    assert ShardedDistill(tmp_path, prompts, 13).folder != a.folder
    assert ShardedDistill(tmp_path, prompts[:3], 12).folder != a.folder
    assert ShardedDistill(tmp_path, prompts, 12).folder == a.folder


@pytest.mark.parametrize("queries", [1, 5], ids=["decode", "prefill"])
def test_grouped_attention_equals_transformers_eager_attention(queries):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 6, queries, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g),
                         torch.randn(2, 2, 7, 8, generator=g))
    blocked = torch.rand(2, 1, queries, 7, generator=g) < 0.3
    blocked[..., -1] = False  # every query sees at least one key
    mask = torch.zeros(2, 1, queries, 7).masked_fill(blocked, torch.finfo(torch.float).min)
    module = SimpleNamespace(num_key_value_groups=3, training=False)
    expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.35)
    got, _ = grouped_attention(module, query, key, value, mask, scaling=0.35)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_distill_model_writes_the_targets_greedy_answers(tiny_target):
    target = tiny_target(40, seed=3, eos=EOS)
    prompts = random_prompts(10, seed=4)
    answers = greedy_answers(distill_model(target), prompts, 16, {EOS})
    for prompt, answer in zip(prompts, answers):
        expected = reference_greedy(target.model, prompt, 16)
        assert answer == (expected[: expected.index(EOS) + 1] if EOS in expected else expected)
    assert target.model.config._attn_implementation != GROUPED  # the target itself is left as it was


def test_sharded_features_resume_to_the_unbroken_set(tiny_target, tmp_path, monkeypatch):
    target = tiny_target(40, seed=3, eos=EOS)
    seqs = [(torch.tensor(p + [7, 8, 9]), len(p)) for p in random_prompts(11, seed=5)]
    whole = features.extract_features(target, seqs, batch_tokens=32, work=tmp_path / "whole", shard_size=4)
    unsharded = features.extract_features(target, seqs, batch_tokens=32)
    torch.testing.assert_close(whole.features.float(), unsharded.features.float(), atol=2e-3, rtol=2e-3)
    real, calls = features._features, []

    def dies_on_the_third_shard(*args):
        calls.append(1)
        if len(calls) == 3:
            raise Killed
        return real(*args)

    monkeypatch.setattr(features, "_features", dies_on_the_third_shard)
    with pytest.raises(Killed):
        features.extract_features(target, seqs, batch_tokens=32, work=tmp_path / "killed", shard_size=4)
    monkeypatch.setattr(features, "_features", real)
    assert len(list((tmp_path / "killed").glob("shard-*.safetensors"))) == 2
    resumed = features.extract_features(target, seqs, batch_tokens=32, work=tmp_path / "killed", shard_size=4)
    for name, value in whole.tensors().items():
        assert torch.equal(resumed.tensors()[name], value), name
    assert resumed.sequence(10)[0].tolist() == seqs[10][0].tolist()


def test_a_kill_while_saving_features_leaves_no_file_that_loads(tiny_target, tmp_path, monkeypatch):
    """`prepare` trusts a features file that exists: a killed save must leave none (and the next save works)."""
    target = tiny_target(40, seed=3, eos=EOS)
    made = features.extract_features(target, [(torch.tensor(p + [7, 8]), len(p)) for p in random_prompts(5, 6)])
    real = Path.write_bytes

    def dies_halfway(path, data):
        real(path, data[: len(data) // 2])
        raise Killed

    monkeypatch.setattr(Path, "write_bytes", dies_halfway)
    with pytest.raises(Killed):
        made.save(tmp_path / "train-key.safetensors", {})
    assert not (tmp_path / "train-key.safetensors").exists()
    monkeypatch.setattr(Path, "write_bytes", real)
    made.save(tmp_path / "train-key.safetensors", {"a": 1})
    assert torch.equal(features.FeatureSet.load(tmp_path / "train-key.safetensors").tokens, made.tokens)


def test_features_in_bf16_come_from_a_bf16_copy_and_stay_close(tiny_target):
    target = tiny_target(40, seed=3, eos=EOS)
    seqs = [(torch.tensor(p + [7, 8, 9]), len(p)) for p in random_prompts(6, seed=6)]
    exact = features.extract_features(target, seqs, batch_tokens=32)
    fast = features.extract_features(target, seqs, batch_tokens=32, dtype=torch.bfloat16)
    assert target.dtype == torch.float32  # the target itself is left in fp32
    assert not torch.equal(fast.features, exact.features)  # really computed in bf16
    torch.testing.assert_close(fast.features.float(), exact.features.float(), atol=0.1, rtol=0.05)
    recipe = sequences.DataRecipe(samples=4, feature_dtype=torch.bfloat16)
    assert recipe.features_key(target) == recipe.key(target) + "-bfloat16"  # same sequences, own features
    assert sequences.DataRecipe(samples=4).features_key(target) == recipe.key(target)


def test_shipped_sequences_load_and_match_their_checkpoints_cards():
    """Every shipped checkpoint names its data; the compressed token file for that data ships and holds
    exactly the counts its card records."""
    import hashlib
    import json

    not_in_key = ("train_samples", "train_tokens", "answer_tokens", "val_samples", "feature_dtype",
                  "features_on_the_fly")  # DataRecipe.key
    shipped = Path(sequences.SHIPPED_SEQUENCES).parent / "drafters"
    cards = [json.loads(p.read_text()) for p in shipped.glob("*/card.json")]
    assert len(cards) == len([d for d in shipped.iterdir() if d.is_dir()]) >= 7
    for card in cards:
        recipe = {k: v for k, v in card["data"].items() if k not in not_in_key}
        key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
        path = sequences.SHIPPED_SEQUENCES / f"sequences-{key}.safetensors.xz"
        splits = sequences.load_sequences(path)
        assert sequences.sequences_meta(path)["samples"] == recipe["samples"]
        train = splits["train"]
        assert len(train) == card["data"]["train_samples"] and len(splits["val"]) == card["data"]["val_samples"]
        assert sum(s.numel() for s, _ in train) == card["data"]["train_tokens"]
        assert sum(s.numel() - a for s, a in train) == card["data"]["answer_tokens"]


def test_sequences_round_trip_compressed(tmp_path):
    splits = {"train": [(torch.tensor([1, 60000, 3]), 1), (torch.tensor([5, 6]), 2)], "val": [(torch.tensor([7]), 0)]}
    for name in ("plain.safetensors", "packed.safetensors.xz"):
        sequences.save_sequences(tmp_path / name, splits, {"samples": 2})
        again = sequences.load_sequences(tmp_path / name)
        assert {k: [(s.tolist(), a) for s, a in v] for k, v in again.items()} == \
            {k: [(s.tolist(), a) for s, a in v] for k, v in splits.items()}
        assert sequences.sequences_meta(tmp_path / name) == {"samples": 2}
    (tmp_path / "bad.safetensors.xz").write_bytes(b"not xz")
    with pytest.raises(sequences.DataError, match="unreadable"):
        sequences.load_sequences(tmp_path / "bad.safetensors.xz")


def test_shards_split_items_and_save_whole_files(tmp_path):
    shards = Shards(tmp_path / "job", count=10, size=4)
    assert shards.num == 3 and [list(shards.items(i)) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert shards.missing() == [0, 1, 2] and shards.finished() == []
    shards.save(1, {"x": torch.arange(3)}, {"note": "one"})
    assert shards.missing() == [0, 2] and torch.equal(shards.load(1)["x"], torch.arange(3))
    assert not list((tmp_path / "job").glob("*.partial"))
    assert content_key({"a": 1, "b": [2]}) == content_key({"b": [2], "a": 1}) != content_key({"a": 2, "b": [2]})


def test_the_recipe_keys_name_the_shipped_sequences_and_old_distill_folders(tmp_path):
    """``content_key`` replaced hand-written ``sha1(json)[:12]`` keys: the names of shipped files and of
    work folders already on disk must not change."""
    import hashlib
    import json

    for card_path in (sequences.SHIPPED_SEQUENCES.parent / "drafters").glob("*/card.json"):
        data = json.loads(card_path.read_text())["data"]
        recipe = sequences.DataRecipe(None if data["samples"] == "all" else data["samples"], data["self_distilled"],
                                      data["max_prompt_tokens"], data["max_new_tokens"], data["val_fraction"],
                                      prompts=data.get("prompts", "first"),
                                      distill_dtype=getattr(torch, data.get("distill_dtype", "float32")))
        key = recipe.key(SimpleNamespace(name=data["target"]))
        assert (sequences.SHIPPED_SEQUENCES / f"sequences-{key}.safetensors.xz").exists(), card_path
    prompts = random_prompts(5, seed=7)
    job = ShardedDistill(tmp_path, prompts, 12, batch_size=4, shard_size=8, label="embedded torch.bfloat16")
    old = {"prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest(), "max_new_tokens": 12, "batch_size": 4,
           "shard_size": 8, "label": "embedded torch.bfloat16"}
    assert job.folder.name == "distill-" + hashlib.sha1(json.dumps(old, sort_keys=True).encode()).hexdigest()[:12]
    ids = [f"conv-{i}" for i in range(50)]
    old_split = [int(hashlib.sha1(i.encode()).hexdigest()[:8], 16) / 0x100000000 < 0.3 for i in ids]
    assert [sharegpt.is_validation(i, 0.3) for i in ids] == old_split and any(old_split)


def test_importing_self_distillation_registers_no_attention_function():
    """The grouped attention joins transformers' global registries when a distill model is built, not on import."""
    import subprocess
    import sys

    code = ("from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks\n"
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions\n"
            "import drafters, drafters.training.distill as distill, drafters.training.loop, drafters.training.dataset\n"
            "print(distill.GROUPED in functions, distill.GROUPED in masks)\n"
            "distill.register_grouped_attention()\n"
            "print(distill.GROUPED in functions, distill.GROUPED in masks)\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"]
