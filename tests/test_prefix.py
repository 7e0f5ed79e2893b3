"""Arms that differ only in a term that joins late share their first steps: an arm started from the shared state
ends bit for bit where it ends alone, and only arms with the same early objective share it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_training_data
from drafters import METHODS
from drafters.training.config import TrainConfig
from drafters.training.loop import train
from drafters.training.prefix import branch_step, prefix_folder, prefix_key
from drafters.training.state import Progress, saved_state
from drafters.variants import trained_class

CFG = TrainConfig(epochs=2, batch_tokens=128, lr=3e-3, draft_vocab=32, save_every=100)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(48, seed=5, num_layers=2)


@pytest.fixture(scope="module")
def data(target):
    return tiny_training_data(target, 30, 1, 12, 8)


def weights(folder):
    return load_file(str(folder / "weights.safetensors"))


def test_the_branch_step_is_the_first_with_the_late_term():
    hass = METHODS["hass"][0].loss  # the term joins at 0.8 of the training
    assert branch_step(hass, 10) == 8 and branch_step(hass, 11) == 9  # 8/11 < 0.8 <= 9/11
    assert branch_step(METHODS["eagle2"][0].loss, 10) is None  # no late term
    assert branch_step(None, 10) is None


def test_only_arms_that_differ_in_the_late_term_share_a_prefix(tmp_path):
    def key(name):
        return prefix_key(trained_class(name), "features", CFG)

    shared = {key(n) for n in ("hass", "hass-topk0", "hass-topk1", "hass-topk20", "hass-w0.5", "hass-w2")}
    assert len(shared) == 1
    assert key("hass-beta0.5") not in shared and key("hass-passes2") not in shared  # earlier steps differ
    assert prefix_key(trained_class("hass"), "other-features", CFG) not in shared
    assert prefix_folder(trained_class("eagle2"), "features", CFG, tmp_path) is None


def test_an_arm_started_from_the_shared_prefix_ends_where_it_ends_alone(target, data, tmp_path):
    k1, k5 = trained_class("hass-topk1"), trained_class("hass-topk5")
    alone = train(k1, target, data, data, CFG, {}, tmp_path / "alone", tmp_path / "run-alone")
    prefix = prefix_folder(k5, "features", CFG, tmp_path / "prefixes")
    assert prefix == prefix_folder(k1, "features", CFG, tmp_path / "prefixes")
    first = train(k5, target, data, data, CFG, {}, tmp_path / "k5", tmp_path / "run-k5", prefix=prefix)
    total = first["training"]["steps"]
    branch = branch_step(k1.loss, total)
    assert Progress.load(saved_state(prefix)).step == branch and "started_from" not in first["training"]

    steps = []
    again = train(k1, target, data, data, CFG, {}, tmp_path / "branched", tmp_path / "run-branched",
                  after_step=steps.append, prefix=prefix)
    assert steps == list(range(branch + 1, total + 1))  # only the steps after the branch ran
    assert again["training"]["started_from"] == {"prefix": prefix.name, "step": branch}
    a, b = weights(tmp_path / "alone"), weights(tmp_path / "branched")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["training"]["steps"] == total and len(again["history"]) == len(alone["history"]) == 2
    inherited, own = again["history"][0]["val"], again["history"][1]["val"]
    assert inherited == {k: v for k, v in alone["history"][0]["val"].items() if k.startswith("acc")}
    assert own == alone["history"][1]["val"]  # validated after the branch, as this arm: losses and all
    b5 = weights(tmp_path / "k5")
    assert not all(torch.equal(a[k], b5[k]) for k in a)  # the late term did act: K 1 and K 5 end apart
