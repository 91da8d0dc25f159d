"""The HTTP server: app assembly, health, models, API keys, and error shaping.

Routes:
    GET  /health                    always open (no API key); 200 once the engine has started.
    GET  /v1/models                 the one served model (Anthropic shape with anthropic-version, else OpenAI).
    GET  /v1/models/{model}         that model, or 404 (code model_not_found).
    POST /v1/chat/completions       OpenAI (see `openai.py`).
    POST /v1/completions            OpenAI text completions (see `completions.py`).
    POST /v1/responses              OpenAI Responses (see `responses.py`).
    POST /v1/responses/compact      a conversation compacted by the model (`responses.compact`).
    GET  /v1/responses/{id}         a stored response, or 404; DELETE forgets it.
    POST /v1/messages               Anthropic (see `anthropic.py`).
    POST /v1/messages/count_tokens  Anthropic token count.
    GET  /v1/stats                  the stats snapshot as JSON (see `telemetry.py`).
    GET  /v1/cache                  the expert-slot cache and KV cache sizes and the memory headroom (`cache.py`).
    POST /v1/cache/resize           resize them while serving (`cache.py`; what `ft ctl cache` calls).
    GET  /metrics                   the same snapshot and the request metrics, Prometheus text format.
    GET  /                          the status page (see `status_page.py`); always open (it holds no data).

Model names: this is a single-model server. The ``model`` field is required in both APIs, but any
name is accepted (harnesses send their own model names) and every response echoes the served model
name.

Error shape: requests under ``/v1/messages`` or carrying an ``anthropic-version`` header get
Anthropic error bodies; all others get OpenAI ones. This covers 400s, 401 (API key), 404 (unknown
route), 405, and 500: an unexpected exception is logged with its traceback and answered as an
API-shaped 500; the server keeps serving.

API key: with ``api_key`` set, every route but /health and / needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY``; /metrics too, unless ``metrics_open`` and the client is on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from freetoken.heap import release_free_memory
from freetoken.server import anthropic, cache, completions, openai, responses, status_page, telemetry
from freetoken.server.engine_client import EngineClient
from freetoken.server.errors import ApiError, ApiFlavor, ErrorCode, bounded, error_body
from freetoken.server.generation import ClientDisconnected
from freetoken.server.notices import request_notes
from freetoken.server.sse import KEEPALIVE_S

logger = logging.getLogger("freetoken.server")

_OPEN_PATHS = frozenset({"/health", "/"})
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
MAX_LOGGED_PATH_CHARS = 300  # a 4xx log line shows this much of the URL path (the rest is cut, with a count)

# After a request whose body was at least this large, its memory goes back to the system at once: a refused
# request's body, JSON and rendering are often held by reference cycles (an exception's traceback and its
# frames) until the collector's next full pass, and glibc keeps freed pages in its arenas; a 30 MB body left
# +57 MB of RSS behind, request after request, without this.
TRIM_AFTER_BODY_BYTES = 1 << 20


def flavor_of(scope: Scope) -> ApiFlavor:
    """Which API's error shape a request gets: Anthropic for /v1/messages* or an anthropic-version header."""
    if scope.get("path", "").startswith("/v1/messages"):
        return ApiFlavor.ANTHROPIC
    for name, _ in scope.get("headers", []):
        if name == b"anthropic-version":
            return ApiFlavor.ANTHROPIC
    return ApiFlavor.OPENAI


def error_response(err: ApiError, flavor: ApiFlavor) -> JSONResponse:
    """The HTTP response for `err` in `flavor`'s shape."""
    headers = None
    if err.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif err.status == 408:  # the rest of the body may still come: the connection cannot carry another request
        headers = {"Connection": "close"}
    return JSONResponse(error_body(err, flavor), status_code=err.status, headers=headers)


def _presented_key(scope: Scope) -> str | None:
    headers = dict(scope.get("headers", []))
    x_api_key = headers.get(b"x-api-key")
    if x_api_key:
        return x_api_key.decode("latin-1").strip()
    authorization = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


