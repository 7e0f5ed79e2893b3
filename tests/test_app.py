"""The app through gradio_client, on a tiny random target launched in a subprocess (python app.py)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time

import pytest

from drafters import METHODS

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from app_harness import ROOT, RunningApp, free_port  # noqa: E402


@pytest.fixture(scope="module")
def app(tiny_target_dir):
    # a call stops after 5 s of engine time (a note says so): the clamped 512-token call needs no more to show
    # its clamps, and every other call here ends well inside it
    running = RunningApp(tiny_target_dir, SPECVIZ_COMPARE_BUDGET_S="5")
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(app):
    return Client(app.url, verbose=False)


def test_the_address_answers_with_the_stages_while_the_app_loads(app):
    """Before the app serves, its address answers 503 with the starting page, naming the stages as they run."""
    assert app.starting_pages, "the app's address answered nothing before the app itself"
    last = app.starting_pages[-1]
    assert "specviz is starting" in last and "importing torch" in last
    assert any("loading the target" in page or "building the drafters" in page for page in app.starting_pages)


def test_compare_returns_text_origins_and_metrics(client):
    out = client.predict("Say hello.", ["ar", "pld", "skip"], 16, api_name="/compare")
    assert out["notes"] == [] and set(out["methods"]) == {"ar", "pld", "skip"}
    for label, res in out["methods"].items():
        assert len(res["tokens"]) == res["metrics"]["new_tokens"] == 16, label
        assert {t["origin"] for t in res["tokens"]} <= {"accepted draft", "bonus", "correction"}
        assert res["text"] == out["methods"]["ar"]["text"] and res["identical_to_ar"]  # greedy: lossless
    assert res["metrics"]["tau"] >= 1.0


def test_settings_reach_the_drafter(client):
    out = client.predict("Say hello.", ["ar", "skip"], 12, 0.0, 1.0, {"skip": {"layers": 1, "num_tokens": 5}},
                         api_name="/compare")
    skip = out["methods"]["skip"]["metrics"]
    assert skip["mean_tree_size"] > 1 and out["methods"]["skip"]["identical_to_ar"]


@pytest.mark.parametrize("prompt, methods, match", [
    ("", ["ar"], "prompt is empty"),
    ("   ", ["ar"], "prompt is empty"),
    ("hi", [], "at least one"),
    ("hi", ["eagle2"], "eagle2 is unavailable"),  # its checkpoint does not fit the tiny target
    ("hi", ["nonsense"], "unknown method"),
])
def test_bad_input_is_a_clear_error(client, prompt, methods, match):
    with pytest.raises(Exception, match=match):
        client.predict(prompt, methods, 8, api_name="/compare")


def test_a_missing_checkpoint_leaves_the_others_running(client):
    out = client.predict("Hello?", ["ar", "eagle2", "pld"], 6, api_name="/compare")
    assert set(out["methods"]) == {"ar", "pld"}
    assert any(n.startswith("eagle2 is unavailable") for n in out["notes"])


def test_absurd_settings_are_clamped_with_a_note(client):
    out = client.predict("Count.", ["ar", "pld"], 100000, 9.0, -3.0, {"pld": {"num_tokens": 10**6}},
                         api_name="/compare")
    notes = " | ".join(out["notes"])
    assert "max new tokens clamped to 512" in notes and "temperature clamped to 2.0" in notes
    assert "top-p clamped to 0.05" in notes and "pld num_tokens clamped to 64" in notes
    made = out["methods"]["ar"]["metrics"]["new_tokens"]
    assert made == 512 or (made < 512 and "stopped at this API's budget of 5 s" in notes), (made, notes)
    blank = client.predict("Count.", ["ar"], None, api_name="/compare")
    assert "not a number" in blank["notes"][0] and blank["methods"]["ar"]["metrics"]["new_tokens"] == 128


def _wait(condition, seconds=120):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def test_race_streams_and_stop_keeps_what_ran(client):
    job = client.submit("Write a long story.", ["ar", "pld"], 512, 0.0, 1.0, True, api_name="/race")
    assert _wait(lambda: len(job.outputs()) >= 2)  # the start, then the first tokens while it runs
    assert not job.done()
    client.predict(api_name="/stop")  # the Stop button: this session's race ends after the step in progress
    assert _wait(job.done, 30)
    final = job.outputs()[-1]
    ar_column, message = final[0], final[-1]  # columns arrive as plain HTML
    assert "Stopped: ar, pld did not finish" in message
    shown = int(re.search(r"(\d+) / 512 tokens", ar_column).group(1))
    assert 0 < shown < 512 and ar_column.count('class="sv-bonus"') == shown  # the tokens that ran stay on screen
    assert all(isinstance(plot, dict) and plot.get("type") == "plotly" for plot in final[-4:-1])  # and the plots
    out = client.predict("Say hi.", ["ar"], 4, api_name="/compare")  # the engine is free and still exact
    assert out["methods"]["ar"]["metrics"]["new_tokens"] == 4


def test_a_cancelled_client_stops_the_race(client):
    job = client.submit("Write a long story.", ["ar", "pld"], 512, 0.0, 1.0, True, api_name="/race")
    assert _wait(lambda: len(job.outputs()) >= 2)
    job.cancel()  # what a closed browser tab does
    assert _wait(job.done, 30)
    seen = len(job.outputs())
    time.sleep(1.0)
    assert len(job.outputs()) == seen  # nothing arrives after the cancel
    out = client.predict("Say hi.", ["pld"], 4, api_name="/compare")
    assert out["methods"]["pld"]["metrics"]["new_tokens"] == 4


def test_ten_sessions_queue_and_all_finish(app):
    def one(i):
        return Client(app.url, verbose=False).predict(f"Question {i}?", ["ar", "pld"], 12, api_name="/compare")

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    assert all(r["methods"]["ar"]["metrics"]["new_tokens"] == 12 for r in results)
    assert all(r["methods"]["pld"]["identical_to_ar"] for r in results)


@pytest.mark.parametrize("args, expect", [
    (("Count.", ["ar", "pld"], 6, 0.0, 1.0, {"pld": {"checkpoint": "/etc/passwd"}}), "not a setting this page takes"),
    (("Count.", ["ar", "pld"], 6, 0.0, 1.0, {"pld": {"num_tokens": "many"}}), "is not a number"),
    (("Count.", ["ar"], 6, 1e-42, 1.0, None), "below 0.001: used 0"),
    (("Count.", ["ar", "pld"], 6, 0.7, 1.0, None, "greedy"), "would ignore temperature"),
    (("Count.", ["ar"] * 41, 6), "at most 40 methods"),
])
def test_abuse_gets_a_message_and_the_server_goes_on(client, args, expect):
    try:
        out = client.predict(*args, api_name="/compare")
        message = " | ".join(out["notes"])
    except Exception as e:  # noqa: BLE001 - gradio_client raises the server's gr.Error as its own AppError
        message = str(e)
    assert expect in message
    after = client.predict("Say hi.", ["ar"], 3, api_name="/compare")  # and the next request is served
    assert after["methods"]["ar"]["metrics"]["new_tokens"] == 3


def test_a_prompt_that_is_not_utf8_gets_a_message(app, client):
    """Raw JSON can carry a lone surrogate (what bytes that were not UTF-8 become); gradio_client cannot send it."""
    import httpx

    body = '{"data": ["caf\\udce9", ["ar"], 6, 0.0, 1.0, null, "auto", 0, null]}'
    base = app.url.rstrip("/") + "/gradio_api/call/compare"
    event = httpx.post(base, content=body, headers={"Content-Type": "application/json"}).json()["event_id"]
    stream = httpx.get(f"{base}/{event}", timeout=60).text
    assert "event: error" in stream and "not valid UTF-8" in stream
    after = client.predict("Say hi.", ["ar"], 3, api_name="/compare")
    assert after["methods"]["ar"]["metrics"]["new_tokens"] == 3


def test_the_benchmark_tab_takes_no_paths(client):
    with pytest.raises(Exception, match="not in the list of choices|questions must be one of"):
        client.predict("/etc/passwd", "first N", 1, ["ar"], 16, api_name="/benchmark")


def test_benchmark_streams_a_table_per_prompt(client):
    job = client.submit("mt-bench", "first N", 2, ["ar", "pld"], 16, api_name="/benchmark")
    outputs = [o for o in job]
    table, csv, status = outputs[-1]
    statuses = [o[2].splitlines()[0] for o in outputs]  # at once, then after each question: which one runs now
    assert len(outputs) == 3 and statuses[0].startswith("0 of 2 questions done · running question 1 of 2 (")
    assert "1 of 2 questions done" in statuses[1] and "running question 2 of 2" in statuses[1]
    assert "2 of 2 questions done" in status and "running" not in statuses[2]
    assert [row[0] for row in table["data"]] == ["ar", "pld"] and csv


def test_a_full_queue_turns_callers_away_and_the_server_goes_on(tiny_target_dir):
    # each call stops after 3 s of engine time (a note says so): long enough for the four submissions to
    # meet a busy engine, short enough that the running and the queued call do not decode 512 tokens each
    app = RunningApp(tiny_target_dir, SPECVIZ_QUEUE_SIZE="1", SPECVIZ_COMPARE_BUDGET_S="3")
    try:
        client = Client(app.url, verbose=False)
        jobs = [client.submit("Write a long story.", ["ar", "pld"], 512, api_name="/compare") for _ in range(4)]
        errors = []
        for job in jobs:
            try:
                job.result(timeout=300)
            except Exception as e:  # noqa: BLE001 - the queue's refusal arrives as the client's exception
                errors.append(str(e))
        assert errors and all("queue is full" in e.lower() for e in errors), errors
        assert client.predict("Say hi.", ["ar"], 3, api_name="/compare")["methods"]["ar"]["metrics"]["new_tokens"] == 3
    finally:
        app.close()


def test_a_target_that_cannot_load_is_a_clear_exit(tmp_path, monkeypatch):
    env = {**os.environ, "SPECVIZ_TARGET": str(tmp_path / "no-model-here"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "app.py")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "specviz: could not load model" in done.stderr  # said before torch is imported
    assert "no such folder" in done.stderr and "Traceback" not in done.stderr
    import importlib.util  # a folder that is there but holds no model: app.main itself, in this process

    spec = importlib.util.spec_from_file_location("specviz_app", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(free_port()))  # the starting page's address
    with pytest.raises(SystemExit) as stopped:
        module.main(["--target", str(tmp_path), "--tune", "off"])
    assert str(stopped.value).startswith(f"specviz: could not load model '{tmp_path}'")
    args = module.parse_args(["--drafter", "eagle3=./no-such-eagle", "--drafter", "medusa"])
    assert "--drafter 'eagle3=./no-such-eagle': no such folder" in module.missing_folders(args)
    assert "write METHOD=HF_ID_OR_FOLDER" in module.missing_folders(module.parse_args(["--drafter", "medusa"]))
    assert module.parse_args(["--methods", "ar, pld,,eagle2"]).methods == ["ar", "pld", "eagle2"]
    assert module.missing_folders(module.parse_args(["--joint", "./no-joint"])) == "--joint ./no-joint: no such folder"
    with pytest.raises(SystemExit) as stopped:  # said before the target loads
        module.main(["--target", str(tmp_path), "--tune", "off", "--methods", "pld,Eagle2"])
    assert str(stopped.value) == ("specviz: --methods: unknown method 'Eagle2' (choose from "
                                  f"{', '.join(METHODS)})")
