"""A small HTTP client for the verbs that talk to a running `ft serve` (`launch`, `top`, `ctl`): the standard
library's urllib, so these verbs start fast and need nothing beyond freetoken's own dependencies."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from freetoken.errors import FreetokenError

DEFAULT_SERVER = "http://127.0.0.1:1919"


class ServerError(FreetokenError):
    """A one-line reason a request to the server failed (down, refused the key, not a freetoken server).

    Attributes:
        unreachable: True when nothing answered (the server is not running or restarting).
    """

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def base_url(server: str) -> str:
    """`server` as ``http://host:port`` (a trailing ``/`` or ``/v1`` dropped; ``http://`` added when missing)."""
    url = server.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3] if url.endswith("/v1") else url


def add_server_args(parser: Any, inherited: bool = False) -> None:
    """`--server` and `--api-key` (default $FREETOKEN_API_KEY), as every client verb takes them. `inherited`: the
    parser is a sub-verb of a command that takes them too (`ft ctl --server URL status` as `ft ctl status --server
    URL`): given here they win, left out they keep the command's value (argparse.SUPPRESS: not set at all)."""
    server_default = argparse.SUPPRESS if inherited else DEFAULT_SERVER
    key_default = argparse.SUPPRESS if inherited else os.environ.get("FREETOKEN_API_KEY")
    parser.add_argument("--server", default=server_default, help=f"the freetoken server (default: {DEFAULT_SERVER})")
    parser.add_argument("--api-key", default=key_default, help="the server's --api-key (default: $FREETOKEN_API_KEY)")


def get_json(server: str, path: str, api_key: str | None = None, timeout_s: float = 5.0) -> Any:
    """``GET {server}{path}`` as JSON.

    Raises:
        ServerError: nothing answers (`unreachable`; the message names the `ft serve` command), the key is
            missing or refused, another HTTP error, or a body that is not JSON.
    """
    return _request_json(server, path, api_key, None, timeout_s)


def post_json(server: str, path: str, body: Any, api_key: str | None = None, timeout_s: float = 600.0) -> Any:
    """``POST {server}{path}`` with a JSON body; the answer as JSON.

    Raises:
        ServerError: as `get_json`; an API error answer (4xx/5xx with an error body) gives its message.
    """
    return _request_json(server, path, api_key, body, timeout_s)


def _request_json(server: str, path: str, api_key: str | None, body: Any, timeout_s: float) -> Any:
    url = base_url(server)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 401 and api_key:
            raise ServerError(
                f"{url} refused the API key given (--api-key or FREETOKEN_API_KEY): it is not "
                "the key its `ft serve --api-key` set"
            ) from None
        if exc.code == 401:
            raise ServerError(f"{url} needs its API key: pass --api-key or set FREETOKEN_API_KEY") from None
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"{url}{path} answered HTTP {exc.code}; is it a freetoken server?") from None
        raise ServerError(f"HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        hint = "" if url == DEFAULT_SERVER else " with --host/--port to match"
        raise ServerError(
            f"no freetoken server at {url} ({reason}); start one with `ft serve --model MODEL_DIR`{hint}",
            unreachable=True,
        ) from None
    except ValueError:
        raise ServerError(f"{url}{path} did not answer JSON; is it a freetoken server?") from None
