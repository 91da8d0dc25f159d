"""Shared fixtures: a real `ft serve` process on the tiny demo checkpoint, and clients for it.

The server runs as a subprocess (``python -m freetoken.cli.main serve``, what ``ft serve`` runs) on
the CPU, on a free port; fixtures wait for /health and stop it with SIGTERM at teardown. Its log
goes to a file whose tail is printed when it fails to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import openai
import pytest
import torch

import freetoken
from freetoken.config import ModelConfig
from freetoken.tokenizer import Tokenizer

if TYPE_CHECKING:
    from freetoken.engine.llm_engine import LLMEngine

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU (set before any kernel is defined), so CI checks them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_rounds_bf16_to_nearest() -> None:
    """Make Triton's interpreter round float32 -> bfloat16 casts to nearest even, as the GPU does (`fptrunc`, PTX
    `cvt.rn.bf16.f32`): Triton 3.9's interpreter truncates them, so half of a kernel's bfloat16 outputs came out
    one ulp off torch's (measured on the gated delta kernels) and bf16 comparisons on the CPU meant nothing. And
    widen bfloat16 -> float32 by value (the bits shifted up 16, as the GPU's `fpext` is): the interpreter
    normalizes bf16 subnormals then clamps the exponent, so 2^-127 came out 0 (the quantized MoE kernels' "bf16"
    scale mode decodes e2m1 0.5 codes to bf16 subnormals)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(data.view(np.uint16), dst_type.scalar)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            bits = src.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl


def _interpreter_dots_bf16_by_value() -> None:
    """Make Triton's interpreter multiply bfloat16 dot operands by their values: Triton 3.9's `create_dot` widens
    only 8-bit floats and hands the rest to `np.matmul` as they are stored, and it stores bfloat16 as raw uint16
    bits, so a bf16 `tl.dot` multiplied bit patterns (a 16 x 16 product of N(0, 1) values came out 2.6e10 off; the
    quantized MoE kernels' bf16 dots failed every CPU test). The GPU's bf16 MMA takes the exact values and
    accumulates in float32, as the float32 matmul here does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def values(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, values(a), values(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_rounds_bf16_to_nearest()
    _interpreter_dots_bf16_by_value()


# The `gpu` marker's check and skip (tests/gpu_marker.py).
pytest_plugins = ["gpu_marker", "pytester"]

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


@contextmanager
def in_process_server(app) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a thread of this process, on a free port; yields its base URL and stops
    it on exit (for tests that reach into the engine while it serves)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())
        if name is None and not data:
            continue  # a comment only (": keep-alive"), which SSE parsers skip
        events.append((name, "\n".join(data)))
    return events


@pytest.fixture(scope="session")
def parse_sse():
    """A function splitting an SSE body into (event name or None, data) pairs (UTF-8 checked per event)."""
    return _parse_sse


# The engine tests' prompts (tests/engine/test_engine.py), encoded by the `demo` fixture.
PROMPTS = [
    "Hello, my name is Ada and I like",
    "The quick brown fox jumps over the",
    "def fib(n):\n    return",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Once upon a time, in a land far away, there lived a",
    "Q:",
]


@dataclass
class Model:
    """The demo model, loaded once, with what engines need to be built around it."""

    path: Path
    model: torch.nn.Module
    cfg: ModelConfig
    tokenizer: Tokenizer
    prompts: list[list[int]] = field(default_factory=list)

    def engine(self, **kwargs: Any) -> LLMEngine:
        """An engine around the loaded model (CPU, float32, `max_model_len` 256 unless given)."""
        from freetoken.config import EngineConfig
        from freetoken.engine.llm_engine import LLMEngine

        kwargs.setdefault("max_model_len", 256)
        return LLMEngine(self.model, self.cfg, EngineConfig(device="cpu", dtype="float32", **kwargs), self.tokenizer)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The demo checkpoint (seed 0) loaded once per module on the CPU in float32, with `PROMPTS` encoded
    (tests/engine/test_engine.py and the engine-level prefix-cache tests)."""
    from freetoken.models.demo import build_demo_checkpoint
    from freetoken.models.loader import load_checkpoint
    from freetoken.moe import FusedExperts

    path = build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=0)
    cfg = ModelConfig.from_dir(path)
    model = load_checkpoint(path, FusedExperts(), torch.device("cpu"), torch.float32, cfg=cfg)
    tokenizer = Tokenizer.from_dir(path)
    return Model(path, model, cfg, tokenizer, [tokenizer.encode(p) for p in PROMPTS])


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with its weights stored in bfloat16 (so the pool holds exactly the fused weights): 16 experts,
    4 per token (tests/moe/test_moe_backends.py and tests/moe/test_prefill.py)."""
    from safetensors.torch import load_file, save_file

    from freetoken.models.demo import build_demo_checkpoint

    path = build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=5, num_experts=16, num_experts_per_tok=4)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


# The quantized-format tests' checkpoints (tests/quant): here, since a second conftest.py in tests/quant would be
# imported as the same module name `conftest` and hide this one from the modules that import its helpers.
@pytest.fixture(
    scope="module",
    params=[("fp8", "per_expert"), ("fp8", "fused"), ("nvfp4", "per_expert"), ("mxfp4", "fused")],
    ids="-".join,
)
def built(request, tmp_path_factory, checkpoint_overrides):
    """(quantized checkpoint, float32 checkpoint of its dequantized weights, format), for FP8 with 32 x 32 blocks
    (the demo's sizes, H 64 and I 32, in whole blocks) per expert and fused 3-D, NVFP4 per expert (ModelOpt's
    layout) and MXFP4 fused 3-D (gpt-oss's `_blocks` / `_scales`), each by the reference quantizer
    (`freetoken.quant.checkpoint.build_quantized_checkpoint`). Each module says the seed and config overrides by
    its own `checkpoint_overrides` fixture: (seed, {config key: value})."""
    from freetoken.quant import MXFP4, NVFP4, fp8_block
    from freetoken.quant.checkpoint import build_quantized_checkpoint  # after freetoken.engine (the loader's order)

    name, layout = request.param
    fmt = {"fp8": fp8_block(32, 32), "nvfp4": NVFP4, "mxfp4": MXFP4}[name]
    seed, overrides = checkpoint_overrides
    root = tmp_path_factory.mktemp(f"{name}-{layout}")
    q = build_quantized_checkpoint(
        root / "q", fmt, seed=seed, expert_layout=layout, dequantized_dest=root / "deq", **overrides
    )
    return q, root / "deq", fmt
