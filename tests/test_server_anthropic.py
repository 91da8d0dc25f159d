"""Anthropic Messages against a real `ft serve` process, through the official SDK and raw SSE."""

from __future__ import annotations

import json

from conftest import SERVED_MODEL_NAME

HELLO = [{"role": "user", "content": "Say hello."}]


# Anthropic's SDK no longer takes sampling parameters as arguments; the API still does (extra_body).
GREEDY = {"temperature": 0}


def _greedy(anthropic_client, messages=HELLO, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return anthropic_client.messages.create(model="claude-any", messages=messages, extra_body=GREEDY, **kwargs)


def test_non_streaming_shape(anthropic_client, demo_tokenizer):
    message = _greedy(anthropic_client, max_tokens=3, system="You are terse.")
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == SERVED_MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert 1 <= message.usage.output_tokens <= 3
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 3
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, *HELLO], add_generation_prompt=True
    )
    assert message.usage.input_tokens == len(demo_tokenizer.encode(prompt))


def test_system_blocks_and_content_blocks(anthropic_client):
    as_strings = _greedy(anthropic_client, system="Be brief.\nBe kind.", max_tokens=6)
    as_blocks = _greedy(
        anthropic_client,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_tokens=6,
    )
    assert as_blocks.usage.input_tokens == as_strings.usage.input_tokens
    assert as_blocks.content[0].text == as_strings.content[0].text


def test_count_tokens_matches_usage(anthropic_client):
    message = _greedy(anthropic_client, system="Count me.", max_tokens=2)
    counted = anthropic_client.messages.count_tokens(
        model="claude-any", system="Count me.", messages=HELLO
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_raw_stream_event_order(http, parse_sse, anthropic_client):
    full = _greedy(anthropic_client, max_tokens=10)
    body = {"model": "claude-any", "messages": HELLO, "max_tokens": 10, "temperature": 0, "stream": True}
    headers = {"anthropic-version": "2023-06-01"}
    with http.stream("POST", "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read())
    names = [name for name, _ in events]
    num_deltas = names.count("content_block_delta")
    assert names == (
        ["message_start", "content_block_start", "ping"]
        + ["content_block_delta"] * num_deltas
        + ["content_block_stop", "message_delta", "message_stop"]
    )
    payloads = [json.loads(data) for _, data in events]
    assert [p["type"] for p in payloads] == names
    start = payloads[0]["message"]
    assert start["id"].startswith("msg_") and start["model"] == SERVED_MODEL_NAME
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == full.usage.input_tokens
    assert payloads[1]["content_block"] == {"type": "text", "text": ""}
    deltas = [p["delta"] for p in payloads if p["type"] == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == full.content[0].text
    message_delta = payloads[-2]
    assert message_delta["delta"]["stop_reason"] == full.stop_reason
    assert message_delta["usage"]["output_tokens"] == full.usage.output_tokens


def test_sdk_stream(anthropic_client):
    full = _greedy(anthropic_client, max_tokens=8)
    with anthropic_client.messages.stream(
        model="claude-any", messages=HELLO, max_tokens=8, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_stop_sequences(anthropic_client):
    text = _greedy(anthropic_client, max_tokens=16).content[0].text
    stop = text[3:6] if len(text) >= 6 else None
    if stop is None or stop.isspace():
        # The random model ended too early to cut; a sequence that never occurs must not stop it.
        message = _greedy(anthropic_client, max_tokens=4, stop_sequences=["never-appears-zzz"])
        assert message.stop_reason in ("end_turn", "max_tokens")
        return
    message = _greedy(anthropic_client, max_tokens=16, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_sampling_params_accepted(anthropic_client):
    message = anthropic_client.messages.create(
        model="claude-any", messages=HELLO, max_tokens=4, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 40}
    )
    assert message.usage.output_tokens <= 4


def test_tool_use_history_renders(anthropic_client):
    tools = [{
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
            {"type": "text", "text": "Summarise."},
        ]},
    ]
    with_tools = anthropic_client.messages.count_tokens(model="claude-any", messages=messages, tools=tools)
    without = anthropic_client.messages.count_tokens(model="claude-any", messages=messages)
    assert with_tools.input_tokens > without.input_tokens  # tool definitions reach the template
    message = anthropic_client.messages.create(
        model="claude-any", messages=messages, tools=tools, max_tokens=3, extra_body=GREEDY
    )
    assert message.usage.input_tokens == with_tools.input_tokens


def test_models_in_anthropic_shape(anthropic_client):
    models = anthropic_client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL_NAME]
    assert models.data[0].type == "model"
    assert anthropic_client.models.retrieve(SERVED_MODEL_NAME).id == SERVED_MODEL_NAME
