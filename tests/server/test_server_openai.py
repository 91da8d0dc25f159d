"""OpenAI chat completions against a real `ft serve` process, through the official SDK."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pydantic
import pytest

from conftest import MAX_MODEL_LEN, SERVED_MODEL_NAME
from schemas import CARD_SCHEMA

HELLO = [{"role": "user", "content": "Say hello."}]


def _greedy(openai_client, messages=HELLO, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return openai_client.chat.completions.create(model="any-name", messages=messages, temperature=0, **kwargs)


def test_health_and_models(http, openai_client):
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL_NAME]
    assert models.data[0].object == "model"
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert raw["data"][0]["max_output_tokens"] == MAX_MODEL_LEN  # the per-request cap (262144) within the context
    assert openai_client.models.retrieve(SERVED_MODEL_NAME).id == SERVED_MODEL_NAME


def test_non_streaming_shape(openai_client, demo_tokenizer):
    before = int(time.time())
    response = _greedy(openai_client, max_tokens=4)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == SERVED_MODEL_NAME  # any requested name is accepted; the served one is echoed
    assert before - 1 <= response.created <= time.time() + 1
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    prompt = demo_tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)
    assert usage.prompt_tokens == len(demo_tokenizer.encode(prompt))
    assert 1 <= usage.completion_tokens <= 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 4


def test_max_tokens_gives_length(openai_client):
    response = _greedy(openai_client, max_tokens=3, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    response = openai_client.chat.completions.create(model="m", messages=HELLO, temperature=0, max_completion_tokens=2)
    assert response.usage.completion_tokens <= 2


def test_streaming_matches_non_streaming(openai_client):
    full = _greedy(openai_client, max_tokens=12)
    stream = _greedy(openai_client, max_tokens=12, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == SERVED_MODEL_NAME for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content


def test_streaming_include_usage(openai_client):
    full = _greedy(openai_client, max_tokens=5)
    chunks = list(_greedy(openai_client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_framing(http, parse_sse):
    body = {"model": "m", "messages": HELLO, "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = parse_sse(raw)
    assert events[-1] == (None, "[DONE]")
    for name, data in events[:-1]:
        assert name is None
        assert json.loads(data)["object"] == "chat.completion.chunk"


def test_stop_strings(openai_client):
    text = _greedy(openai_client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text[: text.index(stop)]
    for stop_arg in (stop, [stop, "never-appears-zzz"]):
        response = _greedy(openai_client, max_tokens=16, stop=stop_arg, extra_body={"ignore_eos": True})
        assert response.choices[0].finish_reason == "stop"
        assert response.choices[0].message.content == cut
    streamed = _greedy(openai_client, max_tokens=16, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_seed_reproducible(openai_client):
    def sample(seed):
        return (
            openai_client.chat.completions.create(
                model="m",
                messages=HELLO,
                max_tokens=8,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
                extra_body={"top_k": 50},
            )
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)


def test_roles_and_content_parts(openai_client, demo_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks."},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    response = openai_client.chat.completions.create(
        model="m", messages=messages, tools=tools, max_tokens=3, temperature=0
    )
    assert response.choices[0].finish_reason in ("stop", "length")
    # The prompt is what the chat template renders, tools included.
    expected = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "What is\nthe weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks."},
    ]
    prompt = demo_tokenizer.apply_chat_template(expected, tools=tools, add_generation_prompt=True)
    assert "get_weather" in prompt
    assert response.usage.prompt_tokens == len(demo_tokenizer.encode(prompt))


def test_utf8_streaming(http, parse_sse):
    """Every streamed event decodes as UTF-8 on its own (parse_sse checks), and deltas join to the whole text."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Écris « héllo » 🙂 en 中文"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    full = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = parse_sse(response.read())
    deltas = [json.loads(data)["choices"][0]["delta"].get("content") or "" for _, data in events[:-1]]
    assert "".join(deltas) == full


