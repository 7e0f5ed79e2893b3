"""Reliability: the app (python app.py on a tiny target, 127.0.0.1 only) under generated malformed calls from 8
callers at once, 10 MB prompts, cancelled streams, a truncated checkpoint and a full cache disk; then two first
starts at once on one empty cache. Every case must end in a result or an error that says what was wrong; after
each burst the next request is served. The summary goes to ``artifacts/reliability.json`` (committed, with its
machine and date, as ``assets/bench/reliability.json``)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import random
import shutil
import threading
import time
from datetime import date
from pathlib import Path

import pytest

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from reliability import BAD, GOOD, Case, Outcome, Summary, call, generated_cases, huge_case  # noqa: E402

from app_harness import ROOT, RunningApp  # noqa: E402

FAULTS = Path(__file__).parent / "faults"  # sitecustomize: a full or read-only disk for the app under test
ARTIFACTS = Path(os.environ.get("SPECVIZ_ARTIFACTS", ROOT / "artifacts"))
SUMMARY = Summary()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024


def served(app: RunningApp) -> bool:
    """The engine is free again: a good call gets its tokens."""
    out = Client(app.url, verbose=False).predict("Say hi.", ["ar"], 3, api_name="/compare")
    return out["methods"]["ar"]["metrics"]["new_tokens"] == 3


@pytest.fixture(scope="module")
def app(tiny_target_dir, tmp_path_factory):
    """Background tuning on a cache whose disk is full, and an eagle2 checkpoint cut off mid-file."""
    drafters = tmp_path_factory.mktemp("drafters")
    shutil.copytree(ROOT / "assets" / "drafters" / "eagle2", drafters / "eagle2")
    weights = drafters / "eagle2" / "weights.safetensors.xz"
    weights.write_bytes(weights.read_bytes()[:4096])  # cut off mid-file
    cache = tmp_path_factory.mktemp("full-cache")
    running = RunningApp(tiny_target_dir, SPECVIZ_TUNE="background", SPECVIZ_CACHE=str(cache),
                         SPECVIZ_DRAFTERS=str(drafters), SPECVIZ_TEST_DISK_FAULT=f"full:{cache}",
                         SPECVIZ_COMPARE_BUDGET_S="0.5",  # a call clamped to 512 tokens stops there, with a note
                         SPECVIZ_METHODS="ar,pld,skip,eagle2",  # what the cases name; two of them to tune
                         PYTHONPATH=f"{FAULTS}{os.pathsep}{ROOT}")
    yield running
    running.close()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    from specviz.apps.machine import machine_fingerprint

    SUMMARY.extra.update(date=str(date.today()), machine=machine_fingerprint())
    (ARTIFACTS / "reliability.json").write_text(json.dumps(SUMMARY.as_dict(), indent=1))


def tuned_line(app, client=None) -> str:
    """The app's tuning line once its background tuning has ended (within 10 minutes)."""
    client = client or Client(app.url, verbose=False)
    deadline = time.time() + 600
    while "tuned for this machine" not in (line := client.predict("Say hi.", ["ar"], 2, api_name="/compare")["tuning"]):
        assert time.time() < deadline, line  # the tuning chain did not die on the full disk
        time.sleep(1)
    return line


def test_generated_malformed_calls_each_get_a_result_or_a_message(app):
    cases = generated_cases(rounds=2)
    assert len(cases) >= 150
    tuned_line(app)  # the background tuner's own working set is not the requests': measure after it has ended
    before = rss_mb(app.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 callers at once
        outcomes = list(pool.map(lambda case: call(app.url, case), cases))
    SUMMARY.add(outcomes)
    assert [o for o in outcomes if o.failed] == []
    assert {o.kind for o in outcomes} == {"served", "message"}  # both kinds really occur
    too_few = {o.case: o.message for o in outcomes if o.case in ("0-arguments", "1-arguments")}
    assert too_few and all("enough input values" in m for m in too_few.values()), too_few
    assert served(app)
    after = rss_mb(app.proc.pid)
    assert after - before < 300, (before, after)  # the drafters built at the burst's settings (an LRU), no more
    again = [case for case in cases if not case.name.startswith("pair")]  # the burst's own settings once more

    def repeat() -> float:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda case: call(app.url, case), again))
        SUMMARY.add(outcomes)
        assert [o for o in outcomes if o.failed] == [] and served(app)
        return rss_mb(app.proc.pid)

    steady = repeat()
    rss = [round(before), round(after), round(steady)]
    if steady - after >= 64:  # the allocator's arenas may still settle on a first repeat; a leak grows on every one
        after, steady = steady, repeat()
        rss.append(round(steady))
    SUMMARY.extra["rss_mb_before_after_burst_after_repeats"] = rss
    assert steady - after < 64, rss  # a repeat keeps nothing: no request leaks memory


