"""Hostile-load hardening of the HTTP server (issue 20): bounded memory after huge refused bodies, header
timeouts, the connection limit, /health without the key, the exposure warning, and a 400 (not a 500) for a
logit_bias key past Python's int-string limit."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY, ServerProcess, start_server
from freetoken.cli.serve import exposure_warning, is_loopback

HEADER_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 6
MAX_REQUEST_OUTPUT_TOKENS = 100


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of its own (its RSS is not shared with other tests) with a short header timeout and few
    connections."""
    proc = start_server(
        tmp_path_factory.mktemp("limited-server"),
        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-request-output-tokens", str(MAX_REQUEST_OUTPUT_TOKENS),
    )  # fmt: skip
    yield proc
    proc.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_memory_returns_to_baseline_after_huge_refused_prompts(limited_server: ServerProcess) -> None:
    """Five 30 MB prompts past the context: each a quick 400, and RSS back within 10 % of what it was after the
    first (it grew by ~57 MB a request, held by reference cycles until a full collection)."""
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello world " * 2_500_000}]}
    with httpx.Client(base_url=limited_server.base_url, timeout=120) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 400
        time.sleep(0.5)
        baseline = _rss_mb(limited_server.proc.pid)
        for _ in range(5):
            start = time.monotonic()
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
            assert time.monotonic() - start < 30
        time.sleep(0.5)
        after = _rss_mb(limited_server.proc.pid)
    print(f"RSS after the first huge request {baseline:.0f} MB, after five more {after:.0f} MB")
    assert after <= 1.10 * baseline


def test_a_connection_with_unfinished_headers_is_closed(limited_server: ServerProcess) -> None:
    silent = _connect(limited_server.base_url)
    partial = _connect(limited_server.base_url)
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    try:
        assert _closed_by_server(silent, HEADER_TIMEOUT_S + 3)
        assert _closed_by_server(partial, 3)
    finally:
        silent.close()
        partial.close()
    # A keep-alive connection that starts a second request and stalls is closed too; a normal one is served.
    with _connect(limited_server.base_url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = sock.recv(65536).partition(b"\r\n\r\n")
        assert b"200 OK" in head
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
        )
        while len(body) < length:
            body += sock.recv(65536)
        sock.sendall(b"GET /hea")
        assert _closed_by_server(sock, HEADER_TIMEOUT_S + 3)


