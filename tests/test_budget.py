"""Draft budgets: the chooser on synthetic cost curves and acceptance, the warm-up replay on hand-built
trees, the nesting the replay relies on (a smaller budget keeps the best-ranked nodes of a larger one),
and the tuner and presets end to end on a tiny target."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import train_tiny_drafter
from drafters import build_drafter
from drafters.checkpoint import update_card
from drafters.lookahead import LookaheadSettings
from specviz.core.budget import Estimate, Option, VerifyCurve, choose, estimate, kept, padded_curve, padding
from specviz.core.engine import StepRecord
from specviz.core.protocol import Commit, DraftRequest
from specviz.core.target import TargetModel
from specviz.core.tree import DraftTree
from specviz.core.verify import Sampling


def test_verify_curve_interpolates_and_extrapolates():
    curve = VerifyCurve((1, 2, 4, 8), (10.0, 10.0, 12.0, 20.0))
    assert curve(1) == 10.0 and curve(3) == 11.0 and curve(6) == 16.0
    assert curve(16) == 36.0  # the last segment's slope, 2 ms per token
    with pytest.raises(ValueError):
        VerifyCurve((2, 1), (1.0, 2.0))


def test_the_fitted_curve_is_the_closest_non_decreasing_one():
    measured = (60.0, 98.0, 117.0, 91.0, 77.0, 110.0)  # a dip at 4-5 tokens that real runs do not show
    curve = VerifyCurve.fit((1, 2, 3, 4, 5, 6), measured)
    assert curve.ms == pytest.approx((60.0, 95.75, 95.75, 95.75, 95.75, 110.0))
    assert all(a <= b for a, b in zip(curve.ms, curve.ms[1:]))
    assert sum(curve.ms) == pytest.approx(sum(measured))  # pooling keeps the mean of what it pools
    assert VerifyCurve.fit((1, 8, 64), (5.0, 5.0, 9.0)).ms == (5.0, 5.0, 9.0)  # already non-decreasing: kept
    # a budget of 4 tokens looked cheapest on the raw curve; on the fitted one the single token wins
    options = [Option({"n": 1}, Estimate(1.0, 0), draft_ms=0.0), Option({"n": 4}, Estimate(1.57, 3), draft_ms=0.0)]
    assert choose(options, VerifyCurve((1, 2, 3, 4, 5, 6), measured)).settings == {"n": 4}
    assert choose(options, curve).settings == {"n": 1}


def test_sizes_pad_to_a_clearly_cheaper_larger_size():
    """The shape of this project's CPU (MKL, fp32): 2, 3 and 7 rows cost more than 4 and 8."""
    tokens = (1, 2, 3, 4, 5, 6, 7, 8, 12)
    ms = (61.0, 93.0, 112.0, 82.0, 79.0, 82.0, 101.0, 80.0, 92.0)
    pad = padding(tokens, ms)
    assert pad == {2: 5, 3: 5, 7: 8}  # 4 and 6 are within the 10 % margin of 5: a dip that small may be noise
    assert padding(tokens, ms, margin=0.0) == {2: 5, 3: 5, 4: 5, 6: 8, 7: 8}
    assert padding((1, 2, 4), (10.0, 12.0, 20.0)) == {}  # a curve without dips pads nothing
    curve = padded_curve(tokens, ms, pad)
    assert curve.ms == pytest.approx((61.0, 79.0, 79.0, 80.5, 80.5, *[242 / 3] * 3, 92.0))  # pads, then fits
    assert all(a <= b for a, b in zip(curve.ms, curve.ms[1:]))


def test_the_chooser_picks_the_known_optimum():
    """A chain with acceptance 0.8 per depth, 1 ms of drafting per depth, verifies flat up to 5 tokens
    then 5 ms per token: tokens per ms are .164 .203 .227 .240 .184 for lengths 1-5, so length 4 wins."""
    curve = VerifyCurve((1, 5, 6, 20), (10.0, 10.0, 15.0, 85.0))
    options = [Option({"num_tokens": n}, Estimate(sum(0.8 ** k for k in range(n + 1)), n), draft_ms=n)
               for n in range(1, 9)]
    best = choose(options, curve)
    assert best.settings == {"num_tokens": 4}
    assert best.step_ms == pytest.approx(14.0) and best.tokens_per_step == pytest.approx(3.3616)
    assert best.phase_ms == {"draft": 4.0, "verify": 10.0, "accept+other": 0.0}
    assert best.expected_speedup == pytest.approx(3.3616 / 14 * 10) and not best.slower_than_ar