def test_a_well_behaved_caller_is_served_while_four_others_abuse(app):
    stop, abuse = threading.Event(), []
    bad = [c for c in generated_cases(seed=1) if "arg0" not in c.name]

    def abuser(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            abuse.append(call(app.url, huge_case(i) if rng.random() < 0.5 else rng.choice(bad)))

    alone = [call(app.url, huge_case(i)) for i in range(3)]  # before the abuse: the refusal's own time
    assert all(o.kind == "message" for o in alone), alone[:1]
    SUMMARY.add(alone)
    SUMMARY.extra["huge_prompt_refused_alone_s"] = round(min(o.seconds for o in alone), 3)
    client = Client(app.url, verbose=False)
    firsts = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i in range(4):
            pool.submit(abuser, i)
        try:
            time.sleep(1.0)  # the abuse is under way
            for i in range(3):
                start = time.perf_counter()
                job = client.submit(f"Tell me about the number {i}.", ["ar", "pld"], 24, 0.0, 1.0, True,
                                    api_name="/race")
                while len(job.outputs()) < 2 and not job.done():  # the start, then the first tokens
                    time.sleep(0.01)
                firsts.append(time.perf_counter() - start)
                job.result(timeout=120)
        finally:
            stop.set()
    SUMMARY.add(abuse)
    assert abuse and [o for o in abuse if o.failed] == []
    huge = [o for o in abuse if o.case.startswith("10MB")]
    assert huge and all("bytes; this app takes at most" in o.message for o in huge), huge[:1]
    SUMMARY.max_good_first_token_s = round(max(firsts), 3)
    SUMMARY.huge_prompt_refused_s = round(max(o.seconds for o in huge), 3)
    SUMMARY.extra["huge_prompts_refused"] = len(huge)
    assert served(app)


def test_cancelled_streams_free_the_engine(app):
    client = Client(app.url, verbose=False)
    for i in range(3):
        job = client.submit("Write a long story.", ["ar", "pld"], 512, 0.0, 1.0, True, api_name="/race")
        deadline = time.time() + 120
        while len(job.outputs()) < 2 and time.time() < deadline:
            time.sleep(0.02)
        job.cancel()  # what a closed tab does
        ok = served(app)
        SUMMARY.add([Outcome(f"cancel-mid-stream-{i}", "served" if ok else "hang", "", 0.0)])
        assert ok


def test_a_truncated_checkpoint_and_a_full_cache_leave_the_rest_working(app):
    client = Client(app.url, verbose=False)
    out = client.predict("Count.", ["ar", "eagle2", "pld"], 6, api_name="/compare")
    note = next(n for n in out["notes"] if n.startswith("eagle2 is unavailable"))
    assert "could not be built" in note or "checkpoint" in note, note
    assert set(out["methods"]) == {"ar", "pld"}
    line = tuned_line(app, client)
    assert "Not tuned" not in line, line  # every budget measured, used though it could not be cached
    SUMMARY.add([Outcome("truncated-checkpoint", "message", note, 0.0),
                 Outcome("full-cache-disk-tuning", "served", line, 0.0)])


def test_two_first_starts_at_once_on_one_empty_cache(tiny_target_dir, tmp_path):
    """Both serve before any budget is measured (a call meanwhile runs untuned and says so), both finish tuning
    though they write the same files, and every file they leave is whole."""
    cache = tmp_path / "cache"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        apps = list(pool.map(lambda _: RunningApp(tiny_target_dir, SPECVIZ_TUNE="background",
                                                  SPECVIZ_CACHE=str(cache)), range(2)))
    try:  # both first calls at once: one after the other, the second may come after its app's short tuning
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            firsts = list(pool.map(lambda running: Client(running.url, verbose=False).predict(
                "Say hello.", ["ar", "pld"], 8, api_name="/compare"), apps))
        assert all(first["methods"]["pld"]["identical_to_ar"] for first in firsts)
        # each served while it tuned; pld (the first method it tunes, or read from the other's cache) said which
        assert all("in the background" in first["tuning"] for first in firsts), [f["tuning"] for f in firsts]
        assert {first["methods"]["pld"]["budget"] for first in firsts} <= {"untuned", "tuned"}
        for running in apps:
            client, deadline = Client(running.url, verbose=False), time.time() + 600
            while "tuned for this machine" not in (last := client.predict("Say hi.", ["ar", "pld"], 4,
                                                                           api_name="/compare"))["tuning"]:
                assert time.time() < deadline, last["tuning"]
                time.sleep(1)
            assert last["methods"]["pld"]["budget"] == "tuned" and last["methods"]["pld"]["identical_to_ar"]
            given = client.predict("Say hi.", ["pld"], 4, 0.0, 1.0, {"pld": {"num_tokens": 37}},  # not in its grid
                                   api_name="/compare")
            assert given["methods"]["pld"]["budget"] == "as given"
    finally:
        for running in apps:
            running.close()
    files = list((cache / "budgets").glob("*.json"))
    assert files and all(isinstance(json.loads(f.read_text()), dict) for f in files)
    assert not list((cache / "budgets").glob(".*partial"))
    SUMMARY.add([Outcome("two-first-starts-at-once", "served", f"{len(files)} budget files, all whole", 0.0)])


@pytest.fixture(scope="module")
def state(tiny_target_dir):
    from specviz.apps.web.state import load_state

    return load_state(str(tiny_target_dir), "float32", "cpu", tune="off")


def test_a_drafter_that_raises_mid_run_ends_its_column_and_the_next_call_is_served(state, monkeypatch):
    """Through the API's own handler (in this process, to plant the fault): pld breaks at its fourth draft."""
    from specviz.apps.web.handlers import Handlers
    from specviz.apps.web.plan import setting_specs

    handlers, pld, calls = Handlers(state, setting_specs(state)), state.drafters["pld"], []
    real = pld.propose

    def breaks(decode, request):
        calls.append(1)
        if len(calls) > 3:
            raise IndexError("index 70000 is out of bounds for dimension 0 with size 49152")
        return real(decode, request)

    monkeypatch.setattr(pld, "propose", breaks)
    out = handlers.compare("Count to ten.", ["ar", "pld"], 24)
    assert out["methods"]["pld"]["error"] == "IndexError: index 70000 is out of bounds for dimension 0 with size 49152"
    assert out["methods"]["ar"]["metrics"]["new_tokens"] == 24 and out["methods"]["ar"]["error"] is None
    monkeypatch.undo()
    again = handlers.compare("Count to ten.", ["ar", "pld"], 24)  # the engine thread is free, the drafter whole
    assert again["methods"]["pld"]["error"] is None and again["methods"]["pld"]["identical_to_ar"]
    SUMMARY.add([Outcome("drafter-raises-mid-run", "message", out["methods"]["pld"]["error"], 0.0),
                 Outcome("served-after-the-raise", "served", "", 0.0)])


def test_a_read_only_cache_tunes_all_the_same(state, tmp_path, monkeypatch):
    """The cache folder cannot be created or written (EROFS): the budget is measured and used, and nothing breaks."""
    import errno

    from specviz.apps import tuning

    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "atomic_write", read_only)
    tuned = tuning.tune(state.target, "pld")
    assert tuned.seconds > 0 and tuned.settings and not (tmp_path / "cache" / "budgets").exists()
    SUMMARY.add([Outcome("read-only-cache-tuning", "served", tuned.describe(), 0.0)])


def test_the_cases_cover_every_argument():
    assert set(BAD) == set(range(len(GOOD)))
    cases = generated_cases()
    assert all(isinstance(c, Case) for c in cases)
    met = {tuple(int(a[3:]) for a in c.name.split("-")[1:]) for c in cases if c.name.startswith("pair")}
    assert met == set(itertools.combinations(sorted(BAD), 2))  # every pair of positions meets
