"""Server-sent events as OpenAI streams them: `data: <json>\n\n` per chunk, then
`data: [DONE]\n\n`."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def event(payload: dict) -> bytes:
    return b"data: " + _encode(payload).encode() + b"\n\n"


def dumps(payload: dict) -> bytes:
    """Compact JSON bytes (the non-streaming bodies)."""
    return _encode(payload).encode()