def _read_response(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sends until it closes the connection (or `within_s` passes)."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pass
    return received


@pytest.mark.parametrize(
    ("path", "flavor"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")]
)  # fmt: skip
def test_a_stalled_request_body_gets_a_408_and_the_connection_closes(
    limited_server: ServerProcess, path: str, flavor: str
) -> None:
    """Headers complete, a body promised by Content-Length that stops coming: the connection was held open for
    as long as the client liked (the header deadline ends with the headers). Now a stall of `--header-timeout-s`
    between body chunks is a 408 in the API's shape, logged, and the connection closes."""
    with _connect(limited_server.base_url) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        sock.sendall(head.encode() + b'{"model": "m", "messages": [')
        start = time.monotonic()
        received = _read_response(sock, HEADER_TIMEOUT_S + 5)
        elapsed = time.monotonic() - start
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    assert elapsed < HEADER_TIMEOUT_S + 3
    payload = json.loads(body)
    assert flavor == "openai" or payload["type"] == "error"
    error = payload["error"]
    assert error["code"] == "request_timeout" and "--header-timeout-s" in error["message"]
    assert f"POST {path} -> 408 request_timeout" in limited_server.log_tail()
    assert httpx.get(limited_server.base_url + "/health", timeout=10).status_code == 200


def test_connections_past_the_limit_are_refused(limited_server: ServerProcess) -> None:
    held = [_connect(limited_server.base_url) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        response = httpx.get(limited_server.base_url + "/v1/models", timeout=10)
        assert response.status_code == 503
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(limited_server.base_url + "/v1/models", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_logit_bias_key_past_the_int_digit_limit_is_a_400(http: httpx.Client, path: str) -> None:
    body = {"model": "m", "max_tokens": 1, "logit_bias": {"9" * 5000: 1}}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and "set_int_max_str_digits" not in error["message"]


def test_health_without_the_key_is_liveness_only(keyed_server: ServerProcess) -> None:
    bare = httpx.get(keyed_server.base_url + "/health", timeout=10)
    assert bare.status_code == 200 and bare.json()["status"] == "ok"
    assert "engine" not in bare.json()
    keyed = httpx.get(keyed_server.base_url + "/health", headers={"x-api-key": API_KEY}, timeout=10)
    assert keyed.json()["engine"]["kv_blocks_total"] > 0
    wrong = httpx.get(keyed_server.base_url + "/health", headers={"x-api-key": "nope"}, timeout=10)
    assert "engine" not in wrong.json()


def test_exposure_warning() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host) and exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert not is_loopback(host)
        assert "--api-key" in exposure_warning(host, None)
        assert exposure_warning(host, "key") is None


def test_serve_warns_at_start_when_exposed(tmp_path: Path) -> None:
    """`ft serve --host 0.0.0.0` without --api-key says so in its log before it serves (checked on a bad port so
    nothing listens on all interfaces)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "serve", "--model", "demo", "--host", "0.0.0.0",
         "--port", "70000"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "without --api-key" in result.stderr


def test_n_times_max_tokens_is_capped(limited_server: ServerProcess) -> None:
    """n x max_tokens over --max-request-output-tokens is a 400 naming max_tokens; without max_tokens each
    choice gets its share of the cap."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 4, "temperature": 0}
    with httpx.Client(base_url=limited_server.base_url, timeout=120) as client:
        refused = client.post("/v1/chat/completions", json={**base, "max_tokens": 26})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "max_tokens"
        assert "--max-request-output-tokens" in refused.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json={**base, "max_tokens": 25}).status_code == 200
        capped = client.post("/v1/chat/completions", json={**base, "ignore_eos": True})
        assert capped.status_code == 200, capped.text
        assert capped.json()["usage"]["completion_tokens"] <= MAX_REQUEST_OUTPUT_TOKENS


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/v1/messages", "max_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", "max_output_tokens", {"input": "hi"}),
        ("/v1/completions", "max_tokens", {"prompt": "hi"}),
        # Compaction wrote its own default (2048 tokens, 30 s on the CPU demo) past the cap, or any budget asked.
        ("/v1/responses/compact", "max_output_tokens", {"input": "hi"}),
    ],
)
def test_every_api_caps_one_requests_output(limited_server: ServerProcess, path: str, field: str, body: dict) -> None:
    """--max-request-output-tokens holds on each API, not only chat completions: a budget over it is a 400 naming
    the field; /v1/responses without max_output_tokens (as Codex sends) gets the cap, not the context's rest."""
    base = {"model": "m", "temperature": 0, **body}
    with httpx.Client(base_url=limited_server.base_url, timeout=300) as client:
        refused = client.post(path, json={**base, field: MAX_REQUEST_OUTPUT_TOKENS + 1})
        assert refused.status_code == 400, refused.text
        assert "--max-request-output-tokens" in refused.text and field in refused.text
        assert "n x" not in refused.text  # these APIs have no n: the message speaks of the budget alone
        # the client's own figure, not what it was lowered to to fit the context (1e9 read as 65k-odd before)
        huge = client.post(path, json={**base, field: 10**9})
        assert huge.status_code == 400 and f"{field} is 1000000000 tokens" in huge.text, huge.text
        if path.startswith("/v1/responses"):
            capped = client.post(path, json=base)
            assert capped.status_code == 200, capped.text
            assert capped.json()["usage"]["output_tokens"] <= MAX_REQUEST_OUTPUT_TOKENS
