"""The cache routes: `GET /v1/cache` (the expert-slot cache and the KV cache now, and the memory headroom) and
`POST /v1/cache/resize` (resize either or both while serving: `freetoken.engine.resize`); what `ft ctl cache`
calls. Both sit behind the API key like the rest of /v1.

`POST /v1/cache/resize` takes a JSON object with ``expert_gb`` (or ``expert_slots``) and/or ``kv_gb`` (or
``kv_blocks``) and answers when the resize is done: 200 with the sizes before and after; 400 for a body that is
not such an object; 422 (code ``resize_refused``) for a resize that cannot be done here, refused before anything
changed; 409 (``resize_in_progress``) while another runs; 503 (``resize_rolled_back``) when an allocation failed
and both caches went back to their old sizes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.resize import (
    ResizeConflict,
    ResizeError,
    ResizeRolledBack,
    headroom_bytes,
)
from freetoken.server.errors import ApiError, ErrorCode, invalid_request
from freetoken.server.schema import parse_json_object, read_body

log = logging.getLogger(__name__)

# Body field -> whether it counts (int) or measures (GB, a number).
RESIZE_FIELDS = {"expert_gb": float, "kv_gb": float, "expert_slots": int, "kv_blocks": int}


async def get_cache(request: Request) -> Response:
    """``GET /v1/cache``: `freetoken.engine.resize.cache_sizes` as of the last step, the memory headroom a resize
    may use (``budget``: ``headroom_gb`` and what bounds it) and whether a resize is running."""
    engine = request.app.state.engine
    body: dict[str, Any] = dict(engine.stats().get("cache") or {})
    headroom, bound = headroom_bytes(engine.engine)
    body["budget"] = {"headroom_gb": None if headroom is None else round(headroom / 1e9, 4), "bounded_by": bound}
    body["resizing"] = engine.resizing
    return JSONResponse(body)


def parse_resize(body: dict[str, Any]) -> dict[str, float | int]:
    """The keyword arguments of `resize` from a request body.

    Raises:
        ApiError: 400 naming the field: unknown, of the wrong type, not positive, or none given.
    """
    unknown = sorted(set(body) - set(RESIZE_FIELDS))
    if unknown:
        raise invalid_request(
            ErrorCode.INVALID_VALUE, f"unknown field {unknown[0]!r}; expected {', '.join(RESIZE_FIELDS)}", unknown[0]
        )
    sizes: dict[str, float | int] = {}
    for name, kind in RESIZE_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            raise invalid_request(
                ErrorCode.INVALID_TYPE,
                f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                name,
            )
        if not math.isfinite(value) or value <= 0:
            raise invalid_request(ErrorCode.INVALID_VALUE, f"{name} must be > 0, got {value!r}", name)
        sizes[name] = kind(value)
    if not sizes:
        raise invalid_request(ErrorCode.MISSING_FIELD, "give expert_gb (or expert_slots) and/or kv_gb (or kv_blocks)")
    return sizes


async def resize_cache(request: Request) -> Response:
    """``POST /v1/cache/resize``: resize at the engine's next safe point and answer when done (see the module)."""
    sizes = parse_resize(parse_json_object(await read_body(request)))
    try:
        answer = await request.app.state.engine.resize_cache(**sizes)
    except ResizeError as exc:
        code = (
            ErrorCode.RESIZE_IN_PROGRESS
            if isinstance(exc, ResizeConflict)
            else ErrorCode.RESIZE_ROLLED_BACK
            if isinstance(exc, ResizeRolledBack)
            else ErrorCode.RESIZE_REFUSED
        )
        log.info("cache resize %s: %s", code.value, exc)
        raise ApiError(exc.status, code, str(exc)) from None
    return JSONResponse(answer)