def test_concurrent_requests(server):
    """Streams and plain requests of both APIs at once all complete (the engine batches them)."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        if i % 2:
            body = {"model": "m", "messages": HELLO, "max_tokens": 6, "stream": i % 4 == 1}
            response = await client.post("/v1/messages", json=body)
        else:
            body = {"model": "m", "messages": HELLO, "max_tokens": 6, "stream": i % 4 == 0}
            response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return len(response.content)

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert all(size > 0 for size in asyncio.run(main()))


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}},
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_forces_a_call(openai_client):
    response = _greedy(openai_client, tools=WEATHER_TOOLS, tool_choice=NAMED, max_tokens=20)
    choice = response.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith("{")
    assert hasattr(choice.message, "reasoning_content")

    chunks = list(_greedy(openai_client, tools=WEATHER_TOOLS, tool_choice=NAMED, max_tokens=20, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].index == 0 and pieces[0].id.startswith("call_") and pieces[0].type == "function"
    assert pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert all(not c.choices or not c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_leaves_tools_out(openai_client, demo_tokenizer):
    auto = _greedy(openai_client, tools=WEATHER_TOOLS, max_tokens=1)
    none = _greedy(openai_client, tools=WEATHER_TOOLS, tool_choice="none", max_tokens=1)
    plain = _greedy(openai_client, max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    with_tools = demo_tokenizer.apply_chat_template(HELLO, tools=WEATHER_TOOLS, add_generation_prompt=True)
    assert auto.usage.prompt_tokens == len(demo_tokenizer.encode(with_tools))
    required = _greedy(openai_client, tools=WEATHER_TOOLS, tool_choice="required", max_tokens=4)
    assert required.usage.prompt_tokens == auto.usage.prompt_tokens  # a grammar forces the call, not the prompt
    assert required.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_call_of_a_tool_with_defs_references(http):
    """A tool whose parameters refer to their own ``$defs`` (pydantic's form) can be forced on every API: the
    references used to resolve against the tool-calls grammar's root, a 400 ("Pointer '/$defs/Step' does not
    exist")."""
    step = {"type": "object", "properties": {"n": {"type": "integer"}}}
    params = {"$defs": {"Step": step}, "type": "object", "properties": {"step": {"$ref": "#/$defs/Step"}}}
    requests = [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 8, "tool_choice": "required",
                                  "tools": [{"type": "function", "function": {"name": "plan", "parameters": params}}]}),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 8, "tool_choice": {"type": "any"},
                          "tools": [{"name": "plan", "input_schema": params}]}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 8, "tool_choice": "required",
                           "tools": [{"type": "function", "name": "plan", "parameters": params}]}),
    ]  # fmt: skip
    for path, body in requests:
        response = http.post(path, json={"model": "m", **body})
        assert response.status_code == 200, (path, response.text)


