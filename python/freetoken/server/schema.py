"""Request-body validation shared by both APIs: JSON parsing and typed field access.

Every failure raises `ApiError` (400) naming the field path (``messages[2].content``) and what was
expected, so each API module states its schema as a short run of `get_*` calls. JSON ``null`` counts
as absent for optional fields (both APIs' SDKs send ``null`` for unset values in places).
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
import zlib
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from freetoken.server.errors import ApiError, ErrorCode, invalid_request

_MISSING = object()

_TYPE_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a finite number",
    list: "an array",
    dict: "an object",
}


# Far above any prompt the context holds (a 128k-token conversation is a few MB of JSON), far below what would
# stall the server while it is read and parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024


# Content-Encoding values a request body may come in (RFC 9110 section 8.4.1), with zlib's window bits for each:
# gzip's header and trailer, or deflate's zlib wrapper (RFC 9110 section 8.4.1.2: "deflate" is zlib-wrapped).
_BODY_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def read_body(request: Any) -> bytes:
    """The request body, refused with a 413 once it passes MAX_BODY_BYTES (by Content-Length, or while read), and
    decoded from its Content-Encoding (gzip or deflate; the decoded body is held to the same limit, so a small
    compressed body cannot expand without bound).

    Raises:
        ApiError: 413 past the limit; 415 for another Content-Encoding; 400 for a body its encoding cannot decode.
    """
    too_large = ApiError(
        413, ErrorCode.REQUEST_TOO_LARGE, f"request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB"
    )
    # Codings in the order applied; decoded in reverse. Checked before the body is read: an unknown one is refused.
    codings = [c.strip().lower() for c in request.headers.get("content-encoding", "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    unknown = [c for c in codings if c not in _BODY_ENCODINGS]
    if unknown:
        raise ApiError(
            415,
            ErrorCode.UNSUPPORTED,
            f"Content-Encoding {unknown[0]!r} is not supported; send the body uncompressed, gzip or deflate",
            param="content-encoding",
        )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    for coding in reversed(codings):
        decoder = zlib.decompressobj(wbits=_BODY_ENCODINGS[coding])
        try:
            decoded = decoder.decompress(body, MAX_BODY_BYTES + 1)
        except zlib.error as exc:
            raise invalid_request(ErrorCode.INVALID_VALUE, f"request body is not valid {coding}: {exc}") from None
        if len(decoded) > MAX_BODY_BYTES:
            raise too_large
        if not decoder.eof:
            raise invalid_request(ErrorCode.INVALID_VALUE, f"request body is not valid {coding}: it is cut short")
        body = decoded
    return body


# A \u escape of a UTF-16 surrogate: only a body holding one can decode to a string that is not valid Unicode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body that must be one JSON object.

    NaN and Infinity literals (Python's json takes them, JSON has none) and lone UTF-16 surrogates
    (``"\\ud800"``, which no UTF-8 text holds) are refused with a 400 naming the field, and their raw
    bytes as invalid JSON: either would otherwise fail later, where a response echoes or encodes the value.
    """
    if not raw.strip():
        raise invalid_request(ErrorCode.INVALID_JSON, "request body is empty; send a JSON object")
    constants: list[str] = []

    def parse_constant(name: str) -> float:
        constants.append(name)
        return float(name)

    try:
        # Decoded strictly: json.loads(bytes) lets the UTF-8 bytes of a lone surrogate through.
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text, parse_constant=parse_constant)
    except RecursionError:
        raise invalid_request(ErrorCode.INVALID_JSON, "request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer literal past int's digit limit
        raise invalid_request(ErrorCode.INVALID_JSON, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request(ErrorCode.INVALID_JSON, f"request body must be a JSON object, got {_json_type(body)}")
    if constants or _SURROGATE_ESCAPE.search(text):
        _check_values(body)
    return body


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_values(body: dict[str, Any]) -> None:
    """Refuse the first non-finite number or string with a lone surrogate (a key too) in `body`, by path."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid_request(
                ErrorCode.INVALID_VALUE, f"{path or 'body'} must be a finite number, got {value!r}", path or None
            )
        if isinstance(value, str) and not _is_unicode(value):
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"{path or 'body'} holds a lone UTF-16 surrogate; send valid Unicode text",
                path or None,
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    raise invalid_request(
                        ErrorCode.INVALID_VALUE,
                        f"{path or 'body'} has a key with a lone UTF-16 surrogate; send valid Unicode text",
                        path or None,
                    )
                stack.append((join_path(path, key), item))
        elif isinstance(value, list):
            stack.extend((join_path(path, i), item) for i, item in enumerate(value))


def join_path(parent: str, key: str | int) -> str:
    """The path of `key` under `parent`: ``messages`` + 0 -> ``messages[0]``, + ``role`` -> ``messages[0].role``."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else repr(value)  # NaN / Infinity are not JSON numbers
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _matches(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            return False
    return isinstance(value, kind)


def wrong_type(path: str, expected: str, value: Any) -> ApiError:
    """The error for a field of the wrong JSON type."""
    return invalid_request(ErrorCode.INVALID_TYPE, f"{path} must be {expected}, got {_json_type(value)}", path)


def get_field(
    obj: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    *,
    parent: str = "",
    required: bool = False,
    default: Any = None,
) -> Any:
    """Read `obj[key]`, checking its JSON type.

    Args:
        obj: the JSON object holding the field.
        key: the field name.
        kind: one of str, bool, int, float (any finite number), list, dict, or a tuple of them.
        parent: path of `obj` in the body, for messages.
        required: raise when the field is absent or null.
        default: returned when the field is absent or null and not required.
    """
    path = join_path(parent, key)
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise invalid_request(ErrorCode.MISSING_FIELD, f"{path} is required", path)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_matches(value, k) for k in kinds):
        raise wrong_type(path, " or ".join(_TYPE_NAMES[k] for k in kinds), value)
    if float in kinds and isinstance(value, int) and int not in kinds:
        value = float(value)
    return value


def get_tool_name(tool: dict[str, Any], *, parent: str) -> str:
    """A tool definition's ``name``: a required string with a non-blank character (the model calls the tool by
    it, and an empty name cannot be called or told apart). Raises `ApiError` (400) naming ``{parent}.name``."""
    name = get_field(tool, "name", str, parent=parent, required=True)
    if not name.strip():
        path = join_path(parent, "name")
        raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} must be a non-empty tool name, got {name!r}", path)
    return name


def get_tool_schema(obj: dict[str, Any], key: str, *, parent: str) -> dict[str, Any] | None:
    """A tool's parameters schema, `obj[key]` (an object, or None when absent), checked against the JSON Schema
    meta-schema that its ``$schema`` names (draft 2020-12 when it names none or one unknown), as OpenAI and
    Anthropic check theirs: the chat template shows the schema to the model, which cannot call a tool whose
    schema means nothing. Only validity is checked: a valid schema that the grammar library cannot enforce is
    taken (it matters only when the call is forced, `freetoken.server.generation.constrain_output`).

    Raises:
        ApiError: 400 naming ``{parent}.{key}``, and where inside it and what the meta-schema refused.
    """
    path = join_path(parent, key)
    schema = get_field(obj, key, dict, parent=parent)
    if schema is not None:
        error = _meta_schema_error(json.dumps(schema, sort_keys=True))
        if error is not None:
            raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} is not a valid JSON Schema: {error}", path)
    return schema


