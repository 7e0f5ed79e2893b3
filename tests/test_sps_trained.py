"""sps with the assistant trained here (``drafters/sps.py``): a small Llama decoder over the target's embeddings
and head rows, trained through the shared pipeline on the target's own greedy answers. Exact against AR in fp32
on tiny targets, a draft cache that follows rollbacks, and clear errors for checkpoints that cannot serve."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import session_checkpoint
from drafters import build_drafter
from drafters.checkpoint import CheckpointError
from drafters.sps import LAYERS, NARROWER, AssistantDrafter, AssistantNet
from specviz.core.engine import run
from specviz.core.verify import Sampling

VOCAB = 64


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(VOCAB, seed=0, num_layers=2)


@pytest.fixture(scope="module")
def checkpoint(target):
    return session_checkpoint(target, "sps")


def test_the_assistant_is_a_small_decoder_reading_the_targets_embeddings(target, checkpoint):
    drafter = build_drafter("sps", target, checkpoint=str(checkpoint))
    assert isinstance(drafter, AssistantDrafter) and isinstance(drafter.net, AssistantNet)
    body = drafter.net.body
    assert len(body.layers) == LAYERS and body.config.intermediate_size == target.config.intermediate_size // NARROWER
    assert drafter.frozen.embedding is target.model.get_input_embeddings()  # shared, not a copy
    card = json.loads((checkpoint / "card.json").read_text())
    assert card["method"] == "sps" and card["features"]["final_norm_output"] is False
    trained = sum(p.numel() for p in drafter.net.parameters())
    assert drafter.num_parameters() == trained + drafter.frozen.head.numel()
    chance = 1 / card["draft_vocab"]["size"]
    assert card["history"][-1]["train"]["acc1"] > 2 * chance  # it learned some of the target's greedy answers


@pytest.mark.parametrize("num_tokens", [1, 3, 6])
def test_greedy_equals_ar_and_drafts_are_accepted(target, checkpoint, ref_greedy, num_tokens):
    drafter = build_drafter("sps", target, checkpoint=str(checkpoint), num_tokens=num_tokens)
    gen, accepted = torch.Generator().manual_seed(num_tokens), 0
    for _ in range(4):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        result = run(target, drafter, prompt, 30, stop_on_eos=False)
        assert result.output_ids == ref_greedy(target.model, prompt, 30)
        accepted += sum(r.accepted for r in result.records)
        assert all(r.accepted <= num_tokens for r in result.records)
    assert accepted > 0  # the assistant drafts the target's tokens, and the engine keeps them


def test_sampled_decodes_are_reproducible_and_keep_the_draft_cache_in_step(target, checkpoint):
    """Rejections crop the assistant's cache: a decode sampled at T = 1 with a seed is the same decode again, and
    a fresh drafter decoding the same seed agrees (its cache held nothing the sequence dropped)."""
    prompt, sampling = [3, 1, 4, 1, 5], Sampling(temperature=1.0, seed=11)
    first = run(target, build_drafter("sps", target, checkpoint=str(checkpoint), num_tokens=4), prompt, 40, sampling,
                stop_on_eos=False)
    shared = build_drafter("sps", target, checkpoint=str(checkpoint), num_tokens=4)
    run(target, shared, [2, 7, 1, 8], 25, Sampling(temperature=1.0, seed=3), stop_on_eos=False)  # another decode
    again = run(target, shared, prompt, 40, sampling, stop_on_eos=False)
    assert again.output_ids == first.output_ids and len(first.output_ids) == 40
    assert any(r.accepted < len(r.tree) for r in first.records)  # rejections happened, so crops ran


def test_checkpoints_that_cannot_serve_say_why(target, checkpoint, tiny_target, tmp_path):
    with pytest.raises(CheckpointError, match="or give sps any assistant LM with the target's tokenizer"):
        build_drafter("sps", target, checkpoint=str(tmp_path / "none"))
    wrong = tmp_path / "eagle2-weights"
    shutil.copytree(checkpoint, wrong)
    card = json.loads((wrong / "card.json").read_text())
    (wrong / "card.json").write_text(json.dumps({**card, "method": "eagle2"}))
    with pytest.raises(CheckpointError, match="eagle2"):
        build_drafter("sps", target, checkpoint=str(wrong))
