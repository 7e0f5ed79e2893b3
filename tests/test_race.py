"""The app's fair race and renderers: outputs as if run alone, least-time-first order, escaping."""

from __future__ import annotations

import pytest
import torch

from drafters import build_drafter
from specviz.apps import race as race_module
from specviz.apps import render
from specviz.apps.race import race
from specviz.core.engine import run
from specviz.core.errors import SettingsError
from specviz.core.protocol import Drafter, DraftRequest
from specviz.core.tree import DraftTree

PROMPT = [3, 9, 4, 1, 7]


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target(48, seed=2)


class Lagging(Drafter):
    """Proposes nothing, but charges ``cost`` fake seconds per step to the race clock."""

    def __init__(self, name, cost, clock):
        self.name, self.cost, self.clock = name, cost, clock

    def propose(self, state, request: DraftRequest) -> DraftTree:
        self.clock[0] += self.cost
        return DraftTree.empty()


class Failing(Drafter):
    name = "failing"

    def __init__(self, after: int, error: Exception = SettingsError("drafter broke")):
        self.after, self.calls, self.error = after, 0, error

    def propose(self, state, request):
        self.calls += 1
        if self.calls > self.after:
            raise self.error
        return DraftTree.empty()


def test_each_lane_matches_its_standalone_run(target):
    drafters = {"ar": build_drafter("ar", target), "pld": build_drafter("pld", target),
                "skip": build_drafter("skip", target, layers=1, num_tokens=3)}
    lanes = {}
    for lane in race(target, drafters, PROMPT, 30):
        lanes[lane.label] = lane
    for label, drafter in drafters.items():
        alone = run(target, build_drafter(label, target, **({"layers": 1, "num_tokens": 3} if label == "skip" else {})),
                    PROMPT, 30)
        assert lanes[label].output_ids == alone.output_ids, label
        assert [len(r.tree) for r in lanes[label].records] == [len(r.tree) for r in alone.records]
        assert lanes[label].finished and lanes[label].error is None


def test_lanes_may_share_one_drafter_object(target):
    """Each lane's decode has its own drafter state: one skip drafter in two lanes runs as it does alone."""
    skip = build_drafter("skip", target, layers=1, num_tokens=3)
    lanes = {lane.label: lane for lane in race(target, {"one": skip, "two": skip}, PROMPT, 30)}
    alone = run(target, skip, PROMPT, 30)
    for lane in lanes.values():
        assert lane.output_ids == alone.output_ids and lane.error is None
        assert [(r.tree.tokens.tolist(), r.path) for r in lane.records] == [(r.tree.tokens.tolist(), r.path)
                                                                             for r in alone.records]
        assert all(r.node_target_p.numel() == len(r.tree) and r.margins for r in lane.records)  # what the app shows


def test_the_lane_furthest_behind_always_moves(target, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(race_module.time, "perf_counter", lambda: clock[0])
    drafters = {"slow": Lagging("slow", 3.0, clock), "fast": Lagging("fast", 1.0, clock)}
    clocks, lanes, order = {"slow": 0.0, "fast": 0.0}, {}, []
    for lane in race(target, drafters, PROMPT, 12):
        others = [clocks[k] for k, x in lanes.items() if k != lane.label and not x.finished]
        assert all(clocks[lane.label] <= c for c in others), (lane.label, clocks)
        clocks[lane.label] = lane.clock
        lanes[lane.label] = lane
        order.append(lane.label)
    assert (clocks["slow"] == pytest.approx(3.0 * 10)
            and clocks["fast"] == pytest.approx(10.0))  # no draft on the last step
    # while both run, the fast lane (a third of the cost per step) takes about three steps per slow one
    both = order[: order.index("slow", 8)]
    assert both.count("fast") >= 2 * both.count("slow")


def test_a_failing_lane_stops_alone(target):
    drafters = {"ar": build_drafter("ar", target), "failing": Failing(after=3)}
    lanes = {}
    for lane in race(target, drafters, PROMPT, 20):
        lanes[lane.label] = lane
    assert lanes["failing"].error == "drafter broke" and lanes["failing"].finished
    assert len(lanes["ar"].output_ids) == 20 and lanes["ar"].error is None


def test_any_exception_in_a_lane_stops_only_that_lane(target):
    """A bug (not a SpecvizError) in one drafter ends its lane with the exception named; the race goes on."""
    drafters = {"ar": build_drafter("ar", target), "buggy": Failing(after=2, error=RuntimeError("index out of range"))}
    lanes = {lane.label: lane for lane in race(target, drafters, PROMPT, 20)}
    assert lanes["buggy"].error == "RuntimeError: index out of range" and lanes["buggy"].finished
    assert len(lanes["ar"].output_ids) == 20 and lanes["ar"].error is None


def test_race_leaves_other_decodes_caches_alone(target):
    cache = target.new_cache()
    target.prefill([1, 2, 3], cache)
    before = [layer.keys.clone() for layer in cache.layers]
    for _ in race(target, {"ar": build_drafter("ar", target)}, PROMPT, 5):
        pass
    assert cache.get_seq_length() == 3
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before))


