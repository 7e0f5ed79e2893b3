"""core.capture: the compiled target forward, in both layouts (attention over the live rows, or over the whole buffer as
CUDA graphs need it). Greedy output on it equals plain greedy decoding and the eager path's, for AR and for drafters
that verify chains and trees; commits through it keep exactly the accepted rows; the
target serves eager while it compiles and switches when ready; prefills and unknown engines are handled as said
(batches: ``test_capture_batch``).

One tiny target is compiled once per module (a few seconds per graph on a small CPU)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from test_cache import commit_rounds
from test_engine import RandomTreeDrafter

from app_harness import tiny_target_folder
from conftest import drafts_on_after_its_graph_breaks, session_checkpoint
from drafters import build_drafter
from drafters.captured import capture_drafters
from specviz.apps.cli import main
from specviz.apps.methods import split_engine
from specviz.apps.results import BenchResult
from specviz.core import rows
from specviz.core.attention import NAME
from specviz.core.capture import CapturedForward, EngineStatus, plain_causal_lm, use_cache_folder
from specviz.core.engine import generate, output_ids, run
from specviz.core.errors import SettingsError
from specviz.core.load import prepare
from specviz.core.packing import pack, packed_count
from specviz.core.target import TargetModel

PROMPTS = [[3, 5, 7, 11, 13], [2, 9, 4, 4, 1, 30, 17, 8, 8, 21, 5]]


@pytest.fixture(scope="module", params=["live", "buffer"])
def pair(tiny_llama, request):
    """(compiled, eager): two targets on one tiny model's weights, one compiled now, its attention reading the live
    rows or (as under CUDA graphs) the whole buffer. Prepared as ``load_target`` prepares a target: its grouped
    heads attend without copies (``core.attention``), its linear layers packed, compiled as users run it."""
    compiled = TargetModel(prepare(tiny_llama(vocab_size=64, seed=3, max_positions=320), pack=True))
    assert compiled.config._attn_implementation == NAME
    status = compiled.use_engine("compiled", layout=request.param)
    assert status.path == "compiled", status
    return compiled, compiled.eager_view()


def test_the_engine_says_which_path_runs(pair):
    compiled, eager = pair
    assert compiled.engine.path == "compiled" and compiled.captured.split
    assert ("whole buffer" in compiled.engine.detail) == (compiled.captured.layout == "buffer")
    assert eager.engine == EngineStatus("eager", "baseline") and eager.captured is None
    assert compiled.captured.ready and eager.model is compiled.model


@pytest.mark.parametrize("prompt", PROMPTS)
def test_compiled_ar_is_plain_greedy_and_the_eager_paths(prompt, pair, ref_greedy):
    compiled, eager = pair
    expected = ref_greedy(compiled.model, prompt, 40)
    assert run(compiled, build_drafter("ar", compiled), prompt, 40).output_ids == expected
    assert run(eager, build_drafter("ar", eager), prompt, 40).output_ids == expected


@pytest.mark.parametrize("method", ["pld:num_tokens=4", "lookahead", "skip:layers=1:num_tokens=3"])
def test_drafters_on_the_compiled_path_equal_ar(method, pair, ref_greedy):
    compiled, _ = pair
    name, _, opts = method.partition(":")
    settings = dict(kv.split("=") for kv in opts.split(":")) if opts else {}
    drafter = build_drafter(name, compiled, **{k: int(v) for k, v in settings.items()})
    for prompt in PROMPTS:
        result = run(compiled, drafter, prompt + prompt, 40)
        assert result.output_ids == ref_greedy(compiled.model, prompt + prompt, 40)
        assert any(len(r.tree) for r in result.records[1:])  # drafts went through the several-row graph


def test_a_random_tree_drafter_on_the_compiled_path_equals_ar(pair, ref_greedy):
    """Trees of random shape (tree masks through the compiled graph), one walk spelling the true continuation:
    AR's text, with deep paths accepted."""
    compiled, _ = pair
    prompt = PROMPTS[1]
    reference = ref_greedy(compiled.model, prompt, 40)
    drafter = RandomTreeDrafter(prompt, reference, seed=5, vocab=64)
    result = run(compiled, drafter, prompt, 40, stop_on_eos=False)
    assert result.output_ids == reference
    assert len(drafter.shapes) > 5 and sum(r.accepted for r in result.records) > 10


