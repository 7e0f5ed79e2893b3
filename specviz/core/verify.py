"""Acceptance rules: which drafted path the target keeps, and the token it adds (the bonus).

- ``greedy``: follow the target's argmax through the tree (lossless for greedy decoding).
- ``rejection``: recursive rejection sampling over each node's children (lossless for sampling).
  A node's children are treated as drawn one after another without replacement from its
  ``child_dists`` row, or as fixed choices when the tree has none (SpecInfer / EAGLE style).
  A chain with one sampled child per node is exactly Leviathan et al. / Chen et al.
- ``typical``: Medusa's typical acceptance. **Lossy**: the output distribution is not the target's.

Random draws happen on the CPU with the run's CPU generator (the rows they need are copied there), so a
seed gives the same draws whatever device the target runs on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .errors import SettingsError
from .tree import DraftTree

RULES = ("greedy", "rejection", "typical")
MIN_TEMPERATURE = 1e-3  # below it, logits / T overflow: use 0 (greedy)
LOSSY_RULES = {"typical"}


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    rule: str = "auto"  # auto = greedy at T=0, rejection otherwise
    typical_epsilon: float = 0.3  # typical acceptance: p(x) > min(epsilon, delta * exp(-H))
    typical_delta: float = 0.09
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            raise SettingsError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SettingsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.rule not in RULES + ("auto",):
            raise SettingsError(f"unknown acceptance rule {self.rule!r}; choose from {', '.join(RULES)}")
        if self.rule == "greedy" and self.temperature > 0:
            raise SettingsError(f"the greedy rule takes the argmax and would ignore temperature {self.temperature}; "
                                "use temperature 0, or the rejection (lossless) or typical (lossy) rule")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def resolved_rule(self) -> str:
        if self.rule == "auto":
            return "greedy" if self.greedy else "rejection"
        return self.rule

    @property
    def lossless(self) -> bool:
        return self.resolved_rule not in LOSSY_RULES


def top_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim: the first index of the largest value, as ``argmax``'s. Read from ``max``,
    whose CPU kernel is vectorized where ``argmax``'s is not (several times faster on a vocabulary)."""
    return logits.max(-1).indices


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Softmax with temperature and nucleus (top-p) filtering, over the last dim, in fp32."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(top_ids(logits), logits.shape[-1]).float()
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if s.top_p < 1.0:
        probs = nucleus(probs, s.top_p)
    return probs


NUCLEUS_FIRST_K = 1024  # the nucleus is looked for among this many top tokens first
NUCLEUS_MORE_K = 8192  # then among this many, before a full sort


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, the smallest set of most probable tokens whose mass reaches ``top_p``; renormalise.

    A full sort of a 49k vocabulary costs several times a ``topk`` of its first thousand on a CPU core, while
    the nucleus is almost always among the top thousand tokens: those come from ``topk``, then (for flat rows:
    a high temperature, an untrained model) the top ``NUCLEUS_MORE_K``, and only when some row's top tokens
    still hold less than ``top_p`` is the whole row sorted. The result is the same set either way: a token past
    the first k has at least their mass before it, so is dropped.
    On a GPU the sort is cheap and that check would be a host sync, so the rows are sorted there."""
    top, order = _ranked(probs, top_p)
    drop = top.cumsum(-1) - top >= top_p  # keep the smallest set reaching top_p
    kept = torch.zeros_like(probs).scatter(-1, order, top.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def _ranked(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most probable tokens in descending order, as many as its nucleus may need (``nucleus``)."""
    if probs.device.type == "cpu":
        for k in (NUCLEUS_FIRST_K, NUCLEUS_MORE_K):
            if k >= probs.shape[-1]:
                break
            top, order = probs.topk(k, dim=-1)  # sorted, descending
            if bool((top.sum(-1) >= top_p).all()):
                return top, order
    return probs.sort(dim=-1, descending=True)


@dataclass(frozen=True)
class Decision:
    """One draft node the rule examined, with the numbers as the rule saw them, so the decision can be redone by
    hand. Greedy: kept iff its token is the target's top token there (``target_p`` is then 1, else 0).
    Rejection: kept iff ``draw * draft_p < target_p``, where ``target_p`` is the residual after the siblings
    rejected before it (renormalised) and ``draft_p`` the draft's probability renormalised without them (1 for
    fixed children, which are not draws); ``draw`` is None where no draw was made (``draft_p`` 0)."""

    node: int  # verify-input index of the draft node
    target_p: float
    draft_p: float
    draw: float | None
    accepted: bool


@dataclass
class Acceptance:
    path: list[int]  # accepted input indices (root excluded), in depth order
    bonus: int  # token the target adds after the path
    decisions: list[Decision] = field(default_factory=list, compare=False)  # each node examined (not typical)
    top: list[int] | None = field(default=None, compare=False)  # the target's argmax at each input (greedy only)