def test_bad_tool_choice_is_400(http):
    base = {"model": "m", "messages": HELLO, "max_tokens": 1}
    cases = [
        (
            {"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": WEATHER_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ]
    for extra, param in cases:
        response = http.post("/v1/chat/completions", json={**base, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param


def test_logit_bias(openai_client, http, demo_tokenizer):
    """A +100 bias makes every greedy token the biased one (the sampler's tests cover -100 and the rest); bad maps
    are a 400 naming the field, ids past the vocabulary included."""
    token = demo_tokenizer.encode("hello")[0]
    forced = openai_client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=3, temperature=0, logit_bias={str(token): 100}, logprobs=True
    )
    assert forced.choices[0].message.content == demo_tokenizer.decode([token] * 3)
    assert len({e.token for e in forced.choices[0].logprobs.content}) == 1
    base = {"model": "m", "messages": HELLO, "max_tokens": 1}
    for bias, param in [
        ([1], "logit_bias"),
        ({"x": 1}, "logit_bias"),
        ({"-3": 1}, "logit_bias"),
        ({"5": 101}, "logit_bias.5"),
        ({"5": "high"}, "logit_bias.5"),
        ({str(10**9): 1}, "logit_bias"),
    ]:
        for stream in (False, True):  # streamed too: a 400 before the first byte, never a 200 with an error event
            response = http.post("/v1/chat/completions", json={**base, "logit_bias": bias, "stream": stream})
            assert response.status_code == 400, (bias, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "logit_bias" in error["message"], (bias, error)
    response = http.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True, "logit_bias": {str(10**9): 1}},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias", response.text


def test_multi_turn_tool_history(openai_client, http):
    """Arguments in history as a JSON string or as an object render the same prompt; several calls per turn."""

    def history(arguments):
        return [
            {"role": "user", "content": "Weather in Paris and Rome, then list files."},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Two cities.",
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments[0]},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments[1]},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "rain"}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_c", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_c", "content": "a.py"},
        ]

    as_strings = history(['{"city": "Paris"}', '{"city": "Rome"}'])
    response = openai_client.chat.completions.create(
        model="m",
        messages=as_strings,
        tools=WEATHER_TOOLS,
        tool_choice="auto",
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {
        "model": "m",
        "messages": history([{"city": "Paris"}, {"city": "Rome"}]),
        "tools": WEATHER_TOOLS,
        "max_tokens": 4,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    raw = http.post("/v1/chat/completions", json=body)
    assert raw.status_code == 200, raw.text
    assert raw.json()["usage"]["prompt_tokens"] == response.usage.prompt_tokens


def test_enable_thinking_false_shapes(openai_client, demo_tokenizer):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    response = _greedy(openai_client, max_tokens=4, extra_body=kwargs)
    prompt = demo_tokenizer.apply_chat_template(HELLO, enable_thinking=False)
    assert response.usage.prompt_tokens == len(demo_tokenizer.encode(prompt))
    message = response.choices[0].message
    assert message.reasoning_content is None and isinstance(message.content, str)
    chunks = list(_greedy(openai_client, max_tokens=4, stream=True, extra_body=kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content


def test_n_choices(openai_client):
    one = _greedy(openai_client, max_tokens=6)
    three = _greedy(openai_client, max_tokens=6, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)  # greedy
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    seeded = openai_client.chat.completions.create(model="m", messages=HELLO, max_tokens=6, n=2, seed=7)
    again = openai_client.chat.completions.create(model="m", messages=HELLO, max_tokens=6, n=2, seed=7)
    assert [c.message.content for c in seeded.choices] == [c.message.content for c in again.choices]

    chunks = list(_greedy(openai_client, max_tokens=6, n=3, stream=True, stream_options={"include_usage": True}))
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == one.choices[0].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [one.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == three.usage.completion_tokens


def test_n_with_forced_tool_calls(openai_client):
    response = _greedy(openai_client, tools=WEATHER_TOOLS, tool_choice=NAMED, max_tokens=20, n=2)
    assert [c.message.tool_calls[0].function.name for c in response.choices] == ["get_weather"] * 2
    ids = {c.message.tool_calls[0].id for c in response.choices}
    assert len(ids) == 2


def test_response_format_instructs(openai_client, demo_tokenizer, http):
    from freetoken.server.openai import JSON_OBJECT_INSTRUCTION

    response = _greedy(openai_client, max_tokens=2, response_format={"type": "json_object"})
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "system", "content": JSON_OBJECT_INSTRUCTION}, *HELLO], add_generation_prompt=True
    )
    assert response.usage.prompt_tokens == len(demo_tokenizer.encode(prompt))
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    with_system = [{"role": "system", "content": "Be terse."}, *HELLO]
    response = _greedy(
        openai_client,
        messages=with_system,
        max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
    )
    plain = _greedy(openai_client, messages=with_system, max_tokens=2)
    assert response.usage.prompt_tokens > plain.usage.prompt_tokens
    assert _greedy(openai_client, max_tokens=2, response_format={"type": "text"}).usage.prompt_tokens == (
        _greedy(openai_client, max_tokens=2).usage.prompt_tokens
    )
    for response_format, param in [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ]:
        bad = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": HELLO, "max_tokens": 1, "response_format": response_format},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


# Bounded, so that even the demo model's random weights reach the end within max_tokens: strings have a
# maxLength, numbers a range. Any decoding that is not constrained writes garbage here.
# The demo model, when its template leaves thinking on, opens a reasoning block and never closes it (random
# weights); the grammar allows that block before the JSON, so these tests turn thinking off.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_json_schema_is_enforced(openai_client, strict):
    spec = {"name": "card", "schema": CARD_SCHEMA}
    if strict is not None:
        spec["strict"] = strict
    fmt = {"type": "json_schema", "json_schema": spec}
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}):
        response = openai_client.chat.completions.create(
            model="m", messages=HELLO, max_tokens=200, response_format=fmt, extra_body=NO_THINKING, **kwargs
        )
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), CARD_SCHEMA)
    stream = openai_client.chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=200,
        response_format=fmt,
        extra_body=NO_THINKING,
        stream=True,
        temperature=1.0,
        seed=11,
        n=2,
    )
    texts = ["", ""]
    finishes = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "stop", 1: "stop"}
    for text in texts:
        jsonschema.validate(json.loads(text), CARD_SCHEMA)


