"""Helpers shared by the trained feature drafters' test files (test_trained*.py): sizes, loading, prompts."""

from __future__ import annotations

import random

import pytest
import torch

from drafters import build_drafter
from specviz.core.protocol import Drafter
from specviz.core.tree import additive_mask

VOCAB, HIDDEN = 64, 64
METHODS = ("eagle2", "hass", "fspad", "eagle3")


def load(target, checkpoints, method: str, **settings):
    return build_drafter(method, target, checkpoint=str(checkpoints[method]), **settings)


def causal(t: int) -> torch.Tensor:
    return additive_mask(torch.ones(t, t, dtype=torch.bool).tril())


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))] for _ in range(n)]


class Twin(Drafter):
    """Drives two drafters on the same history; the first one's trees go to the engine."""

    name = "twin"

    def __init__(self, main, other):
        self.main, self.other, self.log = main, other, []

    def start(self):
        return self.main.start(), self.other.start()

    def observe(self, state, commit):
        self.main.observe(state[0], commit)
        self.other.observe(state[1], commit)

    def propose(self, state, request):
        tree = self.main.propose(state[0], request)
        self.log.append((request.max_depth, tree, self.other.propose(state[1], request)))
        return tree


def checkpoint_fixtures(vocab: int, methods, **train):
    """A test module's ``target`` (a tiny random Llama) and ``checkpoints`` (one tiny checkpoint per method,
    trained through the real pipeline once per test run) fixtures: ``target, checkpoints = ...``."""

    @pytest.fixture(scope="module")
    def target(tiny_target):
        return tiny_target(vocab, seed=0, num_layers=2)

    @pytest.fixture(scope="module")
    def checkpoints(target, tiny_checkpoint) -> dict:
        return {m: tiny_checkpoint(target, m, **train) for m in methods}

    return target, checkpoints
