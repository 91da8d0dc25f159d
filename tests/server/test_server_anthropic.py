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


def _prompt_tokens(usage) -> int:
    """All the prompt's tokens: Anthropic's input_tokens leaves out those read from or written to the prefix cache."""
    u = usage if isinstance(usage, dict) else usage.model_dump()
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


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
    # No thinking field: thinking off, as the Anthropic API's default.
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, *HELLO], add_generation_prompt=True, enable_thinking=False
    )
    assert _prompt_tokens(message.usage) == len(demo_tokenizer.encode(prompt))


def test_system_blocks_and_content_blocks(anthropic_client):
    as_strings = _greedy(anthropic_client, system="Be brief.\nBe kind.", max_tokens=6)
    as_blocks = _greedy(
        anthropic_client,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_tokens=6,
    )
    assert _prompt_tokens(as_blocks.usage) == _prompt_tokens(as_strings.usage)
    assert as_blocks.content[0].text == as_strings.content[0].text


def test_count_tokens_matches_usage(anthropic_client):
    message = _greedy(anthropic_client, system="Count me.", max_tokens=2)
    counted = anthropic_client.messages.count_tokens(model="claude-any", system="Count me.", messages=HELLO)
    assert counted.input_tokens == _prompt_tokens(message.usage)


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
    assert _prompt_tokens(start["usage"]) == _prompt_tokens(full.usage)
    assert payloads[1]["content_block"] == {"type": "text", "text": ""}
    deltas = [p["delta"] for p in payloads if p["type"] == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == full.content[0].text
    message_delta = payloads[-2]
    assert message_delta["delta"]["stop_reason"] == full.stop_reason
    assert message_delta["usage"]["output_tokens"] == full.usage.output_tokens
    assert _prompt_tokens(message_delta["usage"]) == _prompt_tokens(full.usage)


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
    tools = [
        {
            "name": "get_weather",
            "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                {"type": "text", "text": "Summarise."},
            ],
        },
    ]
    with_tools = anthropic_client.messages.count_tokens(model="claude-any", messages=messages, tools=tools)
    without = anthropic_client.messages.count_tokens(model="claude-any", messages=messages)
    assert with_tools.input_tokens > without.input_tokens  # tool definitions reach the template
    message = anthropic_client.messages.create(
        model="claude-any", messages=messages, tools=tools, max_tokens=3, extra_body=GREEDY
    )
    assert _prompt_tokens(message.usage) == with_tools.input_tokens


def test_models_in_anthropic_shape(anthropic_client):
    models = anthropic_client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL_NAME]
    assert models.data[0].type == "model"
    assert anthropic_client.models.retrieve(SERVED_MODEL_NAME).id == SERVED_MODEL_NAME


TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"name": "list_files", "input_schema": {"type": "object", "properties": {}}},
]
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}


def test_tool_choice_tool_gives_tool_use(anthropic_client):
    message = _greedy(anthropic_client, tools=TOOLS, tool_choice=FORCE_WEATHER, max_tokens=20)
    assert message.stop_reason in ("tool_use", "max_tokens")
    tool_uses = [b for b in message.content if b.type == "tool_use"]
    assert len(tool_uses) == 1
    assert tool_uses[0].name == "get_weather" and tool_uses[0].id.startswith("toolu_")
    assert isinstance(tool_uses[0].input, dict)
    counted = anthropic_client.messages.count_tokens(
        model="claude-any", messages=HELLO, tools=TOOLS, tool_choice=FORCE_WEATHER
    )
    assert counted.input_tokens == _prompt_tokens(message.usage)