@pytest.mark.parametrize("context,capacity", [(3, 4), (60, 256)])
def test_compiled_commits_keep_exactly_the_accepted_rows(context, capacity, pair, ref_logits):
    """As test_cache's commit test, on the compiled path: every verify's logits equal a cache-free forward over
    the committed sequence, through buffer growth (done before the graph, never in it)."""
    compiled, _ = pair
    commit_rounds(compiled, compiled.new_cache(capacity), random.Random(context), context, ref_logits)


def test_no_decode_compiles_again_after_warming(pair, ref_greedy):
    """``warm`` compiled every graph a decode asks for: decodes of other prompt lengths, capacities (a buffer that
    grows mid-decode included), chains and tree shapes compile nothing more; each would cost seconds mid-decode."""
    from torch._dynamo.utils import counters

    compiled, _ = pair
    before = counters["stats"]["unique_graphs"]
    prompt = PROMPTS[1] * 3
    reference = ref_greedy(compiled.model, prompt, 30)
    for drafter in (build_drafter("ar", compiled), build_drafter("pld", compiled, num_tokens=3),
                    RandomTreeDrafter(prompt, reference, seed=9, vocab=64)):
        assert run(compiled, drafter, prompt, 30, stop_on_eos=False).output_ids == reference
    small = compiled.new_cache(8)  # outgrown by the prompt, then twice more
    records = generate(compiled, build_drafter("ar", compiled), PROMPTS[0], 30, stop_on_eos=False, cache=small)
    assert output_ids(list(records)) == ref_greedy(compiled.model, PROMPTS[0], 30) and small.capacity >= 35
    assert counters["stats"]["unique_graphs"] == before
    assert compiled.engine.path == "compiled", compiled.engine  # and none of it fell back to the eager path


def test_a_compiled_forward_that_breaks_mid_decode_hands_over_to_the_eager_path(tiny_llama, ref_greedy):
    """Whatever breaks a compiled forward while decoding (a CUDA graph the driver refuses, say) costs no output: that
    forward and the rest run eager, exactly, the cache as it was, and the status says what happened."""
    target = TargetModel(tiny_llama(vocab_size=64, seed=6))
    assert target.use_engine("compiled").path == "compiled"
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("the graph could not be replayed")

    prompt = PROMPTS[1]
    records = generate(target, build_drafter("pld", target), prompt + prompt, 30, stop_on_eos=False)
    first = [next(records), next(records)]  # the prefill (eager), then a step on the compiled path
    target.captured._fn = broken
    rest = list(records)
    assert output_ids(first + rest) == ref_greedy(target.model, prompt + prompt, 30)
    assert calls == [1] and target.engine.path == "eager"
    detail = "the compiled path failed while decoding: RuntimeError: the graph could not be replayed"
    assert target.engine.detail == detail


def test_a_drafter_tapping_layers_after_compilation_keeps_the_compiled_path(tiny_llama, ref_greedy):
    """EAGLE-3 asks for layer inputs when it is built: a target compiled before that compiles again, still as decoder
    then head (the head outside the graph, as for every other method), now returning those layers' inputs, so that
    every method (not only EAGLE-3) keeps decoding on the compiled path."""
    target = TargetModel(prepare(tiny_llama(vocab_size=64, seed=3), pack=True))
    assert target.use_engine("compiled").path == "compiled" and target.captured.split
    assert target.tap([0, 1]) == [1, 2] and target.taps == (0, 1)
    assert target.captured.split and target.captured.taps == (0, 1)
    assert target.captured.ready and target.engine.path == "compiled"
    calls = []
    fn = target.captured._fn
    target.captured._fn = lambda *a, **k: calls.append(1) or fn(*a, **k)
    result = run(target, build_drafter("pld", target, num_tokens=3), PROMPTS[1], 20, stop_on_eos=False)
    assert result.output_ids == ref_greedy(target.model, PROMPTS[1], 20) and len(calls) >= 5
    logits, feats = target.prefill(PROMPTS[0], target.new_cache(32))
    assert feats.shape[-1] == 3 * target.config.hidden_size  # the features, then layers 0 and 1's inputs
    captured = target.captured
    assert target.tap([1]) == [2] and target.captured is captured  # nothing new: no compiling again


