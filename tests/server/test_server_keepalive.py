"""Keep-alive while a long prompt prefills: the first bytes of every streaming API go out as soon as the request is
accepted, and an idle stream sends keep-alives (Anthropic ``ping`` events, SSE comments for the OpenAI APIs) until
the first token. The server runs in this process on a real engine of the demo model whose first chunk is held back
(a slow prefill), with a short keep-alive interval."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from conftest import in_process_server

# Long against the first request's own start-up on a loaded 2-core machine (1.1 s seen in CI-like runs), so
# "sent at acceptance, long before the first token" is told apart from "sent with the first token".
PREFILL_S = 4.0
KEEPALIVE_S = 0.4


class SlowPrefill:
    """An `AsyncEngine` whose requests wait `delay_s` before their first chunk, as a long prompt's prefill does."""

    def __init__(self, engine, delay_s: float) -> None:
        self._engine = engine
        self._delay_s = delay_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params, request_id=None, **kwargs) -> AsyncIterator:
        await asyncio.sleep(self._delay_s)
        async for chunk in self._engine.generate(prompt_ids, params, request_id=request_id, **kwargs):
            yield chunk


@pytest.fixture(scope="module")
def slow_server() -> Iterator[str]:
    from freetoken.config import EngineConfig
    from freetoken.engine import AsyncEngine
    from freetoken.engine.llm_engine import LLMEngine
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.server.app import build_app

    engine = LLMEngine.from_dir(demo_checkpoint_dir(), EngineConfig(device="cpu", max_model_len=512))
    app = build_app(
        SlowPrefill(AsyncEngine(engine, "demo"), PREFILL_S), served_model_name="demo", keepalive_s=KEEPALIVE_S
    )
    with in_process_server(app) as base_url:
        yield base_url


def _timed_events(base_url: str, path: str, body: dict) -> list[tuple[float, str]]:
    """(seconds since the request was sent, raw SSE block) of every block of a streamed response."""
    start = time.monotonic()
    out = []
    with httpx.Client(base_url=base_url, timeout=60) as client, client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        buffer = ""
        for text in response.iter_text():
            buffer += text
            while "\n\n" in buffer:
                block, buffer = buffer.split("\n\n", 1)
                out.append((time.monotonic() - start, block))
    return out


def _data(block: str) -> dict | None:
    lines = [line[5:].strip() for line in block.split("\n") if line.startswith("data:")]
    return json.loads(lines[0]) if lines and lines[0] != "[DONE]" else None


def test_anthropic_message_start_then_pings_before_the_first_token(slow_server):
    events = _timed_events(
        slow_server,
        "/v1/messages",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    payloads = [(t, _data(block)) for t, block in events]
    first_block = next(t for t, p in payloads if p and p["type"] == "content_block_start")
    assert first_block >= PREFILL_S
    t0, start = payloads[0]
    assert start["type"] == "message_start" and start["message"]["usage"]["input_tokens"] > 0
    assert t0 < PREFILL_S / 2  # sent when the request was accepted, long before the first token
    pings = [t for t, p in payloads if p and p["type"] == "ping" and t < first_block]
    assert len(pings) >= 2  # every KEEPALIVE_S while the prompt "prefills"
    assert payloads[-1][1]["type"] == "message_stop"


def test_openai_role_chunk_and_comments_before_the_first_token(slow_server):
    events = _timed_events(
        slow_server,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    t0, first = events[0]
    assert t0 < PREFILL_S / 2 and _data(first)["choices"][0]["delta"]["role"] == "assistant"
    comments = [t for t, block in events if block.startswith(":")]
    assert len(comments) >= 2 and all(t < PREFILL_S + 1 for t in comments)
    assert events[-1][1] == "data: [DONE]"


def test_responses_created_and_in_progress_before_the_first_token(slow_server):
    events = _timed_events(
        slow_server, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3, "stream": True}
    )
    kinds = [(t, (_data(block) or {}).get("type")) for t, block in events]
    assert [k for _, k in kinds[:2]] == ["response.created", "response.in_progress"]
    assert kinds[1][0] < PREFILL_S / 2
    assert any(block.startswith(":") for _, block in events)
    assert kinds[-1][1] in ("response.completed", "response.incomplete")
