"""``bench --batch-sizes`` (``apps.batching``, ``apps.batch_results``) on a tiny target: a point per method and batch
size, AR at every size, outputs checked against AR's, a results file that reads back and renders."""

from __future__ import annotations

import dataclasses

import pytest

from specviz.apps.batch_results import BatchSweep
from specviz.apps.batching import batch_sweep, kept_sizes
from specviz.apps.cli import main
from specviz.apps.questions import load_questions
from specviz.core.errors import SettingsError
from specviz.core.load import load_target


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir), "float32", "cpu")


def test_a_sweep_has_every_method_at_every_batch_size_beside_ar(target, tmp_path):
    questions = load_questions("mt-bench", limit=3)
    saved = []
    look = "lookahead:window=2:ngram=3:guesses=2"  # settings given: nothing to tune
    apart = "pld:num_tokens=3:batched_drafting=0"  # the A/B arm that drafts lane by lane
    sweep = batch_sweep(target, ["pld:num_tokens=3", look, apart], questions, [1, 2], max_new_tokens=12,
                        source="mt-bench", on_point=lambda s: saved.append(len(s.points)))
    assert [(p.method, p.batch_size) for p in sweep.points] == [
        (m, b) for b in (1, 2) for m in ("ar", "pld:num_tokens=3", look, apart)]
    assert saved == [1, 2, 3, 4, 5, 6, 7, 8]  # after every point: a killed sweep keeps what it measured
    for b in (1, 2):  # AR ran before and after every method: its point pools its 4 runs, each method's baseline
        ar, runs = sweep.point("ar", b), sweep.point("ar", b).runs  # is the pair around it
        assert len(runs) == 4 and min(runs) <= ar.throughput <= max(runs)
        for i, m in enumerate(["pld:num_tokens=3", look, apart]):
            p = sweep.point(m, b)
            assert p.baseline == round((runs[i] + runs[i + 1]) / 2, 2) and sweep.speedup(p) == p.throughput / p.baseline
    assert sweep.point(apart, 2).settings == {"num_tokens": 3} and sweep.point(apart, 2).identical == 3
    with pytest.raises(SettingsError, match="batched_drafting is 1"):
        batch_sweep(target, ["pld:batched_drafting=2"], questions, [1], max_new_tokens=4)
    for p in sweep.points:
        assert p.sequences == 3 and p.new_tokens == 36 and p.throughput > 0 and p.sequence_tok_s > 0
        assert p.identical in (None, 3)  # greedy and lossless: every sequence is AR's
        assert (p.identical is None) == (p.method == "ar")
    assert sweep.speedup(sweep.point("ar", 2)) == 1.0 and sweep.point("ar", 1).tau == 1.0
    assert sweep.point("pld:num_tokens=3", 1).settings == {"num_tokens": 3}
    assert sweep.point(look, 2).tau == sweep.point(look, 1).tau  # τ does not depend on the batch
    path = tmp_path / "sweep.json"
    sweep.save(path)
    again = BatchSweep.load(path)
    assert again == sweep
    table = again.markdown()
    assert "| method | batch 1 | batch 2 |" in table and f"| {look} |" in table and "(1.00×)" in table
    assert sweep.engine == "eager" and "float32, eager forwards on" in table  # the path its forwards took
    compiled = BatchSweep.from_dict({**sweep.to_dict(), "engine": "compiled"})
    with pytest.raises(SettingsError, match="another engine"):  # a sweep on the other path is not resumed
        kept_sizes(compiled, sweep, ["ar"])


def test_the_command_writes_the_sweep_and_refuses_what_it_cannot_do(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "batches.json"
    main(["bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--methods", "pld", "--limit", "2",
          "--max-new-tokens", "6", "--batch-sizes", "1,2", "--out", str(out)])
    assert "| pld |" in capsys.readouterr().out
    assert [(p.method, p.batch_size) for p in BatchSweep.load(out).points] == [
        ("ar", 1), ("pld", 1), ("ar", 2), ("pld", 2)]
    main(["report", str(out)])
    assert "| method | batch 1 | batch 2 |" in capsys.readouterr().out
    refused = ((["--batch-sizes", "1,x"], "whole numbers"), (["--batch-sizes", "2", "--part", "1/2"], "no --part"),
               (["--batch-sizes", "0"], "positive integers"), (["--batch-sizes", "1,2"], "needs at least 2 questions"))
    for bad, message in refused:
        code = main(["bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--methods", "pld", "--limit",
                     "1", "--max-new-tokens", "4", "--out", str(tmp_path / "no.json"), *bad])
        assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "no.json").exists()