def test_the_cpu_graph_runs_on_packed_weights(pair):
    """Every linear layer of a compiled forward is a packed product called from the graph through the rows
    extension's C++ operators (``specviz_rows::layer``, or with the layers reading its input ``specviz_rows::group``;
    ``core.packing.register``), not ``aten::mm`` on unpacked weights and not a Python operator."""
    from torch.profiler import profile

    compiled, _ = pair
    layers = packed_count(compiled.model)
    assert layers == 2 * 7 + 1 or pack(torch.ones(2, 2)) is None  # two layers of seven, and the head
    assert rows.available(), rows.unavailable()  # CI's machine and ours build it (``test_rows``)
    cache = compiled.new_cache(64)
    compiled.prefill(PROMPTS[1], cache)
    ids, positions = torch.tensor([[5, 6]]), torch.tensor([[11, 12]])
    compiled.forward_rows(ids, positions, None, cache)  # any graph this context asks for compiled outside the count
    cache.crop(-2)
    with profile() as prof:
        compiled.forward_rows(ids, positions, None, cache)
    counts = {e.key: e.count for e in prof.key_averages()}
    # q, k and v as one product, gate and up as one (``core.grouping``): four a decoder layer, and the head
    assert counts.get("specviz_rows::group") == 2 * 2 and counts.get("specviz_rows::layer") == 2 * 2 + 1
    assert counts.get("mkldnn::_linear_pointwise") == layers - 2 * 3  # each call's packed product (2 rows > 0)
    assert not {"aten::mm", "aten::addmm", "specviz::packed_linear", "specviz::packed_group"} & set(counts)


def test_a_second_compilation_comes_from_inductors_cache(pair):
    """Nothing frozen into the graph: compiling the same target again (a new process does the same) is a hit in
    inductor's cache of compiled graphs, not minutes of compiling."""
    from torch._dynamo.utils import counters

    compiled, _ = pair
    hits, bypasses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_bypass"]
    again = CapturedForward(compiled.model, compiled._plain, compiled.captured.layout)  # a code object of its own
    assert again.warm(compiled), again.error
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypasses


def test_inductors_cache_goes_under_specviz_cache(monkeypatch, tmp_path):
    """Compiled graphs go to ``<specviz cache>/inductor``, not the temporary folder that ``import torch._dynamo``
    writes into ``TORCHINDUCTOR_CACHE_DIR`` (where a new session may find nothing); a folder the user chose stays."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_folder
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as importing torch._dynamo leaves it
    use_cache_folder()
    assert inductor_folder() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    use_cache_folder()
    assert inductor_folder() == str(tmp_path / "chosen")


def test_two_compiled_targets_keep_their_own_weights(tiny_llama, ref_greedy):
    """Two targets of one class compiled in one process (a base and an adapted one, a second target in the app):
    each decodes with its own weights, although their forwards share Python code and module guards are off."""
    targets = [TargetModel(tiny_llama(vocab_size=64, seed=seed)) for seed in (11, 12)]
    for target in targets:
        assert target.use_engine("compiled").path == "compiled"
    prompt = PROMPTS[1]
    outputs = [run(t, build_drafter("ar", t), prompt, 24).output_ids for t in targets]
    assert outputs == [ref_greedy(t.model, prompt, 24) for t in targets]
    assert outputs[0] != outputs[1]


@pytest.mark.parametrize("method,settings", [("eagle2", dict(depth=4, top_k=3, total_tokens=10)),
                                             ("fspad", dict(depth=1, top_k=4, total_tokens=2))])
def test_captured_feature_drafters_equal_ar(method, settings, pair, ref_greedy, monkeypatch):
    """A feature drafter on a compiled target has its network step and head compiled too (on a CPU where asked),
    before its first decode; its drafts went through them, and the output is still the target's own."""
    compiled, eager = pair
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")
    checkpoint = str(session_checkpoint(eager, method))
    drafter = build_drafter(method, compiled, checkpoint=checkpoint, **settings)
    assert drafter.capture is not None and drafter.capture.ready, drafter.capture.error
    assert build_drafter(method, eager, checkpoint=checkpoint, **settings).capture is None  # the eager baseline
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for prompt in PROMPTS:
        result = run(compiled, drafter, prompt + prompt, 40)
        assert result.output_ids == ref_greedy(compiled.model, prompt + prompt, 40)
    assert drafter.capture.calls > 0 and sum(r.accepted for r in result.records) > 0
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up compiled all a decode asks for