class ApiMiddleware:
    """Checks the API key and turns any exception into an API-shaped error response.

    ApiError -> its status; ClientDisconnected, or starlette's ClientDisconnect (the client left while sending
    its body) -> nothing (no one to answer); anything else is logged
    with its traceback and becomes a 500. When the response has already started (a stream), the
    exception is logged and the connection is closed.

    A request body that stops arriving for `body_timeout_s` (the headers are complete, the body is not) is a 408
    and its connection closes: the header deadline (`HeaderTimeoutProtocol`) ends with the headers, and a client
    that promised a Content-Length and sent less held its connection (one of `--max-connections`) for ever.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        metrics_open: bool = False,
        body_timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics_open = metrics_open
        self.body_timeout_s = body_timeout_s

    def _open(self, scope: Scope) -> bool:
        if scope["path"] in _OPEN_PATHS:
            return True
        client = scope.get("client")
        return self.metrics_open and scope["path"] == "/metrics" and client is not None and client[0] in _LOOPBACK_HOSTS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one request through the key check and the error net."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        flavor = flavor_of(scope)
        if not self._open(scope) and not _key_accepted(scope, self.api_key):
            message = (
                "no API key given; send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                if _presented_key(scope) is None
                else "invalid API key"
            )
            err = ApiError(401, ErrorCode.INVALID_API_KEY, message)
            log_client_error(scope, err)
            await error_response(err, flavor)(scope, receive, send)
            return

        started = False
        body_bytes = 0

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        body_complete = self.body_timeout_s is None

        async def counting_receive() -> Message:
            nonlocal body_bytes, body_complete
            if body_complete:  # after the body, receive() waits for the disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:  # builtin TimeoutError only from Python 3.11
                raise ApiError(
                    408,
                    ErrorCode.REQUEST_TIMEOUT,
                    f"the request body stopped arriving: nothing for {self.body_timeout_s:g} s after "
                    f"{body_bytes} bytes (--header-timeout-s); send the whole body",
                ) from None
            body_bytes += len(message.get("body", b""))
            body_complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            with request_notes():
                await self._serve(scope, counting_receive, tracking_send, flavor, lambda: started)
        finally:
            if body_bytes >= TRIM_AFTER_BODY_BYTES:
                await asyncio.to_thread(release_free_memory)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, flavor: ApiFlavor, started) -> None:
        """Run the app; map its exceptions to responses (none once the response has `started()`)."""
        try:
            await self.app(scope, receive, send)
        except ClientDisconnected:
            return
        except ClientDisconnect:
            logger.info("%s %s: the client left before its request body was complete", scope["method"], scope["path"])
            return
        except ApiError as err:
            if started():
                logger.warning("%s %s failed after the response started: %s", scope["method"], scope["path"], err)
                return
            log_client_error(scope, err)
            await error_response(err, flavor)(scope, receive, send)
        except Exception:
            logger.exception("unexpected error in %s %s", scope["method"], scope["path"])
            if started():
                return
            internal = ApiError(500, ErrorCode.INTERNAL_ERROR, "internal server error; see the server log")
            await error_response(internal, flavor)(scope, receive, send)


def log_client_error(scope: Scope, err: ApiError) -> None:
    """One log line for a 4xx answer: the route, the status and code, the field, and the reason."""
    if 400 <= err.status < 500:
        logger.warning(
            "%s %s -> %d %s%s: %s",
            scope.get("method"),
            bounded(str(scope.get("path")), MAX_LOGGED_PATH_CHARS),  # a URL may be ~16 KB (the HTTP line limit)
            err.status,
            err.code.value,
            f" (field {err.param})" if err.param else "",
            err.message,
        )


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Router errors (unknown route, wrong method) in API shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, ErrorCode.UNKNOWN_URL, f"unknown URL: {request.method} {request.url.path}")
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        err = ApiError(405, ErrorCode.METHOD_NOT_ALLOWED, message)
    else:
        err = ApiError(exc.status_code, ErrorCode.INVALID_VALUE, str(exc.detail))
    log_client_error(request.scope, err)
    response = error_response(err, flavor_of(request.scope))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _key_accepted(scope: Scope, api_key: str | None) -> bool:
    """Whether the request may see what the API key guards: no key is set, or it presents the key."""
    if api_key is None:
        return True
    presented = _presented_key(scope)
    return presented is not None and hmac.compare_digest(presented.encode(), api_key.encode())


async def health(request: Request) -> Response:
    """``GET /health``: liveness and the served model for anyone; the engine's stats snapshot too when the
    request may read ``/v1/stats`` (the server has no API key, or the request presents it)."""
    state = request.app.state
    body: dict[str, Any] = {"status": "ok", "model": state.served_model_name}
    if _key_accepted(request.scope, state.api_key):
        stats: Any = None
        with contextlib.suppress(Exception):
            stats = state.engine.stats()
        body["engine"] = stats
    return JSONResponse(body)


async def stats(request: Request) -> Response:
    """``GET /v1/stats``: the engine's counters (requests, KV blocks, steps) and the expert backend's per-layer
    hits, fills, CPU runs and bytes each way, with the server's request figures under "server", as JSON
    (`telemetry.Telemetry.snapshot`)."""
    return JSONResponse(request.app.state.telemetry.snapshot())


async def metrics(request: Request) -> Response:
    """``GET /metrics``: `stats`' snapshot and the request metrics in Prometheus' text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(request.app.state.telemetry.registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(state: Any, flavor: ApiFlavor) -> dict[str, Any]:
    if flavor is ApiFlavor.ANTHROPIC:
        created_at = datetime.datetime.fromtimestamp(state.created, datetime.timezone.utc)
        return {
            "type": "model",
            "id": state.served_model_name,
            "display_name": state.served_model_name,
            "created_at": created_at.isoformat().replace("+00:00", "Z"),
        }
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "freetoken",
        "max_model_len": state.engine.max_model_len,
        # what one request may ask for (--max-request-output-tokens, within the context): `ft launch` sets the
        # harness's output limit to it, since a harness asking for more gets a 400 on every request
        "max_output_tokens": min(state.engine.max_request_output_tokens, state.engine.max_model_len),
    }


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one served model, in the Anthropic list shape when the request carries an
    ``anthropic-version`` header, else the OpenAI one."""
    state = request.app.state
    flavor = flavor_of(request.scope)
    card = _model_card(state, flavor)
    if flavor is ApiFlavor.ANTHROPIC:
        return JSONResponse({"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]})
    return JSONResponse({"object": "list", "data": [card]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model (shaped as in `list_models`), or 404."""
    state = request.app.state
    name = request.path_params["model"]
    if name != state.served_model_name:
        raise ApiError(
            404,
            ErrorCode.MODEL_NOT_FOUND,
            f"model {name!r} is not served here; this server serves {state.served_model_name!r}",
            "model",
        )
    return JSONResponse(_model_card(state, flavor_of(request.scope)))