def test_a_killed_sweep_resumes_keeping_only_whole_batch_sizes(tiny_target_dir, tmp_path, monkeypatch, capsys):
    """A resume keeps the batch sizes every method finished (with the AR run after it) and measures a half-done
    size again whole, so a speedup never compares runs of two processes; a file made another way is refused."""
    from specviz.apps import batching

    out = tmp_path / "batches.json"
    command = ["bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--methods", "pld", "--limit", "2",
               "--max-new-tokens", "6", "--batch-sizes", "1,2", "--out", str(out)]
    assert main(command) == 0
    killed = BatchSweep.load(out)
    first = {(p.method, p.batch_size): p for p in killed.points}
    killed.points[-1] = dataclasses.replace(killed.points[-1], baseline=None)  # killed before AR's run after pld
    killed.save(out)
    measured, measure = [], batching.measure
    monkeypatch.setattr(batching, "measure", lambda t, label, ps, b, *a, **k: measured.append((label, b)) or measure(
        t, label, ps, b, *a, **k))
    assert main([*command, "--resume"]) == 0
    assert measured == [("ar", 2), ("pld", 2), ("ar", 2)]  # batch 1 kept, batch 2 again whole
    resumed = BatchSweep.load(out)
    assert [(p.method, p.batch_size) for p in resumed.points] == [("ar", 1), ("pld", 1), ("ar", 2), ("pld", 2)]
    assert resumed.point("pld", 1) == first["pld", 1]
    measured.clear()
    assert main([*command, "--resume"]) == 0 and measured == []  # finished: nothing left
    capsys.readouterr()
    assert main([*command[:-4], "--max-new-tokens", "5", "--batch-sizes", "1,2", "--out", str(out), "--resume"]) == 2
    assert "another max_new_tokens" in capsys.readouterr().err


def test_the_benchmark_tab_streams_the_sweep_as_a_figure_and_a_table(tiny_target_dir):
    from specviz.apps.web.handlers import BATCH_SIZES, Handlers
    from specviz.apps.web.plan import setting_specs
    from specviz.apps.web.state import load_state

    state = load_state(str(tiny_target_dir), "float32", "cpu", tune="off")
    updates = list(Handlers(state, setting_specs(state)).batches("mt-bench", "first N", 2, ["ar", "pld"], 8))
    figure, table, status = updates[-1]
    sizes = [b for b in BATCH_SIZES if b <= 2]  # two questions fill no batch of 4: it is left out, and said so
    assert sizes == [1, 2] and "batch 4 left out: it needs as many questions" in status
    total = 2 * len(sizes)
    assert len(updates) == total and status.startswith(f"{total} of {total} points")
    assert list(table["method"]) == ["ar", "pld"] * len(sizes) and set(table["batch"]) == set(sizes)
    assert [t.name for t in figure.data] == ["pld"] and list(figure.data[0].x) == sizes


def test_redrafters_two_modes_get_their_own_panel():
    from specviz.apps.batch_plot import batch_figure
    from specviz.apps.batch_results import BatchPoint, BatchSweep

    sweep = BatchSweep("t", "cpu", "float32", "m", "d", "q", 8, {})
    for b, ar, merged, apart in ((1, 10.0, 14.0, 11.0), (4, 30.0, 33.0, 27.0)):
        sweep.points += [BatchPoint("ar", b, 4, 32, 1.0, 1.0, ar, ar / b),
                         BatchPoint("redrafter:preset=paper", b, 4, 32, 1.0, 2.5, merged, merged / b),
                         BatchPoint("redrafter:preset=paper:tree_attention=0", b, 4, 32, 1.0, 2.5, apart, apart / b)]
    figure = batch_figure(sweep)
    speedups = {t.name: list(t.y) for t in figure.data if t.xaxis == "x"}
    assert speedups == {"redrafter:preset=paper": pytest.approx([1.4, 1.1]),
                        "redrafter:preset=paper:tree_attention=0": pytest.approx([1.1, 0.9])}
    panel = [t for t in figure.data if t.xaxis == "x2"]
    assert [list(t.y) for t in panel] == [[14.0, 33.0], [11.0, 27.0]] and panel[1].line.dash == "dash"
    assert batch_figure(None).data == ()
