"""Claude Code, the real binary, headless against `ft serve` on the demo: every request it sends must be served.

The binary ships inside the PyPI package ``claude-agent-sdk`` (``claude_agent_sdk/_bundled/claude``, a
self-contained executable) and runs offline: no login (``ANTHROPIC_API_KEY`` is a dummy), no traffic but the API
calls (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``), and ``ANTHROPIC_BASE_URL`` at a `Recorder` in front of
the server. The demo model has random weights, so it never ends a turn by itself: ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``
keeps each answer short (Claude Code then asks it to resume, a few times, and gives up on the turn: its result says
``max_output_tokens``, which is the model, not an API error).

With ``FREETOKEN_RECORD_FIXTURES=1`` the run also rewrites ``tests/fixtures/harness/claude_code/`` (request
bodies with the ids that identify a machine or session replaced), which `test_harness_replay.py` replays without
the binary.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import free_port
from harness.recorder import Recorder

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness" / "claude_code"
CLAUDE_TIMEOUT_S = 600


def claude_binary() -> Path:
    """The Claude Code executable bundled in the installed ``claude-agent-sdk``; skips the test without it."""
    sdk = pytest.importorskip("claude_agent_sdk", reason="claude-agent-sdk (the test extra) is not installed")
    binary = Path(sdk.__file__).parent / "_bundled" / "claude"
    if not binary.is_file():
        pytest.skip(f"claude-agent-sdk {getattr(sdk, '__version__', '?')} ships no bundled binary at {binary}")
    return binary


def scrubbed(body: dict) -> dict:
    """A request body with what identifies this machine or session replaced (``metadata.user_id`` holds a
    device id and a session id); nothing else Claude Code sends is secret (the API key is a header)."""
    body = json.loads(json.dumps(body))
    if isinstance(body.get("metadata"), dict) and "user_id" in body["metadata"]:
        body["metadata"]["user_id"] = "user_fixture"
    return body


@pytest.mark.slow
def test_claude_code_headless_session(long_server, tmp_path):
    binary = claude_binary()
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    recorder = Recorder(long_server.base_url)
    proxy, thread = recorder.start(free_port())
    try:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": recorder.base_url,
            "ANTHROPIC_API_KEY": "sk-ant-test-dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32",
        }
        result = subprocess.run(
            [str(binary), "-p", "Say hello.", "--max-turns", "2", "--output-format", "json"],
            env=env, cwd=work, capture_output=True, text=True, timeout=CLAUDE_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        proxy.should_exit = True
        thread.join(timeout=30)
    exchanges = recorder.exchanges
    failed = [(e.method, e.path, e.status, e.response_head[:500]) for e in exchanges if e.status >= 400]
    assert not failed, (failed, long_server.log_tail())
    messages = [e for e in exchanges if e.method == "POST" and e.path.startswith("/v1/messages")]
    assert messages, (result.stdout, result.stderr)
    # Claude Code ran to its end: one JSON result, without an API error (the model's long answers are not one).
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["type"] == "result", report
    assert report.get("api_error_status") is None, report
    assert report["num_turns"] >= 1, report
    if os.environ.get("FREETOKEN_RECORD_FIXTURES") == "1":
        FIXTURES.mkdir(parents=True, exist_ok=True)
        for old in FIXTURES.glob("*.json"):
            old.unlink()
        for i, exchange in enumerate(messages):
            name = f"{i:02d}-{exchange.path.split('?')[0].strip('/').replace('/', '_')}.json"
            record = {"method": exchange.method, "path": exchange.path, "body": scrubbed(exchange.body)}
            (FIXTURES / name).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
