"""`ft` as a user runs it (`python -m freetoken.cli.main`): help, and user errors as one line without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port


def ft(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run `ft` as the installed package (the one pytest imports), never the source tree: its compiled
    `freetoken._core` exists only in the installed wheel. ``ft serve`` without ``--port`` gets a free port, so
    a server on the default port (the README's main job on 1919) does not turn the error a test checks into a
    busy-port error."""
    if args[:1] == ("serve",) and "--port" not in args:
        args = (*args, "--port", str(free_port()))
    env = os.environ.copy()
    return subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", *args],
        check=False, capture_output=True, text=True, env=env, timeout=timeout_s, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 (a user error, as argparse's), no traceback, one line on stderr that says what is wrong (with each of
    `needles`)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ft ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from freetoken.models.demo import build_demo_checkpoint

    return build_demo_checkpoint(tmp_path_factory.mktemp("cli"), seed=1, vocab_size=2048, num_hidden_layers=2)


def _variant(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_help():
    for args in (["--help"], ["serve", "--help"]):
        result = ft(*args)
        assert result.returncode == 0, result.stderr
        assert "usage: ft" in result.stdout
    out = ft("serve", "--help").stdout
    for flag in ("--model", "--port", "--max-num-seqs", "--max-prefill-tokens", "--kv-cache-gb", "--dummy-weights"):
        assert flag in out


def test_version():
    result = ft("--version")
    assert result.returncode == 0 and result.stdout.startswith("freetoken ")


def test_no_command_is_a_usage_error():
    result = ft()
    assert result.returncode == 2 and "usage: ft" in result.stderr and "Traceback" not in result.stderr


def test_model_not_a_directory():
    assert_user_error(ft("serve", "--model", "/nonexistent/model"), "/nonexistent/model")


def test_model_without_config(tmp_path):
    assert_user_error(ft("serve", "--model", str(tmp_path)), "config.json")


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "JSON object"),
        (json.dumps({"architectures": ["LlamaForCausalLM"]}), "LlamaForCausalLM"),
        (json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}), "missing required key"),
    ],
)
def test_bad_config(tmp_path, model_dir, config, needle):
    path = _variant(model_dir, tmp_path / "m")
    (path / "config.json").write_text(config)
    assert_user_error(ft("serve", "--model", str(path), "--port", "1"), "config.json", needle)