def test_tool_use_stream_events(http, parse_sse):
    body = {
        "model": "claude-any",
        "messages": HELLO,
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "tools": TOOLS,
        "tool_choice": FORCE_WEATHER,
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        events = [(name, json.loads(data)) for name, data in parse_sse(response.read())]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert block["id"].startswith("toolu_")
    deltas = [p["delta"] for name, p in events if name == "content_block_delta" and p["index"] == 0]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
    assert "".join(d["partial_json"] for d in deltas).startswith("{")
    starts = [p["index"] for name, p in events if name == "content_block_start"]
    stops = [p["index"] for name, p in events if name == "content_block_stop"]
    assert starts == stops == list(range(len(starts)))
    assert events[-2][1]["delta"]["stop_reason"] in ("tool_use", "max_tokens")


def test_tool_choice_none_and_any(anthropic_client):
    plain = anthropic_client.messages.count_tokens(model="claude-any", messages=HELLO)
    none = anthropic_client.messages.count_tokens(
        model="claude-any", messages=HELLO, tools=TOOLS, tool_choice={"type": "none"}
    )
    auto = anthropic_client.messages.count_tokens(
        model="claude-any", messages=HELLO, tools=TOOLS, tool_choice={"type": "auto"}
    )
    assert none.input_tokens == plain.input_tokens < auto.input_tokens
    message = _greedy(anthropic_client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=4)
    assert _prompt_tokens(message.usage) == auto.input_tokens  # a grammar forces the call, not the prompt
    assert message.stop_reason in ("tool_use", "max_tokens", "end_turn")


def test_bad_tool_choice_is_400(http):
    base = {"model": "m", "messages": HELLO, "max_tokens": 1}
    for extra, param in [
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ]:
        response = http.post("/v1/messages", json={**base, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["type"] == "error"
        assert param in response.json()["error"]["message"]


def test_multi_turn_tool_loop_with_thinking(anthropic_client):
    """A Claude-Code-like history: thinking, several tool_use blocks, tool_result arrays, unknown blocks."""
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain", "is_error": False},
                {"type": "some_future_block", "payload": {"x": 1}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
                {"type": "text", "text": "Paris sunny, Rome rain."},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}}]},
    ]
    message = anthropic_client.messages.create(
        model="claude-any",
        messages=messages,
        tools=TOOLS,
        max_tokens=4,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert all(block.type in ("thinking", "text", "tool_use") for block in message.content)
    counted = anthropic_client.messages.count_tokens(
        model="claude-any", messages=messages, tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert counted.input_tokens == _prompt_tokens(message.usage)
    with anthropic_client.messages.stream(
        model="claude-any",
        messages=messages,
        tools=TOOLS,
        max_tokens=4,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in message.content]


def test_thinking_and_tool_use_blocks_accepted_by_the_sdk():
    """Realistic Qwen3 output, parsed and shaped as this server does, validates as the SDK's Message, and
    its stream (no signature_delta) accumulates in the SDK to the same blocks."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    from freetoken.engine.types import GenerationChunk
    from freetoken.server.anthropic import _BlockStream, message_body
    from freetoken.server.generation import Completion
    from freetoken.server.parsers import ParserOptions, parse_text
    from freetoken.server.parsers.qwen3 import Qwen3Parser

    text = (
        '<think>\nParis first.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
    )
    options = ParserOptions(prompt_text="", parse_tools=True)
    output = parse_text(Qwen3Parser(options), text)
    completion = Completion(text, "stop", None, 10, 20)
    body = Message.model_validate(message_body("msg_1", "m", completion, output, []))
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert body.content[0].thinking == "Paris first." and body.stop_reason == "tool_use"
    assert body.content[2].input == {"city": "Paris"} and body.content[3].input == {}

    parser, blocks = Qwen3Parser(options), _BlockStream()
    raw = [b for i in range(0, len(text), 7) for b in blocks.events(parser.feed(text[i : i + 7]))]
    raw += blocks.events(parser.finish()) + blocks.close(GenerationChunk(text, [], finish_reason="stop"))
    adapter = TypeAdapter(RawMessageStreamEvent)
    start = {"type": "message_start", "message": {**body.model_dump(), "content": []}}
    snapshot, json_bufs = None, {}
    for payload in [start] + [json.loads(e.split(b"data: ", 1)[1]) for e in raw if b"event: ping" not in e]:
        snapshot = accumulate_event(
            event=adapter.validate_python(payload), current_snapshot=snapshot, json_bufs=json_bufs
        )
    assert [(b.type, getattr(b, "input", None)) for b in snapshot.content] == [
        (b.type, getattr(b, "input", None)) for b in body.content
    ]
    assert snapshot.content[0].thinking == "Paris first." and snapshot.content[0].signature == ""
