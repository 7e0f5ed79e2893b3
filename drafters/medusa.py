"""Medusa: K independent heads on the target's last hidden state (Cai et al., 2024).

Head k (a ResBlock into the target's frozen LM head) predicts the token k places after the root,
without seeing the tokens before it. Drafts form a static sparse tree: the ``total_tokens`` rank
paths (r_1, .., r_d) with the highest estimated acceptance prod_k acc_k(r_k), the per-head rank
accuracies measured on the checkpoint's validation set, as Medusa builds its tree choices.
With ``top_k=1`` it is a chain. Medusa's typical acceptance (``--rule typical``) is lossy.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import nn

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Drafter, DraftRequest, Settings
from specviz.core.transfer import to_device
from specviz.core.tree import DraftTree

from .heads import DEPTH, HeadDrafter, HeadState, ResBlock


class MedusaHeads(nn.Module):
    """One ResBlock per head into the target's frozen head (what specviz trains). A published Medusa
    checkpoint may stack ``layers`` ResBlocks per head and give each head its own LM head over ``vocab``
    tokens (``out``), as Medusa's ``medusa_lm_head`` does."""

    def __init__(self, hidden: int, heads: int = DEPTH, layers: int = 1, vocab: int = 0):
        super().__init__()
        block = (lambda: ResBlock(hidden)) if layers == 1 else (
            lambda: nn.Sequential(*(ResBlock(hidden) for _ in range(layers))))
        self.heads = nn.ModuleList(block() for _ in range(heads))
        self.out = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(heads)) if vocab else None

    def start(self, x, e):
        return ()

    def advance(self, state, e, depth):
        return state

    def head(self, state, x, depth):
        return self.heads[depth - 1](x)

    def logits(self, head_in: torch.Tensor, frozen) -> torch.Tensor:
        """Logits [depth, V'] over the draft vocabulary for row d-1 = head d's input."""
        if self.out is None:
            return frozen.logits(head_in)
        return torch.stack([self.out[d](row) for d, row in enumerate(head_in)])


def tree_choices(accuracy: list[list[float]], top_k: int, total: int) -> list[tuple[int, ...]]:
    """The ``total`` rank paths with the highest product of per-head rank accuracies, parents first."""
    frontier = [(-accuracy[0][r], (r,)) for r in range(top_k)]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < total:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):  # a child never beats its parent, so the set stays prefix-closed
            for r in range(top_k):
                heapq.heappush(frontier, (neg * accuracy[len(path)][r], path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def rank_accuracy(card: dict, heads: int, top_k: int) -> list[list[float]]:
    """acc[k][r]: how often head k+1's rank-r token was the target's, from the card's last validation."""
    val = (card.get("history") or [{}])[-1].get("val", {})
    table = []
    for k in range(1, heads + 1):
        row = [max(float(val.get(f"rank{k}_{r}", 0.5 ** k / (r + 1))), 1e-6) for r in range(top_k)]
        table.append(row)
    return table


@dataclass
class MedusaSettings(Settings):
    """The default is the fastest on the 2-core CPU (swept on held-out ShareGPT prompts): one head,
    one token. ``PAPER`` is the 4-head sparse tree the benchmarks use (Medusa's own has 63 nodes)."""

    heads: int = 1  # tree depth: how many heads draft
    top_k: int = 1  # ranks per head the tree may use
    total_tokens: int = 1  # tree size
    checkpoint: str = ""
    ranges = {"heads": (1, 8), "top_k": (1, 8), "total_tokens": (1, 128)}  # heads: up to the checkpoint's

    PAPER = {"heads": 4, "top_k": 4, "total_tokens": 16}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("heads", "total_tokens", (("top_k", 8),), depths=tuple(range(1, DEPTH + 1)))]


def heads_top(net, frozen, x: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best draft tokens of heads 1..``depth`` after feature ``x`` [1, H]: log-probabilities and
    draft-vocabulary ids, [depth, k] each."""
    head_in = torch.cat([net.head((), x, d) for d in range(1, depth + 1)])
    return torch.log_softmax(net.logits(head_in, frozen).float(), dim=-1).topk(k, dim=-1)


class MedusaDrafter(HeadDrafter):
    name = "medusa"
    title = "Medusa: K independent heads, static sparse tree (typical acceptance is lossy)"
    network = MedusaHeads
    propose_batch = Drafter.propose_batch  # its own propose, not beam search: lane by lane

    def check_settings(self, settings: MedusaSettings) -> None:
        if settings.heads > len(self.net.heads):
            raise SettingsError(f"this medusa checkpoint has {len(self.net.heads)} heads, got heads={settings.heads}")
        self.choices = tree_choices(rank_accuracy(self.card, settings.heads, settings.top_k),
                                    settings.top_k, settings.total_tokens)
        # the static tree as index tensors: node i is rank rank_of[i] of head depth_of[i], under parent_of[i]
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        self.depth_of = torch.tensor([len(c) - 1 for c in self.choices])
        self.rank_of = torch.tensor([c[-1] for c in self.choices])
        self.parent_of = torch.tensor([index.get(c[:-1], 0) for c in self.choices])
        acc = rank_accuracy(self.card, settings.heads, settings.top_k)
        score = [-math.prod(acc[k][r] for k, r in enumerate(c)) for c in self.choices]
        order = sorted(range(len(self.choices)), key=lambda i: (score[i], self.choices[i]))  # the order chosen
        self.keep_order = torch.empty(len(order), dtype=torch.long)
        self.keep_order[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        # the tree's index columns where the heads run, copied there once rather than every step
        self.on_device = [to_device(t, self.device) for t in (self.depth_of, self.rank_of, self.parent_of,
                                                               self.keep_order)]

    def _draft_function(self):
        net, frozen, heads, k = self.net, self.frozen, self.settings.heads, self.settings.top_k
        return lambda x: heads_top(net, frozen, x, heads, k)

    def _draft_inputs(self, x: torch.Tensor, root: int) -> tuple:
        return (x,)

    @torch.inference_mode()
    def propose(self, state: HeadState, request: DraftRequest) -> DraftTree:
        depth = min(self.settings.heads, request.max_depth)
        if depth < 1 or state.x is None:
            return DraftTree.empty()
        out = self._compiled(state, depth, self.settings.heads)
        top_logp, top = out if out is not None else heads_top(self.net, self.frozen, state.x, depth,
                                                              self.settings.top_k)
        n = int((self.depth_of < depth).sum())  # choices are sorted by length: the shallow ones come first
        d, r, parents, rank = (t[:n] for t in self.on_device)
        # the tree stays where the heads ran: on a GPU the host reads it with the verify's answer
        return DraftTree(self.frozen.vocab_map[top[d, r]], parents, top_logp[d, r], None,
                         {"choices": self.choices[:n], "rank": rank, "max_depth": depth})
