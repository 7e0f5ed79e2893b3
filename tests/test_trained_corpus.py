"""Trained feature drafters' training corpus: the ShareGPT reader, its validation split, and reused sequences."""

from __future__ import annotations

import json

import pytest
import torch
from trained_helpers import VOCAB

from drafters.training import dataset, sharegpt
from drafters.training import sequences as sequence_data
from specviz.core.target import TargetModel


@pytest.fixture(scope="module")
def target(tiny_target) -> TargetModel:
    return tiny_target(VOCAB, seed=0, num_layers=2)


# -- the training corpus ---------------------------------------------------------------------------

def conversation(i: int, first: str = "human", second: str = "gpt") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"question {i}"},
                                              {"from": second, "value": f"answer {i}"}]}


def test_read_sharegpt_stops_at_the_cut(tmp_path):
    items = [conversation(0), conversation(1)]
    text = json.dumps(items + [conversation(2)], indent=1)
    cut = text.index("question 2") + 4  # inside the third item
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut], encoding="utf-8")
    assert list(sharegpt.read_sharegpt(path)) == items
    path.write_text(json.dumps(items), encoding="utf-8")  # a complete file reads whole too
    assert list(sharegpt.read_sharegpt(path)) == items


def test_first_turns_skips_conversations_not_opened_by_a_human(tmp_path, monkeypatch):
    items = [conversation(0), conversation(1, first="system"), conversation(2), conversation(3, first="gpt"),
             conversation(4, second="human"), conversation(0)]  # the last repeats a prompt
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: path)
    got = list(sharegpt.first_turns())
    assert [(e.id, e.prompt, e.answer) for e in got] == [("c0", "question 0", "answer 0"),
                                                          ("c2", "question 2", "answer 2")]
    assert [e.id for e in sharegpt.first_turns(limit=1)] == ["c0"]


def test_continuation_chunks_give_their_first_human_turn(tmp_path, monkeypatch):
    chunk = {"id": "c7", "conversations": [{"from": "gpt", "value": "earlier reply"},
                                           {"from": "human", "value": "follow-up"}, {"from": "gpt", "value": "ok"}]}
    long_prompt = {"id": "c8", "conversations": [{"from": "human", "value": "x" * 2000}, {"from": "gpt", "value": "y"}]}
    items = [conversation(0), chunk, conversation(3, first="gpt"), long_prompt, conversation(0)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: path)
    got = [(e.id, e.prompt, e.answer) for e in sharegpt.first_turns(max_chars=None, continuations=True)]
    assert got == [("c0", "question 0", "answer 0"), ("c7", "follow-up", "ok"), ("c8", "x" * 2000, "y")]
    assert [e.id for e in sharegpt.first_turns()] == ["c0"]  # the default keeps the human-opened, short ones


def test_validation_split_is_stable_and_sized():
    ids = [f"conv-{i}" for i in range(2000)]
    split = [sharegpt.is_validation(i, 0.1) for i in ids]
    assert split == [sharegpt.is_validation(i, 0.1) for i in ids]
    assert 140 <= sum(split) <= 260
    # a larger fraction only adds ids, so the held-out slice never loses any
    wider = [sharegpt.is_validation(i, 0.3) for i in ids]
    assert all(w for s, w in zip(split, wider) if s) and 500 <= sum(wider) <= 700
    assert not any(sharegpt.is_validation(i, 0.0) for i in ids)



def test_sharegpt_file_that_is_not_a_list(tmp_path):
    from drafters.training.sharegpt import DataError, read_sharegpt

    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(DataError, match="not a JSON list"):
        list(read_sharegpt(path))


RECIPE = sequence_data.DataRecipe(8, max_new_tokens=6, val_fraction=0.2, batch_size=4)


def test_prepare_reuses_saved_sequences(target, tmp_path, monkeypatch):
    """The slow self-distillation runs once: its token file (cache or shipped) rebuilds identical features."""
    items = [conversation(i) for i in range(12)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: path)
    monkeypatch.setattr(target.text, "encode_chat", lambda text: [3 + int(text.split()[-1]) % 50, 1, 2], raising=False)
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    first, first_val, meta = dataset.prepare(target, RECIPE,
                                            cache=cache, shipped=shipped)
    assert len(first) == 8 and len(first_val) >= 1 and meta["train_samples"] == 8
    (sequences,) = cache.glob("sequences-*.safetensors")
    for features in cache.glob("train-*"):
        features.unlink()  # the feature cache is gone (a new machine) ...
    shipped.mkdir()
    sequences.rename(shipped / sequences.name)  # ... but the project ships the sequences

    def no_distilling(*args, **kwargs):
        raise AssertionError("self-distilled again")

    monkeypatch.setattr(sequence_data, "self_distill", no_distilling)
    again, again_val, meta_again = dataset.prepare(target, RECIPE,
                                                  cache=cache, shipped=shipped)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.answer_starts, first.answer_starts)
    assert torch.equal(again.features, first.features) and torch.equal(again_val.tokens, first_val.tokens)
    assert meta_again["answer_tokens"] == meta["answer_tokens"]
    for features in cache.glob("*-*.safetensors"):
        features.unlink()
    alone, alone_val, meta_alone = dataset.prepare(target, RECIPE, cache=cache, shipped=shipped, features=False)
    assert torch.equal(alone.tokens, first.tokens) and torch.equal(alone.offsets, first.offsets)
    assert alone.features.shape == (first.num_tokens, 0) and alone_val.features.shape[1] == 0
    assert meta_alone["features_on_the_fly"] and meta_alone["answer_tokens"] == meta["answer_tokens"]
    assert not list(cache.glob("train-*")) and not list(cache.glob("features-*"))  # nothing extracted or cached
    (shipped / sequences.name).write_bytes(b"not safetensors")
    for features in cache.glob("*-*.safetensors"):
        features.unlink()
    with pytest.raises(sharegpt.DataError, match="unreadable"):
        dataset.prepare(target, RECIPE, cache=cache, shipped=shipped)
