"""A recording reverse proxy: forwards every request to an upstream server (a `ft serve` of the demo), streams the
answer back, and records the request (method, path, JSON body, as the client sent it) and the answer's status. Runs
in a thread of the test process on a free port.

`Recorder.body_overrides` replace fields of POSTed JSON object bodies before forwarding: the demo's random weights
almost never write EOS, so a test steers them to a short answer that ends (a budget, a one-word JSON format); the
recorded body stays the client's."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

# Request headers not forwarded (the proxy's client sets its own).
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding"})


@dataclass
class Exchange:
    """One recorded request and the status it got.

    Attributes:
        method: the HTTP method.
        path: the path, query string included.
        body: the JSON body (None when there was none or it was not JSON).
        status: the upstream's status code.
        response_head: the first 2,000 bytes of the upstream's answer (for failure messages).
    """

    method: str
    path: str
    body: Any
    status: int = 0
    response_head: bytes = b""


@dataclass
class Recorder:
    """The proxy: `base_url` is where clients go; `exchanges` fills up as requests come."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    base_url: str = ""
    body_overrides: dict[str, Any] = field(default_factory=dict)

    def app(self) -> Starlette:
        """The proxy's ASGI app."""
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600.0, connect=10.0))

        async def forward(request: Request) -> StreamingResponse:
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            exchange = Exchange(request.method, path, body)
            self.exchanges.append(exchange)
            if isinstance(body, dict) and self.body_overrides and request.method == "POST":
                raw = json.dumps({**body, **self.body_overrides}).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
            upstream = await client.send(
                client.build_request(request.method, path, content=raw, headers=headers), stream=True
            )
            exchange.status = upstream.status_code

            async def body_iter():
                async for chunk in upstream.aiter_raw():
                    if len(exchange.response_head) < 2000:
                        exchange.response_head += chunk[: 2000 - len(exchange.response_head)]
                    yield chunk

            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
            return StreamingResponse(
                body_iter(), status_code=upstream.status_code, headers=kept, background=BackgroundTask(upstream.aclose)
            )

        methods = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def start(self, port: int) -> tuple[uvicorn.Server, threading.Thread]:
        """Serve on 127.0.0.1:`port` in a daemon thread; returns once it listens."""
        server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{port}"
        return server, thread
