"""Server-sent events: encoding and a streaming response that always closes its source.

`guard_stream` ends a stream that fails midway with the API's error event instead of a cut connection, and sends a
keep-alive (an SSE comment, or the API's own ping event) whenever the stream has been idle for `KEEPALIVE_S`: a
long prompt prefills for minutes on a big model, and a client with an idle watchdog must not give up on it.
`EventStreamResponse` streams an async generator of already-encoded events. When the client
disconnects, Starlette cancels the send loop; the response then closes the generator (shielded from
the cancellation), so that the generator's own ``finally`` closes the engine's generator and the
engine aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from freetoken.server.errors import ApiError, ErrorCode

logger = logging.getLogger("freetoken.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

OPENAI_DONE = b"data: [DONE]\n\n"

# Seconds without an event after which a stream sends a keep-alive (Anthropic's API pings about this often; Codex
# and Claude Code give up on a stream idle for minutes).
KEEPALIVE_S = 5.0
# The keep-alive of the OpenAI APIs: an SSE comment, which every SSE parser skips (the OpenAI SDK, Codex).
SSE_COMMENT_KEEPALIVE = b": keep-alive\n\n"


def sse_data(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event (the OpenAI style: no event name)."""
    return b"data: " + _dumps(payload) + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """One named event (the Anthropic style: ``event: <type>`` then ``data:``)."""
    return b"event: " + event.encode() + b"\ndata: " + _dumps(payload) + b"\n\n"


def _dumps(payload: dict[str, Any]) -> bytes:
    # ensure_ascii=False keeps text as UTF-8; json escapes newlines, so one event is one data line.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of encoded events."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers={**SSE_HEADERS, **(headers or {})})
        self._events = events

    async def stream_response(self, send: Send) -> None:
        """Send every event; close the event generator on any exit (end, error, disconnect)."""
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


async def guard_stream(
    events: AsyncGenerator[bytes, None],
    request_id: str,
    error_events: Callable[[ApiError], list[bytes]],
    keepalive: bytes = SSE_COMMENT_KEEPALIVE,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncGenerator[bytes, None]:
    """Pass `events` through, with `keepalive` whenever none came for `keepalive_s`; if `events` raises, log and end
    with `error_events(err)` instead.

    An `ApiError` is sent as it is; any other exception is logged with its traceback and sent as a
    500 internal_error. `events` is closed on every exit.
    """
    try:
        async for event in _with_keepalive(events, keepalive, keepalive_s):
            yield event
    except ApiError as err:
        logger.warning("request %s failed mid-stream: %s", request_id, err.message)
        for event in error_events(err):
            yield event
    except Exception:
        logger.exception("request %s failed mid-stream", request_id)
        internal = ApiError(500, ErrorCode.INTERNAL_ERROR, "internal server error; see the server log")
        for event in error_events(internal):
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()


async def _with_keepalive(
    events: AsyncGenerator[bytes, None], keepalive: bytes, keepalive_s: float
) -> AsyncGenerator[bytes, None]:
    """`events`, with `keepalive` after every `keepalive_s` without one. The next event is awaited in a task (so
    waiting can time out without cancelling it); on any exit that task is cancelled and awaited, then `events` is
    closed."""
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield keepalive
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await events.aclose()
