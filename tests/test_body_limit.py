"""Requests larger than the page can need are refused before they are read, with a message; others pass whole."""

from __future__ import annotations

import asyncio
import json

from specviz.apps.web.body_limit import BodyLimit, max_request_bytes
from specviz.apps.web.plan import CHARS_PER_TOKEN


def serve(chunks: list[bytes], length: int | None, max_bytes: int = 100) -> tuple[int, bytes, bytes | None]:
    """Send ``chunks`` through the limit to an app that echoes its body: (status, response body, what the app read)."""
    seen = {}

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    headers = [] if length is None else [(b"content-length", str(length).encode())]
    asyncio.run(BodyLimit(app, max_bytes)({"type": "http", "headers": headers}, receive, send))
    return sent[0]["status"], sent[1]["body"], seen.get("body")


def test_a_declared_length_over_the_limit_is_refused_unread():
    status, body, read = serve([b"x" * 101], 101)
    assert status == 413 and read is None
    assert json.loads(body)["error"].startswith("The request has 101 bytes; this app takes at most 100")


def test_a_chunked_body_is_refused_once_it_passes_the_limit_and_passed_whole_below_it():
    status, body, read = serve([b"x" * 60, b"y" * 60, b"z" * 60], None)
    assert status == 413 and read is None and "over 120 bytes" in json.loads(body)["error"]
    status, body, read = serve([b"x" * 40, b"y" * 40], None)
    assert status == 200 and read == body == b"x" * 40 + b"y" * 40
    status, body, read = serve([b"x" * 100], 100)
    assert status == 200 and read == b"x" * 100


def test_the_limit_holds_the_longest_prompt_escaped_at_its_worst():
    chars = CHARS_PER_TOKEN * 2048
    worst = json.dumps({"data": ["🏁" * chars, ["ar"], 128, 0.0, 1.0, None, "auto"]})  # ensure_ascii: \\ud83c\\udfc1
    assert len(worst.encode()) <= max_request_bytes(2048) < 10_000_000