def test_a_captured_drafter_that_breaks_mid_decode_drafts_on_eagerly(pair, ref_greedy, monkeypatch):
    """A drafter graph that breaks while drafting costs no output: the drafter drafts on eagerly, from the cache as
    it was, and says why (the shared capture is restored after the test)."""
    compiled, eager = pair
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")
    drafter = build_drafter("eagle2", compiled, checkpoint=str(session_checkpoint(eager, "eagle2")), depth=3,
                            top_k=3, total_tokens=8)
    drafts_on_after_its_graph_breaks(drafter, "step", compiled, ref_greedy, monkeypatch)


def test_the_target_serves_eager_until_compiled(tiny_llama, ref_greedy):
    """A background compile: the first forwards run eager (the status says so), the output is exact either way,
    and once ready the status says compiled."""
    target = TargetModel(tiny_llama(vocab_size=64, seed=4))
    status = target.use_engine("auto", background=True)
    assert status.path == "eager" and "compiling" in status.detail
    prompt = PROMPTS[0]
    assert run(target, build_drafter("ar", target), prompt, 20).output_ids == ref_greedy(target.model, prompt, 20)
    assert target.captured.wait(600) and target.engine.path == "compiled"
    assert run(target, build_drafter("pld", target), prompt, 20).output_ids == ref_greedy(target.model, prompt, 20)


def test_prefills_stay_eager(pair):
    """One sequence takes the compiled path on a slab cache whose buffers exist (batches: test_capture_batch)."""
    compiled, _ = pair
    fresh = compiled.new_cache(16)
    ids = torch.tensor([[1, 2, 3]])
    assert compiled._captured_for(ids, fresh, None) is None  # nothing allocated yet: the prefill
    compiled.prefill([1, 2, 3], fresh)
    assert compiled._captured_for(ids, fresh, None) is compiled.captured
    assert compiled._captured_for(torch.ones(2, 3, dtype=torch.long), fresh, None) is None


def test_engine_names_are_checked(tiny_target):
    with pytest.raises(SettingsError, match="engine must be one of"):
        tiny_target().use_engine("fast")
    assert tiny_target().use_engine("eager").path == "eager"


def test_soft_capped_logits_keep_the_whole_forward(tiny_llama):
    """A model whose logits are more than head(hidden) is compiled whole, not as decoder then head."""
    model = tiny_llama()
    assert plain_causal_lm(model)
    model.config.final_logit_softcapping = 30.0
    assert not plain_causal_lm(model)


def test_a_bench_label_names_its_engine():
    assert split_engine("ar:engine=eager") == ("ar", "eager")
    assert split_engine("pld:num_tokens=4:engine=eager") == ("pld:num_tokens=4", "eager")
    assert split_engine("eagle2:depth=3") == ("eagle2:depth=3", None)
    for bad in ("ar:engine=fast", "ar:engine=eager:engine=eager"):
        with pytest.raises(SettingsError, match="engine is given once"):
            split_engine(bad)


