"""API-shaped errors for the OpenAI and Anthropic surfaces.

One exception type, `ApiError`, carries an HTTP status, a stable `code` (the same for both APIs,
listed in `ErrorCode`), a message that names the offending field and how to fix it, and the field
path (`param`). `openai_error_body` and `anthropic_error_body` render it in each API's own shape:

- OpenAI: ``{"error": {"message", "type", "param", "code"}}``
- Anthropic: ``{"type": "error", "error": {"type", "message", "code"}}`` (``code`` is an extra field
  the SDKs ignore; the message is prefixed with the field path, as Anthropic's own are).

This module owns no routing; `app.py` decides which shape a request gets (`ApiFlavor`).
"""

from __future__ import annotations

import enum
from typing import Any

from freetoken.errors import FreetokenError


class ApiFlavor(enum.Enum):
    """Which API's error shape a request gets."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ErrorCode(str, enum.Enum):
    """Stable error codes, the same in both APIs' bodies."""

    INVALID_JSON = "invalid_json"
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    MISSING_FIELD = "missing_field"
    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    UNSUPPORTED = "unsupported"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    TEMPLATE_ERROR = "template_error"
    INVALID_API_KEY = "invalid_api_key"
    UNKNOWN_URL = "unknown_url"
    MODEL_NOT_FOUND = "model_not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_ABORTED = "request_aborted"
    INTERNAL_ERROR = "internal_error"
    RESIZE_REFUSED = "resize_refused"
    RESIZE_IN_PROGRESS = "resize_in_progress"
    RESIZE_ROLLED_BACK = "resize_rolled_back"


# status -> (OpenAI error type, Anthropic error type)
_TYPES_BY_STATUS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("invalid_request_error", "invalid_request_error"),
    409: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    422: ("invalid_request_error", "invalid_request_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


# Messages echo what the client sent (a model name, a response id, a role, a value); a client can send 100 KB of it,
# which the answer and the log line would repeat. Past this many characters the middle is cut, keeping the start
# (what is wrong) and the end (the fix the message suggests).
MAX_MESSAGE_CHARS = 1000


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` itself, or, when it is longer than `limit` characters, its first 3/4 and last 1/5 of `limit` with the
    number of characters cut between them."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 5
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[-tail:]}"


class ApiError(FreetokenError):
    """An error answered to the client in the API's own shape.

    Attributes:
        status: HTTP status code.
        code: stable error code.
        message: human-readable message naming the field and the fix.
        param: the field path (``messages[0].content``), or None.
        verbatim: the message is in the API's own wording, which clients match (Anthropic's "prompt is too
            long: ..."): it is sent as it is, without the field path in front.
    """

    def __init__(
        self, status: int, code: ErrorCode, message: str, param: str | None = None, *, verbatim: bool = False
    ) -> None:
        message = bounded(message)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.verbatim = verbatim

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code.value}, {self.message!r}, param={self.param!r})"


def invalid_request(code: ErrorCode, message: str, param: str | None = None, *, verbatim: bool = False) -> ApiError:
    """A 400 invalid-request error about `param` (`verbatim`: see `ApiError`)."""
    return ApiError(400, code, message, param, verbatim=verbatim)


def openai_error_body(err: ApiError) -> dict[str, Any]:
    """The OpenAI error body for `err`."""
    openai_type = _TYPES_BY_STATUS.get(err.status, _TYPES_BY_STATUS[500])[0]
    return {
        "error": {
            "message": err.message,
            "type": openai_type,
            "param": err.param,
            "code": err.code.value,
        }
    }


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """The Anthropic error body (also the payload of a streamed ``error`` event) for `err`."""
    anthropic_type = _TYPES_BY_STATUS.get(err.status, _TYPES_BY_STATUS[500])[1]
    message = err.message
    if err.param and not err.verbatim and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return {
        "type": "error",
        "error": {"type": anthropic_type, "message": message, "code": err.code.value},
    }


def error_body(err: ApiError, flavor: ApiFlavor) -> dict[str, Any]:
    """The error body for `err` in `flavor`'s shape."""
    if flavor is ApiFlavor.ANTHROPIC:
        return anthropic_error_body(err)
    return openai_error_body(err)