def follows_argmax(s: Sampling) -> bool:
    """Whether ``accept`` runs the greedy rule under ``s``: it reads only the target's argmax at each input."""
    rule = s.resolved_rule
    return rule == "greedy" or s.greedy and rule != "typical"


def accept(tree: DraftTree, logits: torch.Tensor, s: Sampling, gen: torch.Generator | None = None,
           explain: bool = False, top: list[int] | None = None) -> Acceptance:
    """Apply the configured rule to the verify logits [N+1, V] of ``tree``. With ``explain`` the result also
    holds the rule's ``decisions`` (for a display; the decode loop pays nothing for them otherwise). ``top``:
    the argmax of every row of ``logits``, where the caller read it already (a batch reads all its lanes' at
    once: one copy from the device, not one a lane); the greedy rule then reads nothing more."""
    if follows_argmax(s):
        return _greedy(tree, logits, explain, top)
    if s.resolved_rule == "typical":
        return _typical(tree, logits, s, gen)
    return _rejection(tree, logits, s, gen, explain)


def _greedy(tree: DraftTree, logits: torch.Tensor, explain: bool = False, top: list[int] | None = None) -> Acceptance:
    """Follow the target's top token down the tree. Siblings with one token (beams kept apart, each a branch of
    its own) may all match: the one with the longest match below it is followed (the first of equals), as
    checking each beam apart and keeping the best would; any matching path is the target's own text."""
    best = top if top is not None else top_ids(logits).tolist()
    tokens, kids = tree.tokens.tolist(), tree.children()

    @functools.cache
    def reach(node: int) -> int:  # how deep the target's top tokens run below ``node``; only asked on a tie
        return max((1 + reach(c) for c in kids[node] if tokens[c - 1] == best[node]), default=0)

    node, path, decisions = 0, [], []
    while True:
        hits = [c for c in kids[node] if tokens[c - 1] == best[node]]
        nxt = hits[0] if len(hits) == 1 else max(hits, key=reach, default=None)  # max keeps the first of equals
        if explain:  # in order, up to the child followed
            for child in kids[node][: kids[node].index(nxt) + 1 if nxt is not None else None]:
                hit = tokens[child - 1] == best[node]
                decisions.append(Decision(child, float(hit), 1.0, None, hit))
        if nxt is None:
            return Acceptance(path, best[node], decisions, best)
        path.append(nxt)
        node = nxt


def _sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _rejection(tree: DraftTree, logits: torch.Tensor, s: Sampling, gen: torch.Generator | None,
               explain: bool = False) -> Acceptance:
    tokens, kids = tree.tokens.tolist(), tree.children()
    node, path, decisions = 0, [], []
    while True:
        p = probabilities(logits[node], s).cpu()
        q = None if tree.child_dists is None else tree.child_dists[node].float().cpu().clone()
        chosen = None
        for child in kids[node]:
            x = tokens[child - 1]
            qx = 1.0 if q is None else float(q[x])
            draw = float(torch.rand((), generator=gen)) if qx > 0 else None  # no draw for a token q cannot give
            kept = draw is not None and draw * qx < float(p[x])
            if explain:
                decisions.append(Decision(child, float(p[x]), qx, draw, kept))
            if kept:
                chosen = child
                break
            # Rejected: the target keeps the mass the draft did not cover; the draft drops x.
            if q is None:
                p[x] = 0.0
            else:
                p = torch.clamp(p - q, min=0.0)
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
            total = p.sum()
            if total <= 0:  # numerically empty residual: fall back to the target itself
                p = probabilities(logits[node], s).cpu()
                break
            p = p / total
        if chosen is None:
            return Acceptance(path, _sample(p, gen), decisions)
        path.append(chosen)
        node = chosen


def _typical(tree: DraftTree, logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> Acceptance:
    """Medusa's typical acceptance: keep the longest path whose tokens are all 'typical'. Lossy."""
    temp = max(s.temperature, 1e-5)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, s.typical_epsilon), s.typical_delta * torch.exp(-entropy))
    tokens, parents = tree.tokens, tree.parents
    ok = (probs[parents, tokens] > threshold[parents]).tolist() if len(tree) else []
    best: list[int] = []
    for path in tree.paths():
        keep = []
        for n in path:
            if not ok[n - 1]:
                break
            keep.append(n)
        if len(keep) > len(best):
            best = keep
    last = best[-1] if best else 0
    bonus = int(top_ids(logits[last])) if s.greedy else _sample(probabilities(logits[last], s), gen)
    return Acceptance(best, bonus)