# -- rendering ------------------------------------------------------------------------------------

def fake_record(step=1):
    from specviz.core.engine import StepRecord

    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 0]), torch.log(torch.tensor([0.5, 0.25, 0.2])))
    return StepRecord(step=step, tree=tree, path=[1], tokens=[5, 9], bonus=9,
                      node_target_p=torch.tensor([0.9, 0.1, 0.05]), bonus_target_p=0.7)


def test_step_html_colours_hovers_and_escapes():
    decode = {5: "<b>", 6: "x", 7: "y", 9: "&"}.get
    body = render.step_html(fake_record(), lambda ids: decode(ids[0]), show_rejected=True)
    assert ('<span class="sv-acc" title="step 1 · depth 1 · accepted draft · draft p 0.500 · target p 0.900">'
            '&lt;b&gt;</span>' in body)
    assert 'class="sv-rej"' in body and ">x<" in body  # node 2 (child of the accepted node 1) was rejected
    assert '<span class="sv-rejn" tabindex="0" title="1 rejected at depth 2">✗1<span class="sv-rejl">' in body
    assert ">y<" not in body  # node 3 is not a child of the last accepted node
    assert 'class="sv-bonus"' in body and "&amp;" in body and "target correction token" in body
    assert "sv-rej" not in render.step_html(fake_record(), lambda ids: decode(ids[0]), show_rejected=False)


def test_tree_figure_marks_the_accepted_path():
    fig = render.tree_figure(fake_record(), lambda ids: str(ids[0]), "x")
    lines_off, lines_on, nodes = fig.data
    assert list(nodes.x) == [0, 1, 2, 1] and list(nodes.text) == ["root", "5", "6", "7"]
    assert [c == render.COLOURS["accepted"] for c in nodes.marker.color] == [True, True, False, False]
    # 6 hangs from the kept 5 and 7 from the root: both tested and rejected, red
    assert list(nodes.marker.color)[2:] == [render.COLOURS["rejected"]] * 2
    assert [h.rsplit(" · ", 1)[1] for h in nodes.hovertext] == ["root", "accepted", "rejected", "rejected"]
    assert list(lines_on.x) == [0, 1, None]


def test_tree_figure_shows_beams_before_dedup_for_beam_drafters():
    from specviz.core.engine import StepRecord

    beams = torch.tensor([[5, 6, 7], [5, 6, 8], [9, 6, 7]])  # two beams share the prefix 5 6
    tree = DraftTree.from_beams(beams)
    accepted = [1, 3]  # 5 -> 6 along beam 0
    record = StepRecord(step=3, tree=tree, path=accepted, tokens=[5, 6, 4], bonus=4,
                        node_target_p=torch.zeros(len(tree)), bonus_target_p=0.5)
    fig = render.tree_figure(record, lambda ids: str(ids[0]), "redrafter")
    assert "3 beams × 3 → 7 nodes" in fig.layout.title.text
    beam_nodes = fig.data[-1]
    assert list(beam_nodes.text) == ["5", "6", "7", "5", "6", "8", "9", "6", "7"]
    green = [c == render.COLOURS["accepted"] for c in beam_nodes.marker.color]
    assert green == [True, True, False, True, True, False, False, False, False]  # the shared prefix is green twice


def test_newlines_and_empty_tokens_stay_visible():
    record = fake_record()
    body = render.step_html(record, lambda ids: {5: "\n", 9: ""}.get(ids[0], "?"), show_rejected=False)
    assert "↵\n</span>" in body and ">∅</span>" in body


def test_whitespace_tokens_are_visible_labels_in_the_tree_and_the_node_table():
    decode = lambda ids: {5: "\n", 6: " ", 7: ""}.get(ids[0], "?")  # noqa: E731
    nodes = render.tree_figure(fake_record(), decode, "x").data[-1]
    assert list(nodes.text) == ["root", "↵", "␣", "∅"]
    assert "<code>↵</code>" in render.step_detail(fake_record(), decode, [1], "x")
    assert render.visible(" the") == " the" and render.visible("a\nb") == "a↵b"


