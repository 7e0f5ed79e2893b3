"""Lookahead decoding: Jacobi iterations and an n-gram pool, no drafter to train (Fu et al., 2024).

Every step's draft tree has two branches, checked in the same forward. The *lookahead branch* holds
``ngram - 1`` levels of a ``window``-wide Jacobi guess: level 0 is a chain of guesses for the next
``window`` positions, and each later level hangs one token under each level-0 token (column j,
level l sits at depth j + 1 + l and sees level 0 up to column j and its own column below it, which
is exactly a tree). The target's own next token after the last level becomes the next level, and each
column's tokens top to bottom, plus that new token, form an n-gram for the *pool*. The *verification
branch* holds up to ``guesses`` pooled n-grams that start with the root, merged where they share a
prefix. Both branches are ordinary draft nodes: whatever the target's rule accepts is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from specviz.core.protocol import BudgetGrid, Commit, Drafter, DraftRequest, Settings
from specviz.core.tree import DraftTree


@dataclass
class LookaheadSettings(Settings):
    window: int = 4  # W: future positions guessed in parallel
    ngram: int = 3  # N: n-gram size (N - 1 lookahead levels)
    guesses: int = 4  # G: pooled n-grams verified per step
    ranges = {"window": (1, 32), "ngram": (2, 8), "guesses": (0, 64)}

    PAPER = {"window": 15, "ngram": 5, "guesses": 15}  # the paper's setting for 7B models on one GPU

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        """Window x n-gram x guesses, each warmed up on its own (the pool depends on all three)."""
        return [BudgetGrid("ngram", "guesses", (("window", w),), depths=(3, 4), sizes=(2, 8), nested=False)
                for w in (2, 8)]  # 8 budgets: each costs a warm-up at the app's first start


@dataclass
class LookaheadState:
    """One decode's Jacobi levels and n-gram pool."""

    levels: list[list[int]] = field(default_factory=list)  # levels[l][j]: the Jacobi guess at column j, level l
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # first token -> next n - 1, newest last
    last_level: list[int] = field(default_factory=list)  # verify-input indices of the deepest level's nodes
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class LookaheadDrafter(Drafter):
    name = "lookahead"
    title = "Lookahead decoding: Jacobi iterations + n-gram pool (training-free)"
    reads_verified_top = True  # the Jacobi columns advance by the target's own top tokens

    def __init__(self, target=None, settings: LookaheadSettings | None = None):
        self.settings = settings or LookaheadSettings()
        self.max_length = getattr(target, "max_length", 1 << 30)

    def start(self) -> LookaheadState:
        return LookaheadState()

    def observe(self, state: LookaheadState, commit: Commit) -> None:
        if commit.verified_top is None:  # the prefill: start level 0 from tokens of the prompt
            prompt = commit.tokens.tolist()
            state.levels = [[state.rng.choice(prompt) for _ in range(self.settings.window)]]
            return
        if not state.last_level:  # no tree was drafted this step (the run's last token)
            return
        new = commit.verified_top[state.last_level].tolist()  # the target's next token after each column
        state.last_level, deepest = [], state.levels[-1]
        if len(state.levels) == self.settings.ngram - 1:
            for j in range(len(new)):
                self._remember(state, tuple(level[j] for level in state.levels) + (new[j],))
            state.levels = state.levels[1:]
        state.levels.append(new + deepest[len(new):])  # columns cut near the context's end keep their guess

    def _remember(self, state: LookaheadState, gram: tuple[int, ...]) -> None:
        grams = state.pool.setdefault(gram[0], [])
        if gram[1:] in grams:
            grams.remove(gram[1:])
        grams.append(gram[1:])
        del grams[: -max(self.settings.guesses, 1) * 4]  # keep the newest few per first token

    def propose(self, state: LookaheadState, request: DraftRequest) -> DraftTree:
        root, room = request.tokens[-1], min(request.max_depth, self.max_length - len(request.tokens))
        tokens, parents = [], []
        # verification branch: pooled n-grams after the root, merged into a trie (parents first)
        trie: dict[tuple[int, ...], int] = {}
        guesses = list(reversed(state.pool.get(root, [])))[: self.settings.guesses]
        for gram in guesses:
            for d in range(1, min(len(gram), room) + 1):
                if gram[:d] not in trie:
                    tokens.append(gram[d - 1])
                    parents.append(trie.get(gram[: d - 1], 0))
                    trie[gram[:d]] = len(tokens)
        candidates = len(tokens)
        # lookahead branch: level 0 a chain off the root, each later level one node under each column
        width = min(self.settings.window, max(room - len(state.levels) + 1, 0))
        column: list[int] = []
        for j in range(width):
            tokens.append(state.levels[0][j])
            parents.append(column[-1] if column else 0)
            column.append(len(tokens))
        for level in state.levels[1:]:
            for j in range(width):
                tokens.append(level[j])
                parents.append(column[j])
                column[j] = len(tokens)
        state.last_level = column
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        tree.info.update(candidates=candidates, lookahead=len(tokens) - candidates,
                         levels=len(state.levels), window=width)
        return tree
