"""The starting page: 503 with the stages while the app loads, and the address free again when it closes."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from app_harness import free_port
from specviz.apps.web.starting import Progress, StartingPage


def answer(port: int) -> urllib.error.HTTPError:
    with pytest.raises(urllib.error.HTTPError) as reply:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/any/path?x=1", timeout=5)
    return reply.value


def test_the_page_names_each_stage_and_says_retry():
    port = free_port()
    with StartingPage("127.0.0.1", port) as page:
        assert page.serving
        page.stage("loading the target")
        page.stage("converting <the> GGUF", expected_s=25)
        reply = answer(port)
        body = reply.read().decode()
        assert reply.code == 503 and reply.headers["Retry-After"] == "2"
        assert "✓ loading the target" in body  # finished, with its time
        assert "… converting &lt;the&gt; GGUF: 0 s of about 25 s" in body  # running, escaped
        assert "location.reload()" in body  # polls until the app answers, then becomes it


def test_closing_frees_the_address_for_the_app():
    port = free_port()
    page = StartingPage("127.0.0.1", port)
    answer(port)
    page.close()
    with socket.socket() as app:  # as Gradio binds it (SO_REUSEADDR)
        app.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        app.bind(("127.0.0.1", port))
    page.close()  # twice is harmless


def test_a_taken_address_skips_the_page_without_failing():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        page = StartingPage("127.0.0.1", other.getsockname()[1])
        assert not page.serving
        page.stage("loading the target")  # still records, for the log
        page.close()


def test_progress_lines_end_each_stage_when_the_next_starts():
    progress = Progress()
    progress.stage("a")
    progress.stage("b", expected_s=3)
    first, second = progress.lines()
    assert first.startswith("✓ a (") and second.startswith("… b: ") and second.endswith("of about 3 s")