def test_trees_pay_the_tree_curve_and_chains_the_chain_curve():
    """A tree's verify takes a 4D mask, another attention path: on this CPU it costs more than a chain."""
    chain_curve, tree_curve = VerifyCurve((1, 8), (10.0, 10.0)), VerifyCurve((1, 8), (10.0, 31.0))
    chain = Option({"shape": "chain"}, Estimate(2.0, 3), draft_ms=0.0, chain=True)
    tree = Option({"shape": "tree"}, Estimate(2.5, 3), draft_ms=0.0)
    assert choose([chain, tree], chain_curve).settings == {"shape": "tree"}  # one curve for both: the tree wins
    best = choose([chain, tree], chain_curve, tree_curve=tree_curve)  # the tree's 4 tokens cost 19 ms
    assert best.settings == {"shape": "chain"} and best.step_ms == pytest.approx(10.0)


def test_a_budget_slower_than_ar_says_so():
    curve = VerifyCurve((1, 2), (10.0, 30.0))  # every extra token triples the verify
    options = [Option({"num_tokens": n}, Estimate(1 + 0.1 * n, n), draft_ms=2.0) for n in (1, 2)]
    best = choose(options, curve, ar_other_ms=1.0)
    assert best.slower_than_ar and best.expected_speedup < 1.0


def record(tree: DraftTree, path: list[int], step: int = 1) -> StepRecord:
    return StepRecord(step=step, tree=tree, path=path, tokens=[0] * (len(path) + 1), bonus=0)


def test_the_replay_keeps_the_best_ranked_nodes_and_the_accepted_prefix():
    # root -> 1 (rank 0) -> 3 (rank 2) -> 5 (rank 4); root -> 2 (rank 1) -> 4 (rank 3)
    tree = DraftTree(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([0, 0, 1, 2, 3]),
                     info={"rank": torch.tensor([0, 1, 2, 3, 4])})
    assert kept(tree, depth=2, size=3).tolist() == [True, True, True, False, False]
    assert kept(tree, depth=1, size=8).tolist() == [True, True, False, False, False]
    steps = [record(DraftTree.empty(), [], 0), record(tree, [1, 3, 5]), record(tree, [2, 4])]
    assert estimate(steps, depth=3, size=5) == Estimate((4 + 3) / 2, 5)
    assert estimate(steps, depth=3, size=3) == Estimate((3 + 2) / 2, 3)  # 5 and 4 cut
    assert estimate(steps, depth=1, size=5) == Estimate((2 + 2) / 2, 2)
    assert estimate(steps, depth=2, size=1) == Estimate((2 + 1) / 2, 1)  # only node 1 is left
    chain = DraftTree.chain([7, 8, 9])
    assert estimate([record(chain, [1, 2])], depth=1, size=1 << 30) == Estimate(2.0, 1.0)


@pytest.fixture(scope="module")
def target(tiny_llama) -> TargetModel:
    return TargetModel(tiny_llama(48, seed=2, num_layers=3))


@pytest.fixture(scope="module")
def checkpoints(target):
    folder = Path(tempfile.mkdtemp())
    return {m: train_tiny_drafter(target, m, folder / m, epochs=1) for m in ("eagle2", "medusa")}


@pytest.mark.parametrize("method, big, small", [
    ("eagle2", dict(depth=5, top_k=4, total_tokens=24), [dict(depth=d, top_k=4, total_tokens=n)
                                                          for d in (1, 3, 5) for n in (1, 4, 9)]),
    ("medusa", dict(heads=4, top_k=4, total_tokens=24), [dict(heads=d, top_k=4, total_tokens=n)
                                                          for d in (1, 2, 4) for n in (2, 5, 11)]),
])
def test_a_smaller_budget_drafts_the_best_ranked_nodes_of_a_larger_one(method, big, small, target, checkpoints):
    """What the replay assumes: the smaller tree is the larger tree's best-ranked nodes up to its depth."""
    prompt = [3, 14, 15, 9, 26, 5, 35, 8]
    features = target.prefill(prompt, target.new_cache())[1]

    def draft(settings) -> DraftTree:
        drafter = build_drafter(method, target, checkpoint=str(checkpoints[method]), **settings)
        state = drafter.start()
        drafter.observe(state, Commit(torch.tensor(prompt), features, 7))
        return drafter.propose(state, DraftRequest(prompt + [7], 64, Sampling()))

    large = draft(big)
    paths = {tuple(large.tokens[n - 1].item() for n in path) for path in large.paths()}
    assert len(paths) > 1
    for settings in small:
        tree = draft(settings)
        depth, size = settings.get("depth", settings.get("heads")), settings["total_tokens"]
        keep = kept(large, depth, size)
        prefix = {}
        for i in range(len(large)):  # each kept node as its token path from the root
            node, path = i + 1, []
            while node:
                path.append(large.tokens[node - 1].item())
                node = int(large.parents[node - 1])
            prefix[i] = tuple(reversed(path))
        expected = sorted(prefix[i] for i in range(len(large)) if keep[i])
        got = []
        for i in range(len(tree)):
            node, path = i + 1, []
            while node:
                path.append(tree.tokens[node - 1].item())
                node = int(tree.parents[node - 1])
            got.append(tuple(reversed(path)))
        assert sorted(got) == expected, settings


