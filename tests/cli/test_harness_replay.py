"""Replays of real harnesses' requests (recorded under ``tests/fixtures/harness/``) against the demo server.

Each fixture is a request a harness sent, as it sent it (ids that identify a machine or session replaced; see
`test_harness_claude_code.py`, which records Claude Code's). Replaying them catches a regression on the shapes
the harnesses really send without running their binaries: every one must be answered 2xx with a well-formed body
(a Messages object, or a complete event stream).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness"
CLAUDE_CODE = sorted((FIXTURES / "claude_code").glob("*.json"))


def check_message(body: dict) -> None:
    """A non-streamed Messages object as the Anthropic SDK reads it."""
    assert body["type"] == "message" and body["role"] == "assistant", body
    assert body["content"] and all(block["type"] in ("text", "thinking", "tool_use") for block in body["content"])
    assert body["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert body["usage"]["output_tokens"] >= 1


def check_message_stream(events: list[tuple[str | None, str]]) -> None:
    """A Messages event stream: message_start (with its usage) ... message_delta, message_stop; every
    content block started, added to and stopped in order."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    start = json.loads(events[0][1])["message"]
    assert {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"} <= set(start["usage"])
    open_block = None
    for name, data in events:
        payload = json.loads(data)
        assert payload["type"] == name
        if name == "content_block_start":
            assert open_block is None
            open_block = payload["index"]
        elif name == "content_block_delta":
            assert payload["index"] == open_block
        elif name == "content_block_stop":
            assert payload["index"] == open_block
            open_block = None
    assert open_block is None
    delta = json.loads(events[-2][1])
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")


@pytest.mark.slow
@pytest.mark.parametrize("fixture", CLAUDE_CODE, ids=[path.stem for path in CLAUDE_CODE])
def test_claude_code_requests_replay(long_server, parse_sse, fixture):
    record = json.loads(fixture.read_text())
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219",
        "x-api-key": "sk-ant-test-dummy",
    }
    with httpx.Client(base_url=long_server.base_url, timeout=300) as client:
        response = client.post(record["path"], json=record["body"], headers=headers)
        assert response.status_code == 200, (response.text, long_server.log_tail())
        if record["body"].get("stream"):
            events = parse_sse(response.content)
            check_message_stream(events)
            usage = json.loads(events[0][1])["message"]["usage"]
        else:
            check_message(response.json())
            usage = response.json()["usage"]
        # input_tokens leaves out what the prefix cache read or took in.
        input_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        # count_tokens takes the same body (less what only creates messages) and agrees with the answer's usage.
        counted = client.post("/v1/messages/count_tokens", headers=headers, json={
            k: v for k, v in record["body"].items() if k not in ("max_tokens", "stream", "metadata")
        })  # fmt: skip
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] == input_tokens > 1000
