"""Test helpers for runs of real agent harnesses (Claude Code...) against the demo server.

`RecordingProxy` sits between a harness and `ft serve`: it forwards every request as it is, streams the answer
back as it comes (server-sent events pass through piece by piece), and records each exchange (method, path,
JSON body, status), so a test can assert on the harness's traffic and save its request shapes as fixtures.
"""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

# Headers that belong to one hop (RFC 9110 section 7.6.1) or that the proxy rewrites.
_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
    "upgrade", "host", "content-length",
})


@dataclass
class Exchange:
    """One request through the proxy.

    Attributes:
        method: the HTTP method.
        path: the path with its query.
        body: the request body parsed as JSON, or None when it was empty or not JSON.
        status: the upstream's status code (502 when the upstream could not be reached).
        response: the response body as text (whole, streamed bodies included).
    """

    method: str
    path: str
    body: Any
    status: int = 0
    response: str = ""


@dataclass
class RecordingProxy:
    """A reverse proxy on 127.0.0.1 (a free port) to `upstream`, recording every exchange; use as a context manager.

    Attributes:
        upstream: base URL of the server to forward to (``http://127.0.0.1:PORT``).
        exchanges: the recorded exchanges, in the order their requests arrived.
    """

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=self.upstream, timeout=httpx.Timeout(600.0, connect=10.0))
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes: no chunking to redo

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                exchange = Exchange(self.command, self.path, body)
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                try:
                    with proxy._client.stream(self.command, self.path, content=raw, headers=headers) as upstream:
                        exchange.status = upstream.status_code
                        self.send_response(upstream.status_code)
                        for key, value in upstream.headers.items():
                            if key.lower() not in _HOP_HEADERS and key.lower() != "content-encoding":
                                self.send_header(key, value)
                        self.end_headers()
                        pieces = []
                        for piece in upstream.iter_raw():
                            pieces.append(piece)
                            self.wfile.write(piece)
                            self.wfile.flush()
                        exchange.response = b"".join(pieces).decode("utf-8", errors="replace")
                except httpx.TransportError as exc:
                    exchange.status = 502
                    exchange.response = str(exc)
                    self.send_error(502, str(exc))
                except OSError:  # the harness hung up (it gave up on a request): its status stays recorded
                    pass

            do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
