"""Shared fixtures: a real `ft serve` process on the tiny demo checkpoint, and clients for it.

The server runs as a subprocess (``python -m freetoken.cli.main serve``, what ``ft serve`` runs) on
the CPU, on a free port; fixtures wait for /health and stop it with SIGTERM at teardown. Its log
goes to a file whose tail is printed when it fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import freetoken
import httpx
import openai
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU (set before any kernel is defined), so CI checks them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SERVED_MODEL_NAME = "freetoken-test"
MAX_MODEL_LEN = 512
API_KEY = "test-key-7d1f"
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `ft serve` subprocess.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``.
        proc: the process.
        log_path: where its stdout and stderr go.
    """

    def __init__(self, base_url: str, proc: subprocess.Popen, log_path: Path) -> None:
        self.base_url = base_url
        self.proc = proc
        self.log_path = log_path

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait (SIGKILL after `timeout_s`); return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    log_dir: Path, *extra_args: str, port: int | None = None, model_dir: Path | None = None
) -> ServerProcess:
    """Start `ft serve` on `model_dir` (default: the demo checkpoint) on the CPU on `port` (default: a free one) and
    wait until /health answers."""
    from freetoken.models.demo import demo_checkpoint_dir

    model_dir = model_dir or demo_checkpoint_dir()
    port = port or free_port()
    env = os.environ.copy()
    # The server imports the same freetoken as this process (the installed one, or the source tree).
    package_root = str(Path(freetoken.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "freetoken.cli.main", "serve",
        "--model", str(model_dir),
        "--device", "cpu",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_MODEL_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        *extra_args,
    ]  # fmt: skip
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ft serve exited with {proc.returncode} before answering /health:\n{server.log_tail()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"ft serve did not answer /health within {STARTUP_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server without an API key, shared by the whole session."""
    proc = start_server(tmp_path_factory.mktemp("server"))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server started with ``--api-key API_KEY``."""
    proc = start_server(tmp_path_factory.mktemp("keyed-server"), "--api-key", API_KEY)
    yield proc
    proc.stop()


# The demo's own context, as `ft serve --model demo` serves it: harnesses' prompts are 6k-20k tokens.
DEMO_CONTEXT_TOKENS = 65536


@pytest.fixture(scope="session")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The demo with its whole context (`server` has MAX_MODEL_LEN), a KV cache of two contexts, and prompts
    prefilled in one chunk (a harness's first prompt is one 12k-token chunk, not two)."""
    proc = start_server(
        tmp_path_factory.mktemp("long-server"), "--max-model-len", str(DEMO_CONTEXT_TOKENS),
        "--kv-cache-tokens", str(2 * DEMO_CONTEXT_TOKENS), "--max-prefill-tokens", "16384",
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """A raw HTTP client on `server`."""
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(server: ServerProcess) -> openai.OpenAI:
    """The official OpenAI SDK pointed at `server`."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


@pytest.fixture(scope="session")
def anthropic_client(server: ServerProcess) -> anthropic.Anthropic:
    """The official Anthropic SDK pointed at `server`."""
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60.0)


@pytest.fixture(scope="session")
def demo_tokenizer():
    """The demo checkpoint's tokenizer, to count prompt tokens independently of the server."""
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.tokenizer import Tokenizer

    return Tokenizer.from_dir(demo_checkpoint_dir())


def _parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event name or None, data) pairs; every event must be valid UTF-8."""
    events = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        text = block.decode("utf-8")  # raises if an event split a character
        name = None
        data = []
        for line in text.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].strip())
        if name is None and not data:
            continue  # a comment only (": keep-alive"), which SSE parsers skip
        events.append((name, "\n".join(data)))
    return events


@pytest.fixture(scope="session")
def parse_sse():
    """A function splitting an SSE body into (event name or None, data) pairs (UTF-8 checked per event)."""
    return _parse_sse