def test_feeding_the_drafter_is_the_draft_time_less_each_steps_own_proposal():
    """Warm-ups of 16 tokens at depth 8: late steps draft only as deep as the tokens left allow. Draft time
    = 3 ms of feeding + 1 + 2 ms per depth of proposal; the estimate recovers the 3 ms."""
    from specviz.apps.tuning import WARMUP_TOKENS, _observe_ms

    def propose(depth: float) -> float:
        return 1.0 + 2.0 * (depth - 1)

    records, left = [], []
    for accepted in ([3, 2, 4, 1, 5, 0], [7, 6]):  # two warm-up prompts: a prefill, then their steps
        produced = 1
        records.append(StepRecord(step=0, tree=DraftTree.empty(), path=[], tokens=[9], bonus=9))
        for a in accepted:
            cap = min(8, WARMUP_TOKENS - produced - 1)
            left.append(cap)
            r = StepRecord(step=1, tree=DraftTree.chain(list(range(max(cap, 1)))), path=list(range(1, a + 1)),
                           tokens=[9] * (a + 1), bonus=9)
            r.timings.draft = (3.0 + (propose(cap) if cap > 0 else 0.0)) / 1000
            records.append(r)
            produced += a + 1
    assert min(left) < 8  # some steps were capped: the old estimate (time less the full proposal) was off
    assert _observe_ms(records, propose, 8) == pytest.approx(3.0)


def test_tune_chooses_from_the_grid_caches_and_presets_override(target, checkpoints, monkeypatch, tmp_path):
    from specviz.apps import tuning

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    given = {"checkpoint": str(checkpoints["eagle2"])}
    first = tuning.tune(target, "eagle2", given)
    assert first.settings["top_k"] == 8 and 1 <= first.settings["depth"] <= 8
    assert first.settings["total_tokens"] >= first.settings["depth"] and first.seconds > 0
    assert first.expected_tau >= 1.0 and first.expected_speedup > 0
    again = tuning.tune(target, "eagle2", given)
    assert again.seconds == 0 and again.settings == first.settings  # from the cache
    curves = []  # refreshing a method re-measures the method only, not the machine's curve
    monkeypatch.setattr(tuning, "profile", lambda *a, **k: curves.append(1) or pytest.fail("curve measured again"))
    refreshed = tuning.tune(target, "eagle2", given, refresh=True)  # measured again: it may choose otherwise
    assert refreshed.seconds > 0 and not curves
    monkeypatch.undo()
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    copy = shutil.copytree(checkpoints["eagle2"], tmp_path / "copy")
    assert tuning.tune(target, "eagle2", {"checkpoint": str(copy)}).seconds > 0
    update_card(copy, mtbench={"eagle2": {"tau": 9.9}})  # a bench's figures on the card: the same weights
    assert tuning.tune(target, "eagle2", {"checkpoint": str(copy)}).seconds == 0
    weights = load_file(str(copy / "weights.safetensors"))
    weights["fuse.weight"] = weights["fuse.weight"] * 0.5
    save_file(weights, str(copy / "weights.safetensors"))
    assert tuning.tune(target, "eagle2", {"checkpoint": str(copy)}).seconds > 0  # other weights: tuned again
    settings, tuned = tuning.resolve(target, "eagle2", given)
    assert tuned is not None and settings == {**refreshed.settings, **given}  # the cached budget, as refreshed
    assert tuning.resolve(target, "eagle2", {**given, "preset": "paper"}) == (
        {"depth": 6, "top_k": 10, "total_tokens": 60, **given}, None)
    assert tuning.resolve(target, "eagle2", {**given, "depth": 2}) == ({**given, "depth": 2}, None)  # given: kept
    assert tuning.resolve(target, "ar", {}) == ({}, None)  # nothing to tune
    with pytest.raises(Exception, match="preset must be one of"):
        tuning.resolve(target, "eagle2", {"preset": "fastest"})
    # a Space ships the budgets measured on its hardware: read at once from a fresh cache, nothing measured
    shipped, measured = tmp_path / "shipped", tuning.tune(target, "eagle2", given).settings  # (refreshed above)
    assert len(tuning.export_budgets(target, ["eagle2"], shipped, {"eagle2": given})) == 2  # the costs and eagle2
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setenv("SPECVIZ_BUDGETS", str(shipped))
    monkeypatch.setattr(tuning, "profile", lambda *a, **k: pytest.fail("the shipped curve was measured again"))
    from_space = tuning.tune(target, "eagle2", given)
    assert from_space.seconds == 0 and from_space.settings == measured
    assert not (tmp_path / "fresh" / "budgets").exists()  # read, not copied