@functools.lru_cache(maxsize=1024)
def _meta_schema_error(schema_json: str) -> str | None:
    """What the meta-schema refuses in the schema `schema_json` ("at LOCATION: reason"), or None when it is valid.

    Cached by the schema's text: harnesses send the same tools every turn, and a check costs ~1-7 ms a schema
    (jsonschema, pure Python; Claude Code offers a dozen tools).
    """
    schema = json.loads(schema_json)
    with warnings.catch_warnings():  # an unknown $schema warns (DeprecationWarning) and gets the default
        warnings.simplefilter("ignore", DeprecationWarning)
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is None:
        return None
    location = ".".join(str(part) for part in error.absolute_path) or "the top level"
    return f"at {location}: {error.message}"


def get_number(
    obj: dict[str, Any],
    key: str,
    *,
    lo: float,
    hi: float,
    lo_open: bool = False,
    parent: str = "",
    default: float | None = None,
) -> float | None:
    """Read an optional number in [lo, hi] (or (lo, hi] with `lo_open`)."""
    value = get_field(obj, key, float, parent=parent, default=default)
    if value is None:
        return None
    too_low = value <= lo if lo_open else value < lo
    if too_low or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        path = join_path(parent, key)
        raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} must be in {interval}, got {value:g}", path)
    return value


def get_int(
    obj: dict[str, Any],
    key: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    parent: str = "",
    required: bool = False,
    default: int | None = None,
) -> int | None:
    """Read an integer, optionally bounded (inclusive)."""
    value = get_field(obj, key, int, parent=parent, required=required, default=default)
    if value is None:
        return None
    path = join_path(parent, key)
    if lo is not None and value < lo:
        raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} must be >= {lo}, got {value}", path)
    if hi is not None and value > hi:
        raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} must be <= {hi}, got {value}", path)
    return value


def get_string_list(obj: dict[str, Any], key: str, *, parent: str = "", allow_single: bool = False) -> list[str]:
    """Read an optional array of strings (or one string, with `allow_single`); absent gives []."""
    kinds: tuple[type, ...] = (list, str) if allow_single else (list,)
    value = get_field(obj, key, kinds, parent=parent, default=[])
    if isinstance(value, str):
        value = [value]
    path = join_path(parent, key)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise wrong_type(join_path(path, i), "a string", item)
        if not item:
            raise invalid_request(ErrorCode.INVALID_VALUE, f"{join_path(path, i)} must be a non-empty string", path)
    return list(value)


def get_object_list(
    obj: dict[str, Any], key: str, *, parent: str = "", required: bool = False, non_empty: bool = False
) -> list[dict[str, Any]]:
    """Read an array whose items are all JSON objects; absent gives [] unless `required`."""
    value = get_field(obj, key, list, parent=parent, required=required, default=[])
    path = join_path(parent, key)
    if non_empty and not value:
        raise invalid_request(ErrorCode.INVALID_VALUE, f"{path} must hold at least one item", path)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise wrong_type(join_path(path, i), "an object", item)
    return value