class Card(pydantic.BaseModel):
    ok: bool
    name: str = pydantic.Field(max_length=6)
    count: int = pydantic.Field(ge=0, le=99)


def test_sdk_parse_helper(openai_client):
    """The SDK's ``parse`` sends a strict schema made from a pydantic model and validates the reply with it."""
    completion = openai_client.chat.completions.parse(
        model="m",
        messages=HELLO,
        max_tokens=200,
        response_format=Card,
        temperature=1.0,
        seed=5,
        extra_body=NO_THINKING,
    )
    card = completion.choices[0].message.parsed
    assert isinstance(card, Card) and 0 <= card.count <= 99


def test_response_format_json_object(openai_client):
    """Any object: unbounded, so the random demo model may run out of tokens; what it wrote is still the
    start of one JSON object, and a finished one parses."""
    response = openai_client.chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=24,
        response_format={"type": "json_object"},
        extra_body=NO_THINKING,
        temperature=0,
    )
    content = response.choices[0].message.content
    assert content.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert response.usage.completion_tokens == 24


def test_response_format_with_tools(openai_client, http):
    """Tools offered with a response format: the reply is the JSON or tool calls whose arguments match the
    tool's schema (the demo model takes either, by seed), never anything else."""
    parameters = {
        "type": "object",
        "properties": {"cmd": {"type": "string", "maxLength": 8}},
        "required": ["cmd"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "shell", "parameters": parameters}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD_SCHEMA}}
    response = openai_client.chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=200,
        response_format=fmt,
        tools=tools,
        extra_body=NO_THINKING,
        temperature=1.0,
        seed=2,
        n=4,
    )
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            assert not choice.message.content
            for call in choice.message.tool_calls:
                assert call.function.name == "shell"
                jsonschema.validate(json.loads(call.function.arguments), parameters)
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), CARD_SCHEMA)
    # Valid JSON Schema (an invalid one is refused before, naming the tool's parameters) that the grammar cannot
    # enforce: the 400 names the tools, not the format.
    unenforceable = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": unenforceable}}]
    bad = http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": HELLO,
            "max_tokens": 4,
            "tools": bad_tools,
            "response_format": {"type": "json_object"},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text


def test_response_format_errors(http):
    def post(response_format, **extra):
        return http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": HELLO, "max_tokens": 4, "response_format": response_format, **extra},
        )

    for response_format, param in [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}},
            "response_format.json_schema.schema",
        ),
        ("json", "response_format"),
    ]:
        bad = post(response_format)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert "x-guidance" not in bad.text  # the message names the problem, not the generated grammar
    # A pattern the grammar library cannot compile: the message says why (its reason is on a line of its own).
    bad = post({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}})
    assert bad.status_code == 400 and "unclosed character class" in bad.json()["error"]["message"], bad.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    bad = post({"type": "json_object"}, tools=tools, tool_choice="required")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice", bad.text
    assert http.get("/health").status_code == 200
