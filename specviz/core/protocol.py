"""The drafter protocol: every method proposes a DraftTree and learns what the target kept.

A drafter object holds what every decode shares (its network, its settings); what one decode learns
lives in a state the drafter makes for it, as the target's KV cache does (``target.new_cache()``):

    state = drafter.start()               once per decode (a drafter with nothing to remember: None)
    drafter.observe(state, Commit)        after the prefill and after every step
    drafter.propose(state, DraftRequest)  before every verify

so one drafter object serves any number of decodes, interleaved step by step. A drafter keeps nothing
of one decode on itself. Settings are small dataclasses with ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from .errors import SettingsError
from .tree import DraftTree
from .verify import Sampling


@dataclass
class Commit:
    """What just entered the target's cache, and the token waiting to go in next."""

    tokens: torch.Tensor  # [T] the prompt after prefill; root + accepted drafts after a step
    features: torch.Tensor  # [T, H] the target's final-norm output there, then any tapped layers (core.target)
    pending: int  # the target's newest token, the root of the next draft tree
    # [N+1] the target's top token after every verified node, root first; only for a drafter that sets
    # ``reads_verified_top`` (an argmax over the vocabulary and a host copy per step: not for the rest)
    verified_top: torch.Tensor | None = None
    drafted: DraftTree | None = None  # the step's draft tree as the host read it (None at the prefill)


@dataclass
class DraftRequest:
    tokens: list[int]  # the whole sequence so far: prompt + output, ending with the pending root
    max_depth: int  # tokens beyond this depth can never be used (the run ends first)
    sampling: Sampling
    generator: torch.Generator | None = None


class Drafter:
    """Base class. Subclasses set ``name`` and implement ``propose``; ``start`` and ``observe`` are optional
    (a drafter that reads only the request, such as prompt lookup, needs neither)."""

    name = "base"
    title = ""  # one line for listings and the UI
    trained = False  # ships a checkpoint
    reads_verified_top = False  # its observe() reads Commit.verified_top

    def start(self) -> object:
        """A fresh state for one decode: what ``observe`` learns and ``propose`` reads (caches, queues)."""
        return None

    def observe(self, state, commit: Commit) -> None:
        """Learn, into ``state``, what the target committed (tokens and features) and its pending token."""

    def propose(self, state, request: DraftRequest) -> DraftTree:
        raise NotImplementedError

    def propose_batch(self, states: list, requests: list[DraftRequest]) -> list[DraftTree]:
        """Drafts for several decodes at once (a batch's lanes), each what ``propose`` would draft for its state
        and request (up to floating point where a network runs the lanes together). The default drafts them in
        turn; a method whose network can run every lane in one call overrides it."""
        return [self.propose(state, request) if request.max_depth > 0 else DraftTree.empty()
                for state, request in zip(states, requests)]

    def num_parameters(self) -> int:
        """Parameters this method adds on top of the target (for 'extra memory %')."""
        return 0

    def capture_forwards(self, target) -> str:
        """Compile this drafter's own forwards, as a compiled ``target``'s are (``core.capture``), before any decode
        is timed; called where the target runs compiled. Returns what ran: "compiled", "eager" (nothing to compile)
        or the reason compilation failed."""
        return "eager"


def lanes_by_depth(states: list, requests: list[DraftRequest], most: int, ready) -> dict[int, list[int]]:
    """The lanes of a batch grouped by how deep each may draft (``most``, or less near its token limit), without
    those that may draft nothing or whose state is not ``ready``: what a ``propose_batch`` runs together."""
    groups: dict[int, list[int]] = {}
    for i, (state, request) in enumerate(zip(states, requests)):
        depth = min(most, request.max_depth)
        if depth >= 1 and ready(state):
            groups.setdefault(depth, []).append(i)
    return groups


def check_range(name: str, value, low, high) -> None:
    if not (low <= value <= high):
        raise SettingsError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class BudgetGrid:
    """The draft budgets a method can take, for ``core.budget``: every (depth, size) on the grid, with
    ``fixed`` settings held. ``size_key`` None: the size follows the depth (a chain, or beams).
    ``nested`` False: a smaller budget does not draft a subset of a larger one's nodes (lookahead's pool
    grows from what its window drafted), so the tuner warms up every budget of the grid on its own."""

    depth_key: str
    size_key: str | None = None
    fixed: tuple[tuple[str, object], ...] = ()
    depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    nested: bool = True

    def settings(self, depth: int, size: int | None = None) -> dict:
        values = {**dict(self.fixed), self.depth_key: depth}
        if self.size_key is not None:
            values[self.size_key] = max(self.sizes) if size is None else size
        return values

    @property
    def keys(self) -> set[str]:
        return {self.depth_key, *([self.size_key] if self.size_key else []), *dict(self.fixed)}

    def candidates(self) -> list[tuple[dict, int, int]]:
        """(settings, depth, size) for every budget; a tree smaller than its depth could not reach it."""
        if self.size_key is None:
            return [(self.settings(d), d, 1 << 30) for d in self.depths]
        return [(self.settings(d, n), d, n) for d in self.depths for n in self.sizes if n >= d or not self.nested]


@dataclass
class Settings:
    """Base for per-drafter settings: ``ranges`` maps a field to its inclusive (low, high);
    ``PAPER`` holds the setting the method's paper uses, where it differs from the default;
    ``budget_grids`` the budgets the tuner may choose from (none: nothing to tune)."""

    ranges: ClassVar[dict[str, tuple]] = {}
    PAPER: ClassVar[dict] = {}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return []

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in self.ranges:
                check_range(f.name, getattr(self, f.name), *self.ranges[f.name])

    @classmethod
    def build(cls, **given):
        known = {f.name for f in fields(cls)}
        unknown = set(given) - known
        if unknown:
            raise SettingsError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**given)

    @classmethod
    def limits(cls, target) -> dict[str, tuple]:
        """The ranges that make sense for ``target`` (a method narrows them where the target bounds them)."""
        return dict(cls.ranges)

    @classmethod
    def defaults(cls, target) -> dict:
        """Every field's starting value for ``target``: the dataclass default, kept within ``limits``."""
        values = {f.name: f.default for f in fields(cls)}
        for name, (low, high) in cls.limits(target).items():
            if isinstance(values.get(name), (int, float)):
                values[name] = min(max(values[name], low), high)
        return values