def test_bench_runs_the_compiled_and_the_eager_path_in_one_run(tmp_path_factory, tmp_path, capsys):
    """``bench --engine compiled`` with ``ar:engine=eager`` and ``pld:engine=eager`` beside ``ar`` and ``pld``:
    every output is AR's, and the results file says which path the target took."""
    folder = str(tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Count to {i}, then back."]}) for i in range(2)))
    out = tmp_path / "r.json"
    assert main(["bench", "--target", folder, "--questions", str(questions), "--engine", "compiled", "--dtype",
                 "float32", "--methods", "ar:engine=eager,pld:engine=eager,pld", "--max-new-tokens", "12",
                 "--out", str(out)]) == 0
    result = BenchResult.load(out)
    assert result.engine.startswith("compiled")
    assert set(result.methods) == {"ar", "ar:engine=eager", "pld:engine=eager", "pld"}
    assert all(row.methods[label].identical_to_ar for row in result.per_prompt for label in result.methods)
    assert main(["bench", "--target", folder, "--questions", str(questions), "--methods", "hf:engine=eager",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "transformers' generate has no engine to choose" in capsys.readouterr().err


def test_the_app_compiles_while_it_serves_and_each_header_names_the_path(tiny_target_dir):
    """``load_state(engine="compiled")`` returns before compilation ends; a race meanwhile is exact and its headers
    say "eager (compiling)"; afterwards they say "compiled", and background tuning has started (after it)."""
    from specviz.apps.race import race
    from specviz.apps.web.plan import plan_race
    from specviz.apps.web.state import load_state
    from specviz.apps.web.views import RaceView

    state = load_state(str(tiny_target_dir), "float32", "cpu", tune="background", methods=["ar", "pld"],
                       engine="compiled")
    target = state.target
    plan = plan_race(state, "Count to ten.", ["ar", "pld"], 12, 0, 1, None)
    view = RaceView(plan, target.text.decode, show_rejected=False, target=target)
    head = view.column("pld")
    assert target.captured.thread_alive(), "compiled before the page could serve: nothing was tested"
    assert "eager (compiling)" in head  # as the page shows it while compilation runs
    for lane in race(target, plan.drafters, plan.ids, 12):  # a race meanwhile (or after: exact either way)
        view.lanes[lane.label] = lane
    assert view.lanes["pld"].output_ids == view.lanes["ar"].output_ids
    assert target.captured.wait(600), target.captured.error
    assert ">compiled</span>" in view.column("pld")
    again = {lane.label: lane for lane in race(target, plan.drafters, plan.ids, 12)}  # each lane's last state
    assert {k: v.output_ids for k, v in again.items()} == {k: v.output_ids for k, v in view.lanes.items()}
    deadline = time.time() + 600
    while state.tuning.mode != "background":  # the tuner starts once compilation has ended
        assert time.time() < deadline
        time.sleep(0.2)


def test_the_app_captures_its_feature_drafters_once_the_target_is_compiled(tiny_target_dir, monkeypatch):
    """In the app a trained feature drafter drafts eager while the target compiles, then gets its own graphs on the
    compile thread; races on either side of that are the target's own output."""
    from specviz.apps.race import race
    from specviz.apps.web.plan import plan_race
    from specviz.apps.web.state import load_state
    from specviz.core.load import load_target

    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")  # a CPU keeps them eager unless asked
    checkpoint = session_checkpoint(load_target(str(tiny_target_dir), "float32", "cpu"), "eagle2")
    state = load_state(str(tiny_target_dir), "float32", "cpu", tune="off", methods=["ar", "eagle2"],
                       engine="compiled", checkpoints={"eagle2": str(checkpoint)})
    drafter = state.drafters["eagle2"]
    assert state.target.captured.thread_alive() and drafter.capture is None  # eager for now
    plan = plan_race(state, "Count to ten.", ["ar", "eagle2"], 16, 0, 1, None)
    before = {lane.label: lane.output_ids for lane in race(state.target, plan.drafters, plan.ids, 16)}
    assert state.target.captured.wait(600), state.target.captured.error  # the thread ends after the drafters
    assert drafter.capture is not None and drafter.capture.ready, drafter.capture and drafter.capture.error
    after = {lane.label: lane.output_ids for lane in race(state.target, plan.drafters, plan.ids, 16)}
    assert before["eagle2"] == before["ar"] == after["eagle2"] == after["ar"]
    assert drafter.capture.calls > 0


def test_where_drafters_are_compiled(pair, monkeypatch):
    """By default only off the CPU (a compiled drafter measured slower than eager on one); the variable decides."""
    compiled, eager = pair
    monkeypatch.delenv("SPECVIZ_DRAFTER_ENGINE", raising=False)
    assert not capture_drafters(compiled) and not capture_drafters(eager)
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "compiled")
    assert capture_drafters(compiled) and not capture_drafters(eager)
    monkeypatch.setenv("SPECVIZ_DRAFTER_ENGINE", "fast")
    with pytest.raises(SettingsError, match="SPECVIZ_DRAFTER_ENGINE"):
        capture_drafters(compiled)