def test_bad_config_value(tmp_path, model_dir):
    path = _variant(model_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["num_hidden_layers"] = "two"
    (path / "config.json").write_text(json.dumps(raw))
    assert_user_error(ft("serve", "--model", str(path)), "config.json", "num_hidden_layers")


def test_no_weights_suggests_dummy_weights(tmp_path, model_dir):
    path = _variant(model_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    assert_user_error(ft("serve", "--model", str(path)), "--dummy-weights")


def test_broken_tensor(tmp_path, model_dir):
    import torch
    from safetensors.torch import load_file, save_file

    path = _variant(model_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")
    assert_user_error(ft("serve", "--model", str(path)), "model.norm.weight", "shape")


def test_bad_port(model_dir):
    assert_user_error(ft("serve", "--model", str(model_dir), "--port", "70000"), "--port")


def test_busy_port_is_refused_before_loading(model_dir):
    """A port another process listens on is refused at once, before the model loads (minutes for a real one)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = ft("serve", "--model", str(model_dir), "--port", str(port))
    assert_user_error(result, f"127.0.0.1:{port}", "--port")
    assert "loading" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--kv-block-size", "0"], "--kv-block-size"),
        (["--dtype", "float64"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--device", "cuda:x"], "--device"),
        pytest.param(
            ["--device", "cuda"],
            "--device",
            marks=pytest.mark.skipif(
                __import__("torch").cuda.is_available(), reason="this machine has CUDA: serve would start"
            ),
        ),
        (["--moe-backend", "magic"], "magic"),
        (["--replay-routing", "synthetic"], "--dummy-weights"),
    ],
)
def test_bad_engine_flags(model_dir, flags, needle):
    result = ft("serve", "--model", str(model_dir), *flags)
    assert_user_error(result, needle)
    assert "loading" not in result.stderr  # answered before the weights load (minutes on a real model)


@pytest.mark.parametrize(
    ("argv", "prog"), [(["serve", "--model", "demo"], "ft serve"), (["bench", "bw"], "ft bench bw")]
)
def test_unknown_flag_shows_the_verbs_usage(argv, prog):
    result = ft(*argv, "--bogus")
    assert_user_error(result, f"{prog}: error: unrecognized arguments: --bogus")
    assert f"usage: {prog} " in result.stderr


def test_unparseable_flag_value(model_dir):
    result = ft("serve", "--model", str(model_dir), "--max-num-seqs", "many")
    assert result.returncode == 2 and "--max-num-seqs" in result.stderr and "Traceback" not in result.stderr


def test_model_too_big_for_host_memory_is_refused():
    """The real Qwen3-235B-A22B shape needs ~470 GB of host memory for its pool: refused before allocating."""
    result = ft("serve", "--model", "qwen3-235b-a22b", "--dummy-weights", "--device", "cpu", timeout_s=300)
    assert_user_error(result, "GB of host memory", "available")


@pytest.mark.parametrize("demo", ["demo", "demo-qwen3.5"])
def test_demo_serves_a_long_context_with_a_small_kv_cache(tmp_path, demo):
    """`ft serve --model demo` (and its Qwen3.5 twin, which the README had no way to run without writing Python): a
    65536-token context (harness sessions need >= 64k), KV cache of two contexts, served under the demo's name."""
    import signal
    import time

    import httpx

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken.cli.main", "serve", "--model", demo, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            pytest.fail(f"ft serve --model {demo} did not start:\n{log_path.read_text()[-3000:]}")
        assert models["data"][0]["max_model_len"] == 65536 and models["data"][0]["id"] == demo
        assert "= 131072 tokens" in log_path.read_text()
        assert ("recurrent-state pool" in log_path.read_text()) == (demo == "demo-qwen3.5")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_kv_cache_too_big_for_host_memory_is_refused():
    """A KV cache the box cannot hold (CPU device) is refused before allocating, naming the flag; it grew to
    20.9 GB and met the OOM killer without a word."""
    from conftest import free_port

    result = ft("serve", "--model", "demo", "--device", "cpu", "--port", str(free_port()), "--kv-cache-gb", "100000",
                "--kv-cache-tokens", "100000000000", timeout_s=300)  # fmt: skip
    assert_user_error(result, "GB of host memory", "KV cache", "--kv-cache-gb")


def test_kv_warning_names_the_limit_that_bit(caplog):
    import logging

    import torch

    from freetoken.config import EngineConfig, ModelConfig
    from freetoken.engine.kv_cache import plan_kv_cache
    from freetoken.models.demo import demo_checkpoint_dir

    model_cfg = ModelConfig.from_dir(demo_checkpoint_dir())
    with caplog.at_level(logging.WARNING):
        plan_kv_cache(model_cfg, EngineConfig(max_model_len=4096, kv_cache_tokens=1024), torch.float32)
    assert "--kv-cache-tokens" in caplog.text and "--kv-cache-gb" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan_kv_cache(model_cfg, EngineConfig(max_model_len=4096, kv_cache_gb=1e-4), torch.float32)
    assert "--kv-cache-gb" in caplog.text


@pytest.mark.parametrize(
    "tensor", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"]
)
def test_nonfinite_weights_are_refused_unless_allowed(tmp_path, model_dir, tensor):
    """A checkpoint with NaN weights (here one whole tensor: an attention weight, or a routed expert's) is refused
    at load, naming the tensor and --allow-nonfinite; with the flag it loads. It was served, answering '!!!!'."""
    import torch
    from safetensors.torch import load_file, save_file

    from freetoken.config import EngineConfig
    from freetoken.engine import LLMEngine
    from freetoken.models.loader import CheckpointError

    path = _variant(model_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    assert tensor in tensors, sorted(tensors)[:20]
    tensors[tensor] = torch.full_like(tensors[tensor], float("nan"))
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="--allow-nonfinite") as info:
        LLMEngine.from_dir(path, EngineConfig(max_model_len=64))
    assert ("q_proj" in str(info.value)) if "self_attn" in tensor else "expert 3 of model layer 1" in str(info.value)
    LLMEngine.from_dir(path, EngineConfig(max_model_len=64, allow_nonfinite=True))
