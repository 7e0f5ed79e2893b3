"""The page a visitor sees while the app starts, served on the app's own address until the app takes it over.

Loading the target (and, on a fresh machine, converting the embedded GGUF once) takes tens of seconds before
Gradio can serve. Meanwhile this standard-library server answers every request with ``503 Service
Unavailable`` (so health checks and API clients know to retry, ``Retry-After``) and a page that names each
stage with its elapsed time and reloads itself until the app answers. It imports nothing heavy: ``app.py``
starts it before torch and Gradio are imported.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REFRESH_S = 2
# Poll rather than reload: between this server closing and the app binding the address, a reload would land
# on the browser's own error page and stop there.
POLL_JS = f"""<script>
setInterval(async () => {{
  try {{
    const reply = await fetch(location.href, {{cache: "no-store"}});
    if (reply.ok) return location.reload();
    const next = new DOMParser().parseFromString(await reply.text(), "text/html").getElementById("stages");
    if (next) document.getElementById("stages").innerHTML = next.innerHTML;
  }} catch (error) {{}}
}}, {REFRESH_S * 1000});
</script>"""


@dataclass
class Stage:
    text: str
    expected_s: float | None = None  # a rough figure, said as "about" on the page
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def line(self, now: float) -> str:
        elapsed = (self.ended or now) - self.started
        if self.ended is not None:
            return f"✓ {self.text} ({elapsed:.0f} s)"
        about = f" of about {self.expected_s:.0f} s" if self.expected_s else ""
        return f"… {self.text}: {elapsed:.0f} s{about}"


@dataclass
class Progress:
    """What the page says: the stages so far, the last one running. Thread-safe for one writer."""
    stages: list[Stage] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def stage(self, text: str, expected_s: float | None = None) -> None:
        now = time.monotonic()
        if self.stages and self.stages[-1].ended is None:
            self.stages[-1].ended = now
        self.stages.append(Stage(text, expected_s, started=now))

    def lines(self) -> list[str]:
        now = time.monotonic()
        return [stage.line(now) for stage in self.stages]

    def page(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines())
        return ("<!doctype html><html><head><meta charset='utf-8'><title>specviz is starting</title>"
                f"<noscript><meta http-equiv='refresh' content='{REFRESH_S}'></noscript></head>"
                "<body style='font-family: sans-serif; margin: 3em'><h1>specviz is starting</h1>"
                f"<div id='stages'><p>{time.monotonic() - self.started:.0f} s so far. This page becomes the app "
                f"when it is ready.</p><ul>{items}</ul></div>{POLL_JS}</body></html>")


class StartingPage:
    """Serve ``progress`` on ``host:port`` from a daemon thread until ``close()``. Where the address is taken
    the page is skipped (``serving`` is False) and the app's own launch reports the clash."""

    def __init__(self, host: str, port: int, progress: Progress | None = None):
        self.progress = progress or Progress()
        page = self.progress

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server naming
                body = page.page().encode()
                self.send_response(503)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Retry-After", str(REFRESH_S))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_POST = do_GET  # noqa: N815

            def log_message(self, *args) -> None:  # quiet: the app's own log says what happens
                pass

        try:
            self.server: ThreadingHTTPServer | None = ThreadingHTTPServer((host, port), Handler)
        except OSError as error:
            print(f"specviz: no starting page on {host}:{port} ({error.strerror})", flush=True)
            self.server = None
            return
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="starting-page", daemon=True).start()

    @property
    def serving(self) -> bool:
        return self.server is not None

    def stage(self, text: str, expected_s: float | None = None) -> None:
        print(f"specviz: {text}...", flush=True)
        self.progress.stage(text, expected_s)

    def close(self) -> None:
        """Stop serving and free the address for the app."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def __enter__(self) -> StartingPage:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