async def _abort_on_exit(server: uvicorn.Server, engine: EngineClient, graceful_shutdown_s: float) -> None:
    """Once uvicorn is told to exit, give running requests `graceful_shutdown_s`, then stop the engine.

    Stopping the engine ends the requests still running with finish_reason "abort", so their streams
    close with an error event and uvicorn's wait for open connections ends.
    """
    while not server.should_exit:  # noqa: ASYNC110 (uvicorn sets a flag, not an event: polled)
        await asyncio.sleep(0.1)
    await asyncio.sleep(graceful_shutdown_s)
    logger.info("shutting down: aborting the requests still running")
    await engine.shutdown()


def build_app(
    engine: EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    metrics_open: bool = False,
    keepalive_s: float = KEEPALIVE_S,
    strict_max_tokens: bool = False,
    default_thinking: bool = False,
    body_timeout_s: float | None = None,
) -> Starlette:
    """Build the ASGI app serving `engine`; the app's lifespan starts and shuts down the engine.

    Args:
        engine: a `freetoken.engine.AsyncEngine` (not started yet).
        served_model_name: the name /v1/models lists and every response echoes.
        api_key: when set, every route but /health and / needs this key.
        metrics_open: /metrics answers loopback clients without the key.
        keepalive_s: seconds a stream may be idle before it sends a keep-alive (see `freetoken.server.sse`).
        strict_max_tokens: refuse (400) a completion budget past the room the prompt leaves in the context,
            instead of lowering it (`freetoken.server.generation.fit_context`).
        default_thinking: Anthropic requests without a ``thinking`` field think (the API's default is off).
        body_timeout_s: a request body that stops arriving this long is a 408 (`ApiMiddleware`); None waits.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving %s (context %d tokens)", served_model_name, engine.max_model_len)
        watcher = None
        server = getattr(app.state, "uvicorn_server", None)
        if server is not None:
            watcher = asyncio.create_task(_abort_on_exit(server, engine, app.state.graceful_shutdown_s))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await engine.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/responses", responses.responses, methods=["POST"]),
        Route("/v1/responses/compact", responses.compact, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        Route("/v1/cache", cache.get_cache, methods=["GET"]),
        Route("/v1/cache/resize", cache.resize_cache, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", status_page.status_page, methods=["GET"]),
    ]
    metered = telemetry.Telemetry(engine, served_model_name)
    app = Starlette(
        routes=routes,
        middleware=[  # telemetry outermost: it records the status ApiMiddleware answers (401, an error's 400)
            Middleware(telemetry.TelemetryMiddleware, telemetry=metered),
            Middleware(ApiMiddleware, api_key=api_key, metrics_open=metrics_open, body_timeout_s=body_timeout_s),
        ],
        exception_handlers={HTTPException: _http_exception},
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.telemetry = metered
    app.state.served_model_name = served_model_name
    app.state.api_key = api_key
    app.state.response_store = responses.ResponseStore()
    app.state.created = int(time.time())
    app.state.strict_max_tokens = strict_max_tokens
    app.state.default_thinking = default_thinking
    app.state.keepalive_s = keepalive_s
    return app


def _log_config() -> dict[str, Any]:
    """uvicorn's logging config with every handler on stderr (the CLI sets up the freetoken loggers)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in config["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    if os.environ.get("NO_COLOR") is not None:
        for formatter in config["formatters"].values():
            formatter["use_colors"] = False
    return config


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers.

    uvicorn times out an idle keep-alive connection (``timeout_keep_alive``) but not one that has sent part of
    its headers, nor a new one that sends nothing: such connections were held forever (800 of them after 60 s).
    Here the connection is closed when a request's headers are not complete `header_timeout_s` (class
    attribute, set by `run_server`) after the connection opened or the previous response ended.
    """

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Open the connection and start the wait for the first request's headers."""
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def handle_events(self) -> None:
        """Parse what arrived; a new request (its headers complete) stops the header deadline."""
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        """The response ended: the next request's headers have `header_timeout_s` again."""
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the deadline with the connection."""
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timeout(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            logger.info("closing a connection whose request headers took over %.0f s", self.header_timeout_s)
            self.transport.close()


def run_server(
    engine: EngineClient,
    *,
    host: str = "127.0.0.1",
    port: int = 1919,
    served_model_name: str,
    api_key: str | None = None,
    metrics_open: bool = False,
    graceful_shutdown_s: float = 3.0,
    strict_max_tokens: bool = False,
    default_thinking: bool = False,
    header_timeout_s: float = 10.0,
    keep_alive_timeout_s: float = 5.0,
    max_connections: int = 1024,
) -> None:
    """Serve `engine` with uvicorn until SIGINT/SIGTERM; logs go to stderr.

    On a signal the server stops accepting connections, gives running requests `graceful_shutdown_s`
    to finish, then aborts the rest in the engine (their streams end with an error event), and shuts
    the engine down. uvicorn then re-raises the signal, so the process ends as killed by it.

    Args:
        header_timeout_s: a connection whose request headers are not complete this long after it opened (or
            after its previous response) is closed (`HeaderTimeoutProtocol`); a request body that stops arriving
            this long is a 408 (`ApiMiddleware`).
        keep_alive_timeout_s: an idle keep-alive connection is closed after this long (uvicorn's
            ``timeout_keep_alive``).
        max_connections: open connections past this get a 503 to their requests (uvicorn's
            ``limit_concurrency``); 0 = no limit.
        strict_max_tokens, default_thinking: see `build_app`.
    """
    app = build_app(
        engine,
        served_model_name=served_model_name,
        api_key=api_key,
        metrics_open=metrics_open,
        strict_max_tokens=strict_max_tokens,
        default_thinking=default_thinking,
        body_timeout_s=header_timeout_s,
    )
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=_log_config(),
        # A backstop: requests are aborted (and their connections close) after graceful_shutdown_s.
        timeout_graceful_shutdown=math.ceil(graceful_shutdown_s) + 10,
        lifespan="on",
        http=protocol,
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn passes it to call_later
        limit_concurrency=max_connections or None,
    )
    server = uvicorn.Server(config)
    app.state.uvicorn_server = server
    app.state.graceful_shutdown_s = graceful_shutdown_s
    server.run()
