"""verify.Decision: the accept rule's decisions, recorded with the numbers as the rule saw them, redo the rule
by hand: the residual after earlier rejections, the draft's renormalised probability, the draw and the test."""

from __future__ import annotations

import torch

from specviz.apps import render
from specviz.core.engine import DISPLAY, StepRecord, run
from specviz.core.protocol import Drafter
from specviz.core.tree import DraftTree
from specviz.core.verify import Sampling, accept, probabilities


def two_children_at_the_root(child_dists: bool) -> tuple[DraftTree, torch.Tensor]:
    vocab = 6
    logits = torch.log(torch.tensor([[0.10, 0.30, 0.25, 0.05, 0.20, 0.10]] * 3))
    q = torch.tensor([0.05, 0.50, 0.30, 0.05, 0.05, 0.05]) if child_dists else None
    dists = torch.stack([q, q, q]) if child_dists else None
    return DraftTree(torch.tensor([1, 2]), torch.tensor([0, 0]), child_dists=dists), logits[:, :vocab]


def redo_by_hand(tree: DraftTree, logits: torch.Tensor, s: Sampling, decisions) -> list[int]:
    """The rejection rule at the root, recomputed from the target's and draft's distributions and the
    recorded draws: the residual after each rejection, the draft renormalised without the rejected token."""
    p = probabilities(logits[0], s)
    q = None if tree.child_dists is None else tree.child_dists[0].clone()
    kept = []
    for d in decisions:
        x = int(tree.tokens[d.node - 1])
        qx = 1.0 if q is None else float(q[x])
        assert abs(d.target_p - float(p[x])) < 1e-6 and abs(d.draft_p - qx) < 1e-6
        assert d.accepted == (d.draw * qx < float(p[x]))
        if d.accepted:
            kept.append(d.node)
            break
        if q is None:
            p[x] = 0.0
        else:
            p = torch.clamp(p - q, min=0.0)
            q[x] = 0.0
            q = q / q.sum()
        p = p / p.sum()
    return kept


def test_rejection_decisions_can_be_redone_by_hand():
    s = Sampling(temperature=1.0)
    for child_dists in (False, True):
        tree, logits = two_children_at_the_root(child_dists)
        seen_rejection = False
        for seed in range(40):
            result = accept(tree, logits, s, torch.Generator().manual_seed(seed), explain=True)
            root = [d for d in result.decisions if int(tree.parents[d.node - 1]) == 0]
            assert [d.node for d in root] == [1, 2][: len(root)]
            assert redo_by_hand(tree, logits, s, root) == result.path[:1]
            seen_rejection |= not root[0].accepted and len(root) == 2
        assert seen_rejection  # the second child was judged against the residual at least once


def test_greedy_decisions_name_each_child_up_to_the_targets_top_token():
    tree = DraftTree(torch.tensor([5, 3, 7]), torch.tensor([0, 0, 2]))
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[2, 1] = 5.0  # root: top token 3 (node 2); node 2: top token 1, not its child's 7
    result = accept(tree, logits, Sampling(), explain=True)
    assert result.path == [2] and result.bonus == 1
    assert [(d.node, d.accepted) for d in result.decisions] == [(1, False), (2, True), (3, False)]


def test_the_step_view_shows_the_decisions_as_the_rule_saw_them():
    s = Sampling(temperature=1.0)
    tree, logits = two_children_at_the_root(True)
    result = next(r for seed in range(100)
                  if not (r := accept(tree, logits, s, torch.Generator().manual_seed(seed), explain=True)).path)
    record = StepRecord(step=1, tree=tree, path=result.path, tokens=[result.bonus], bonus=result.bonus,
                        decisions=result.decisions)
    detail = render.step_detail(record, lambda ids: "".join(f"t{i}" for i in ids), [0], "m", greedy=False)
    first, second = result.decisions
    assert "How the rule decided" in detail and "target p (residual)" in detail
    assert f"{first.draw * first.draft_p:.3f} ≥ {first.target_p:.3f}: rejected" in detail
    assert second.target_p != first.target_p  # the second child is judged against the residual
    assert f"<td>{second.target_p:.3f}</td><td>{second.draft_p:.3f}</td>" in detail


class TwoGuesses(Drafter):
    """Two children of the root every step (tokens 0 and 1): most steps reject at least one."""

    name = "two-guesses"

    def propose(self, state, request) -> DraftTree:
        return DraftTree(torch.tensor([0, 1]), torch.tensor([0, 0]))


def test_the_decode_loop_records_decisions_for_a_display_only(tiny_target):
    target = tiny_target(vocab_size=8, seed=1)
    shown = run(target, TwoGuesses(), [1, 2, 3], 12, observers=DISPLAY)
    bare = run(target, TwoGuesses(), [1, 2, 3], 12)
    assert shown.output_ids == bare.output_ids
    drafted = [r for r in shown.records if len(r.tree)]  # the last step may have no room left to draft
    assert drafted and all(r.decisions for r in drafted) and not any(r.decisions for r in bare.records)
    for r in drafted:  # greedy: the first examined child the target's top token is the one kept
        assert [d.node for d in r.decisions if d.accepted] == r.path[:1]
