"""Codex (``openai-codex-cli-bin``, the real binary) against a `ft serve` of the demo, and what it relies on.

- `test_codex_exec_two_turns`: ``codex exec`` then ``codex exec resume --last`` with a custom provider
  (``wire_api = "responses"``, base_url at a recording proxy in front of the server, a config in a temporary
  CODEX_HOME, no login), every request recorded and none answered 4xx/5xx. It runs offline (the binary needs no
  network with a custom provider). The proxy steers the random demo to a short answer that ends (a budget, a
  boolean JSON format, no tools, no reasoning): Codex fails a turn whose response is incomplete, and random
  weights almost never write EOS. With ``FREETOKEN_RECORD_FIXTURES=1`` it rewrites `FIXTURES` (ids scrubbed).
- `test_replay_recorded_codex_requests`: the recorded requests, posted as they are (plus a small budget), fast.
- The Responses features Codex sends: ``custom`` tools answered as ``custom_tool_call`` items, ``namespace`` tools
  offered as their member functions, hosted tools (``web_search``) dropped with a log line, history items of
  custom calls, and ``POST /v1/responses/compact``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import free_port, start_server
from harness.recorder import Recorder

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness" / "codex"
# Codex's first prompt is ~6k tokens (instructions and tool schemas).
CODEX_CONTEXT = 16384
STEER = {
    "max_output_tokens": 16,
    "tool_choice": "none",
    "reasoning": {"effort": "none"},
    "text": {"format": {"type": "json_schema", "name": "done", "schema": {"type": "boolean"}}},
}


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("codex-server"), "--max-model-len", str(CODEX_CONTEXT))
    yield proc
    proc.stop()


def _codex_binary() -> str:
    codex_cli_bin = pytest.importorskip("codex_cli_bin", reason="openai-codex-cli-bin is not installed")
    return str(Path(codex_cli_bin.__file__).parent / "bin" / "codex")


def _scrub(value):
    """A recorded body with ids, times and temporary paths replaced (nothing secret is sent: no key is set)."""
    text = json.dumps(value, ensure_ascii=False)
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    text = re.sub(uuid, "00000000-0000-0000-0000-000000000000", text)
    text = re.sub(r"/tmp/[A-Za-z0-9_./-]+", "/tmp/codex-test", text)
    text = re.sub(r"(turn_started_at_unix_ms\\\\?\"?:)\d+", r"\g<1>0", text)
    return json.loads(text)


def test_codex_exec_two_turns(long_server, tmp_path):
    binary = _codex_binary()
    recorder = Recorder(long_server.base_url, body_overrides=STEER)
    proxy, thread = recorder.start(free_port())
    home, work = tmp_path / "home", tmp_path / "work"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    work.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "demo"\nmodel_provider = "freetoken"\n\n[model_providers.freetoken]\nname = "freetoken"\n'
        f'base_url = "{recorder.base_url}/v1"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home), "PATH": os.environ.get("PATH", ""), "NO_COLOR": "1"}
    common = ["--skip-git-repo-check", "-c", 'sandbox_mode="read-only"']
    try:
        for args in (["exec", *common, "List the files here."], ["exec", "resume", "--last", *common, "Thanks."]):
            done = subprocess.run(
                [binary, *args],
                env=env,
                cwd=work,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    finally:
        proxy.should_exit = True
        thread.join(timeout=30)
    posts = [e for e in recorder.exchanges if e.method == "POST"]
    bad = [(e.method, e.path, e.status, e.response_head[:500]) for e in recorder.exchanges if e.status >= 400]
    assert not bad, bad
    turns = [e for e in posts if e.path == "/v1/responses"]
    assert len(turns) >= 2
    first, second = turns[0].body, turns[-1].body
    assert first["stream"] is True and {t["type"] for t in first["tools"]} >= {"function"}
    assert any(item.get("role") == "assistant" for item in second["input"])  # the first turn's answer came back
    if os.environ.get("FREETOKEN_RECORD_FIXTURES") == "1":
        FIXTURES.mkdir(parents=True, exist_ok=True)
        for i, exchange in enumerate(posts):
            name = f"{i:02d}-{exchange.path.strip('/').replace('/', '-')}.json"
            record = {"method": exchange.method, "path": exchange.path, "body": _scrub(exchange.body)}
            (FIXTURES / name).write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")


def _fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: p.stem)
def test_replay_recorded_codex_requests(long_server, path):
    """Each recorded request as Codex sent it (namespace and web_search tools, developer messages, store false,
    include, client_metadata, ...), with a small budget: 200, and a stream that ends as Codex expects."""
    record = json.loads(path.read_text())
    body = {**record["body"], "max_output_tokens": 4}
    with httpx.Client(base_url=long_server.base_url, timeout=300) as client:
        response = client.post(record["path"], json=body)
    assert response.status_code == 200, response.text[:2000]
    if body.get("stream"):
        kinds = [json.loads(line[5:])["type"] for line in response.text.splitlines() if line.startswith("data:")]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
    log = long_server.log_tail(200_000)
    assert "'web_search'" in log and "dropped" in log  # the hosted tool was dropped, with its log line


APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string", "enum": ["a1"]}},
                "required": ["target"],
                "additionalProperties": False,
            },
        }
    ],
}


def test_custom_tool_is_answered_as_custom_tool_call(openai_client):
    kwargs = {
        "model": "m",
        "input": "Patch it.",
        "tools": [APPLY_PATCH],
        "max_output_tokens": 24,
        "temperature": 0,
        "tool_choice": {"type": "function", "name": "apply_patch"},
    }
    response = openai_client.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.call_id.startswith("call_") and isinstance(call.input, str)
    assert not [item for item in response.output if item.type == "function_call"]
    events = list(openai_client.responses.create(**kwargs, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["custom_tool_call"] and done[0].input == call.input
    inputs = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert [e.input for e in inputs] == [call.input]
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]


def test_namespace_members_are_offered_and_calls_carry_the_namespace(openai_client, http):
    kwargs = {
        "model": "m",
        "input": "Close it.",
        "tools": [AGENTS],
        "max_output_tokens": 24,
        "temperature": 0,
        "tool_choice": "required",
    }
    response = openai_client.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "close_agent" and json.loads(call.arguments) == {"target": "a1"}
    assert http.post("/v1/responses", json=kwargs).json()["output"][-1]["namespace"] == "multi_agent_v1"


def test_hosted_tools_are_dropped_and_logged(http, server):
    body = {
        "model": "m",
        "input": "Search.",
        "max_output_tokens": 2,
        "tools": [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"}],
    }
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    auto = http.post("/v1/responses", json={**body, "tool_choice": "required"})
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"  # no callable tool is left
    log = server.log_tail(200_000)
    assert "'web_search' are hosted tools" in log and "'image_generation' are hosted tools" in log


def test_custom_tool_history_round_trip(openai_client):
    """A custom call and its output in ``input`` (as Codex sends them back) render as a tool call and result."""
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Patch it."}]},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"},
    ]
    response = openai_client.responses.create(
        model="m", input=history, tools=[APPLY_PATCH], max_output_tokens=2, temperature=0
    )
    plain = openai_client.responses.create(
        model="m", input=history[:1], tools=[APPLY_PATCH], max_output_tokens=2, temperature=0
    )
    assert response.usage.input_tokens > plain.usage.input_tokens + 8


def test_compact(http):
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": "List the files."},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"},
            {"type": "message", "role": "assistant", "content": "a.py and b.py"},
        ],
    }
    response = http.post("/v1/responses/compact", json={**body, "max_output_tokens": 8})
    assert response.status_code == 200, response.text
    compacted = response.json()
    assert compacted["object"] == "response.compaction" and compacted["usage"]["input_tokens"] > 0
    output = compacted["output"]
    assert [item["role"] for item in output] == ["user", "user"]
    assert output[0]["content"] == "List the files." and isinstance(output[1]["content"][0]["text"], str)
    again = http.post("/v1/responses", json={"model": "m", "input": output, "max_output_tokens": 1})
    assert again.status_code == 200  # the compacted items are valid input
    assert http.post("/v1/responses/compact", json={"model": "m"}).status_code == 400
