"""Log lines that say what the server did with a request beyond serving it as asked, without flooding the log.

- `note_once_per_process`: for what every request of a harness repeats (a field this server ignores): the first
  time only, keyed by what it is about.
- `note_once_per_request`: for what one request holds many of (twelve images in a history): one line per
  request and key. `request_notes` opens the per-request scope; the server's middleware wraps every request in
  it (outside one, the line is logged every time).
- `note_unknown_fields`: the top-level fields of a body that an endpoint does not know, once per process each.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger("freetoken.server")

_process_keys: set[str] = set()
_process_lock = threading.Lock()
_request_keys: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("freetoken_request_notes", default=None)


def note_once_per_process(key: str, message: str, *args: Any) -> None:
    """Log `message % args` (INFO) the first time `key` is noted in this process."""
    with _process_lock:
        if key in _process_keys:
            return
        _process_keys.add(key)
    logger.info(message, *args)


@contextlib.contextmanager
def request_notes() -> Iterator[None]:
    """The scope of one request for `note_once_per_request`."""
    token = _request_keys.set(set())
    try:
        yield
    finally:
        _request_keys.reset(token)


def note_once_per_request(key: str, message: str, *args: Any) -> None:
    """Log `message % args` (INFO) the first time `key` is noted in the current request."""
    keys = _request_keys.get()
    if keys is not None:
        if key in keys:
            return
        keys.add(key)
    logger.info(message, *args)


def note_unknown_fields(body: dict[str, Any], known: Iterable[str], endpoint: str) -> None:
    """Log each top-level field of `body` not in `known` (which the endpoint then ignores), once per process."""
    known = frozenset(known)
    for key in body:
        if key not in known:
            note_once_per_process(
                f"{endpoint}:{key}",
                "%s: field %r is not known to this server and is ignored (logged once)",
                endpoint,
                key,
            )


def omitted(kind: str, detail: str = "") -> str:
    """The placeholder text that stands in a prompt for content this text-only model cannot read (an image, a PDF),
    so the request is served and the model knows something was there; logged once per request and kind.

    Args:
        kind: what was dropped: "image", "document", "file", "audio".
        detail: what the client said it was (a media type, a title), or "".
    """
    note_once_per_request(
        f"omitted:{kind}", "%s content replaced by a text placeholder: this model reads text only", kind
    )
    what = f"{kind} ({detail})" if detail else kind
    return f"[{what} omitted: this model reads text only]"