def test_tree_figure_grows_a_readable_row_per_leaf():
    from specviz.core.engine import StepRecord

    def height(leaves: int) -> int:
        tree = DraftTree.from_beams(torch.arange(leaves).view(leaves, 1))  # a root with `leaves` children
        record = StepRecord(step=1, tree=tree, path=[], tokens=[0], bonus=0, node_target_p=torch.zeros(len(tree)),
                            bonus_target_p=0.5)
        return render.tree_figure(record, lambda ids: str(ids[0]), "x").layout.height

    assert height(3) == 380 and height(60) >= 16 * 60 and height(60) > height(30) > height(3)


def test_plots_one_line_per_method_and_a_box_of_tokens_per_step():
    from specviz.core.engine import StepRecord

    prefill = StepRecord(step=0, tree=DraftTree.empty(), path=[], tokens=[4], bonus=4, node_target_p=torch.zeros(0),
                         bonus_target_p=1.0)
    runs = {"a": [prefill, fake_record(1), fake_record(2)], "b": [prefill, fake_record(1)]}
    alpha = render.acceptance_figure(runs)
    assert [(t.name, t.line.dash, t.showlegend) for t in alpha.data] == [
        ("a", "solid", True), ("a", "dash", False), ("b", "solid", True), ("b", "dash", False)]
    assert list(alpha.data[0].y) == [1.0, 0.0]  # depth 1 accepted at both steps, depth 2 reached, never accepted
    assert alpha.data[0].line.color == alpha.data[1].line.color != alpha.data[2].line.color
    assert [list(c) for c in alpha.data[0].customdata] == [[2, 2], [0, 2]]  # accepted of tested, per depth (hover)
    assert [list(c) for c in alpha.data[1].customdata] == [[2, 2], [0, 2]]  # ... of all decode steps
    boxes = render.accepted_length_figure(runs)
    assert [(t.type, t.name, list(t.y)) for t in boxes.data] == [("box", "a", [2, 2]), ("box", "b", [2])]


def test_step_detail_explains_what_the_target_kept_and_why_it_stopped():
    decode = {5: "five", 6: "six", 7: "seven", 9: "nine", 1: "one"}.get
    detail = render.step_detail(fake_record(), lambda ids: "".join(decode(i) for i in ids), [1], "eagle2")
    assert "eagle2 · step 1" in detail and "…one<mark>fivenine</mark>" in detail
    assert "Drafted <b>3</b> node(s) up to depth 2; the target accepted <b>1</b>: <code>five</code>" in detail
    # node 2 (six) is the first child of the last accepted node: it decided where the path stopped
    assert "the first rejected node, <code>six</code>, had draft p 0.250 and target p 0.100" in detail
    assert detail.count('class="sv-accepted"') == 1 and detail.count('class="sv-rejected"') == 2
    assert "<code>nine</code> (target p 0.700): the correction" in detail and "verify" in detail


@pytest.mark.parametrize("parents,path,kind", [
    ([0, 1, 0], [1, 2], "bonus"),  # a tree whose accepted path ends at a leaf (node 2)
    ([0, 1, 0], [1], "correction"),  # node 1's only child (node 2) was rejected
    ([0, 1, 0], [], "correction"),  # both children of the root were rejected
    ([0, 1, 2], [1, 2, 3], "bonus"),  # a chain accepted to its end
    ([0, 1, 2], [1], "correction"),  # a chain rejected at depth 2
])
def test_the_targets_token_is_a_bonus_after_a_leaf_and_a_correction_after_rejections(parents, path, kind):
    from specviz.core.engine import StepRecord

    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor(parents), torch.log(torch.tensor([0.5, 0.25, 0.2])))
    tokens = [int(tree.tokens[n - 1]) for n in path] + [9]
    record = StepRecord(step=1, tree=tree, path=path, tokens=tokens, bonus=9,
                        node_target_p=torch.tensor([0.9, 0.8, 0.05]), bonus_target_p=0.7)
    assert record.corrected == (kind == "correction")
    decode = {5: "five", 6: "six", 7: "seven", 9: "nine", 1: "one"}.get
    detail = render.step_detail(record, lambda ids: "".join(decode(i) for i in ids), [1], "m")
    assert f"<code>nine</code> (target p 0.700): the {kind}" in detail
    other = "bonus" if kind == "correction" else "correction"
    assert f"the {other}" not in detail
    if kind == "bonus":
        assert f"ends at depth {len(path)} because the draft ended there" in detail
    spans = render.step_html(record, lambda ids: decode(ids[0]), show_rejected=True)
    assert f"target {kind} token" in spans and f"target {other} token" not in spans
