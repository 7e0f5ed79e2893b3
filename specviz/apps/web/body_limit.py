"""Requests too large to be real are refused before they are read: an ASGI middleware on the app's server.

The prompt's own limit (``plan.CHARS_PER_TOKEN`` characters per context token) is checked in the handler, but
by then the server has received the whole body and parsed its JSON: a 10 MB prompt cost a tenth of a second
before it was refused. Here a body longer than the largest request the page can need (the longest prompt,
JSON-escaped at up to 12 bytes a character, plus room for the rest) gets ``413`` and a message at once,
from its ``Content-Length``, or as soon as a body sent in chunks passes the limit.
"""

from __future__ import annotations

import json

from .plan import CHARS_PER_TOKEN

ESCAPED_BYTES_PER_CHAR = 12  # a character outside the BMP, JSON-escaped as a surrogate pair: \\ud83c\\udfc1
ROOM = 64 * 1024  # the request's other fields


def max_request_bytes(context_tokens: int) -> int:
    return ESCAPED_BYTES_PER_CHAR * CHARS_PER_TOKEN * context_tokens + ROOM


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if length.isdigit():
            if int(length) > self.max_bytes:
                return await self._refuse(send, int(length))
            return await self.app(scope, receive, send)
        # no length given (a chunked body): read it up to the limit, then hand it on as it came
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, size, more=True)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: int, more: bool = False) -> None:
        over = "over " if more else ""
        body = json.dumps({"error": f"The request has {over}{size:,} bytes; this app takes at most "
                                    f"{self.max_bytes:,} (the longest prompt it can read, and the rest)."}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