def test_lookahead_budgets_are_each_warmed_up_and_the_best_is_kept(target, monkeypatch, tmp_path):
    """Lookahead's pool depends on its window, so no budget is a subset of another: the tuner runs each.
    With a verify that costs the same at every size (and dwarfs drafting), the most tokens per step wins."""
    from specviz.apps import tuning

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    flat = VerifyCurve((1, 512), (1000.0, 1000.0))
    monkeypatch.setattr(tuning, "machine_costs", lambda *_a, **_k: tuning.MachineCosts(flat, flat, 0.0))
    grid = [c for g in LookaheadSettings.budget_grids(target) for c in g.candidates()]
    assert len(grid) == 8 and all(not g.nested for g in LookaheadSettings.budget_grids(target))
    taus = {json.dumps(settings, sort_keys=True): estimate(tuning._warm_up(
        target, build_drafter("lookahead", target, **settings)), 1 << 30, 1 << 30).tokens for settings, _, _ in grid}
    tuned = tuning.tune(target, "lookahead")
    assert json.dumps(tuned.settings, sort_keys=True) in taus
    assert tuned.expected_tau == pytest.approx(taus[json.dumps(tuned.settings, sort_keys=True)])
    assert tuned.expected_tau == pytest.approx(max(taus.values()), rel=0.01)
    assert len(set(taus.values())) > 1  # the budgets really differ on this target


def test_warm_up_uses_the_held_out_prompts_that_fit_the_context():
    """The warm-up drafts on held-out chat prompts (never trained on, not a benchmark's), skipping those that
    leave no room for the answer and a tree; a context that fits none falls back to fixed random ids."""
    import transformers

    from conftest import make_llama
    from drafters.training.sharegpt import is_validation
    from specviz.apps import tuning
    from specviz.core.load import embedded_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_folder())
    model = make_llama(vocab_size=len(tokenizer), max_positions=512)
    shipped = json.loads(tuning.WARMUP_FILE.read_text())["prompts"]
    assert len(shipped) == 8 and all(is_validation(p["id"], 0.02) for p in shipped)  # the training split's held-out
    roomy = TargetModel(model, tokenizer)
    assert tuning._prompts(roomy) == [roomy.text.encode_chat(p) for p in tuning.warmup_prompts()]
    model.config.max_position_embeddings = 160
    tight = TargetModel(model, tokenizer)
    kept = tuning._prompts(tight)
    assert 0 < len(kept) < 8 and all(len(ids) + tuning.WARMUP_TOKENS + 80 <= 160 for ids in kept)
    model.config.max_position_embeddings = 64
    assert [len(ids) for ids in tuning._prompts(TargetModel(model, tokenizer))] == [24] * 8


def test_the_tuner_drafts_before_it_times(target, checkpoints, monkeypatch, tmp_path):
    """A GPU charges one-time set-up to a process's first drafts (eagle2, tuned first, came out 10x dearer
    per draft than hass on an H100 and an H200): every drafter the tuner times has drafted before."""
    from specviz.apps import tuning

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    drafts, timed, build, run = {}, [], tuning.build_drafter, tuning.run

    def counting(*args, **kwargs):
        drafter = build(*args, **kwargs)
        propose = drafter.propose
        drafts[id(drafter)] = 0

        def counted(state, request):
            drafts[id(drafter)] += 1
            return propose(state, request)

        drafter.propose = counted
        return drafter

    def timed_run(target, drafter, *args, **kwargs):  # the warm-up's timed runs
        timed.append(drafts[id(drafter)])
        return run(target, drafter, *args, **kwargs)

    monkeypatch.setattr(tuning, "build_drafter", counting)
    monkeypatch.setattr(tuning, "run", timed_run)
    tuning.tune(target, "eagle2", {"checkpoint": str(checkpoints["eagle2"])})
    assert timed and min(timed) > 0


def test_the_warm_up_prompts_are_read_on_first_use_not_at_import(tmp_path, monkeypatch):
    """Importing the tuner opens no data file; the prompts are read once, when first asked for."""
    import subprocess
    import sys

    from specviz.apps import tuning

    code = ("import sys\nopened = []\n"
            "sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == 'open' else None)\n"
            "import specviz.apps.tuning\n"
            "print(sum('warmup_prompts' in name for name in opened))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "0"
    other = tmp_path / "warmup.json"
    other.write_text(json.dumps({"prompts": [{"prompt": "Say hi."}]}))
    monkeypatch.setattr(tuning, "WARMUP_FILE", other)
    tuning.warmup_prompts.cache_clear()
    try:
        assert tuning.warmup_prompts() == ("Say hi.",)
        other.unlink()  # cached: not read again
        assert tuning.warmup_prompts() == ("Say hi.",)
    finally:
        tuning.warmup_prompts.cache_clear()
