"""The app through gradio_client, on a tiny random target launched in a subprocess."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from app_harness import RunningApp, tiny_target_folder  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tiny_target_folder(tmp_path_factory.mktemp("tiny") / "target")
    running = RunningApp(folder)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(app):
    return Client(app.url, verbose=False)


def test_compare_returns_text_origins_and_metrics(client):
    out = client.predict("Say hello.", ["ar", "pld"], 16, api_name="/compare")
    assert set(out) == {"ar", "pld"}
    for label, res in out.items():
        assert len(res["tokens"]) == res["metrics"]["new_tokens"] == 16, label
        assert {t["origin"] for t in res["tokens"]} <= {"accepted draft", "target"}
        assert res["text"] == out["ar"]["text"]  # greedy: every lossless method equals AR


@pytest.mark.parametrize("prompt, methods, match", [("", ["ar"], "prompt is empty"), ("hi", [], "at least one"),
                                                     ("hi", ["eagle2"], "eagle2")])
def test_bad_input_is_a_clear_error(client, prompt, methods, match):
    with pytest.raises(Exception, match=match):
        client.predict(prompt, methods, 8, api_name="/compare")


def test_absurd_settings_are_clamped_with_a_note(client):
    out = client.predict("Count.", ["ar"], 100000, api_name="/compare")
    assert out["ar"]["metrics"]["new_tokens"] <= 512


def test_stop_cancels_within_a_step(client):
    job = client.submit("Write a long story.", ["ar", "pld"], 512, 0.0, 1.0, True, api_name="/race")
    while job.status().code.name not in ("ITERATING",):
        time.sleep(0.05)
    job.cancel()
    time.sleep(1.0)
    assert job.done()
    out = client.predict("Say hi.", ["ar"], 4, api_name="/compare")  # the app still works
    assert out["ar"]["metrics"]["new_tokens"] == 4


def test_ten_sessions_queue_and_all_finish(app):
    def one(i):
        return Client(app.url, verbose=False).predict(f"Question {i}?", ["ar", "pld"], 12, api_name="/compare")

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    assert all(r["ar"]["metrics"]["new_tokens"] == 12 for r in results)
