"""Server-sent events: encoding and a streaming response that always closes its source.

`guard_stream` ends a stream that fails midway with the API's error event instead of a cut connection.
`EventStreamResponse` streams an async generator of already-encoded events. When the client
disconnects, Starlette cancels the send loop; the response then closes the generator (shielded from
the cancellation), so that the generator's own ``finally`` closes the engine's generator and the
engine aborts the request.
"""

from __future__ import annotations

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
) -> AsyncGenerator[bytes, None]:
    """Pass `events` through; if it raises, log and end with `error_events(err)` instead.

    An `ApiError` is sent as it is; any other exception is logged with its traceback and sent as a
    500 internal_error. `events` is closed on every exit.
    """
    try:
        async for event in events:
            yield event
    except ApiError as err:
        logger.warning("request %s failed mid-stream: %s", request_id, err.message)
        for event in error_events(err):
            yield event
    except Exception:
        logger.exception("request %s failed mid-stream", request_id)
        err = ApiError(500, ErrorCode.INTERNAL_ERROR, "internal server error; see the server log")
        for event in error_events(err):
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
