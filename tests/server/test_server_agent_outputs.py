"""What agents rely on, through the official SDKs and raw HTTP, streamed and not, against a real `ft serve` of the
demo model: forced tool calls constrained to the tool's schema, cut-short calls never leaking markup, Anthropic
structured outputs, stop strings that skip the reasoning, repetition penalties."""

from __future__ import annotations

import json
from typing import Literal

import pydantic
import pytest

HELLO = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "input_schema": CITY},
    {"name": "list_files", "input_schema": {"type": "object", "properties": {}}},
]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]
MARKUP = ("<tool_call>", "</tool_call>")


def _valid_city(arguments: str) -> bool:
    return json.loads(arguments) in ({"city": "Paris"}, {"city": "Rome"})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_matches_the_schema_openai(openai_client, tool_choice):
    """The random demo model cannot write a call on its own; the grammar makes it write one whose arguments
    match the schema (an enum here), streamed and not, with the same result."""
    kwargs = {
        "model": "m",
        "messages": HELLO,
        "tools": OPENAI_TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 40,
        "temperature": 0,
    }
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    first = choice.message.tool_calls[0]
    if isinstance(tool_choice, dict):
        assert first.function.name == "get_weather"
    if first.function.name == "get_weather":
        assert _valid_city(first.function.arguments)
    else:
        assert json.loads(first.function.arguments) == {}
    assert choice.message.content is None
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [p.function.name for p in pieces if p.index == 0 and p.function.name] == [first.function.name]
    assert "".join(p.function.arguments or "" for p in pieces if p.index == 0) == first.function.arguments
    assert all(not c.choices or not c.choices[0].delta.content for c in chunks)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_call_matches_the_schema_anthropic(anthropic_client, http, parse_sse, tool_choice):
    kwargs = {
        "model": "claude-any",
        "messages": HELLO,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 40,
    }
    message = anthropic_client.messages.create(**kwargs, extra_body={"temperature": 0})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(b.type != "text" for b in message.content)
    if tool_choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    if uses[0].name == "get_weather":
        assert uses[0].input in ({"city": "Paris"}, {"city": "Rome"})
    with http.stream("POST", "/v1/messages", json={**kwargs, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        events = [json.loads(data) for _, data in parse_sse(response.read())]
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0
    )
    assert json.loads(partial) == uses[0].input


def test_forced_call_matches_the_schema_responses(openai_client):
    kwargs = {
        "model": "m",
        "input": "Weather in Paris?",
        "tools": RESPONSES_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 40,
        "temperature": 0,
    }
    response = openai_client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and _valid_city(calls[0].arguments)
    assert not [item for item in response.output if item.type == "message"]
    events = list(openai_client.responses.create(**kwargs, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == calls[0].arguments


def test_cut_short_call_never_leaks_markup(openai_client, anthropic_client, http, parse_sse):
    """A forced call cut by max_tokens before its header is whole: no raw tool-call markup in any API, streamed
    or not (the block is dropped; the finish reason says the budget ran out)."""
    chat = {
        "model": "m",
        "messages": HELLO,
        "tools": OPENAI_TOOLS,
        "tool_choice": "required",
        "max_tokens": 3,
        "temperature": 0,
    }
    choice = openai_client.chat.completions.create(**chat).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert not any(tag in (choice.message.content or "") for tag in MARKUP)
    streamed = http.post("/v1/chat/completions", json={**chat, "stream": True}).text
    assert not any(tag in streamed for tag in MARKUP)
    messages = {
        "model": "claude-any",
        "messages": HELLO,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "any"},
        "max_tokens": 3,
    }
    message = anthropic_client.messages.create(**messages, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens"
    assert not any(tag in json.dumps(message.model_dump()) for tag in MARKUP)
    streamed = http.post("/v1/messages", json={**messages, "temperature": 0, "stream": True}).text
    assert not any(tag in streamed for tag in MARKUP)
    responses = {
        "model": "m",
        "input": "Weather?",
        "tools": RESPONSES_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 3,
        "temperature": 0,
    }
    response = openai_client.responses.create(**responses)
    assert response.status == "incomplete" and not any(tag in response.model_dump_json() for tag in MARKUP)
    streamed = http.post("/v1/responses", json={**responses, "stream": True}).text
    assert not any(tag in streamed for tag in MARKUP)
    # the same cut, written by the model on its own (a +100 bias on the opening tag), with tools offered (auto)
    opening = {str(_token_id(http, "<tool_call>")): 100}
    auto = {**chat, "tool_choice": "auto", "logit_bias": opening}
    choice = openai_client.chat.completions.create(**auto).choices[0]
    assert not choice.message.tool_calls and not any(tag in (choice.message.content or "") for tag in MARKUP)
    assert not any(tag in http.post("/v1/chat/completions", json={**auto, "stream": True}).text for tag in MARKUP)


def _token_id(http, text: str) -> int:
    """The id of `text`, a single token of the demo's tokenizer (through the text completions' logprobs)."""
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.tokenizer import Tokenizer

    del http
    [token] = Tokenizer.from_dir(demo_checkpoint_dir()).encode(text)
    return token


class Verdict(pydantic.BaseModel):
    ok: bool
    city: Literal["Paris", "Rome"]


def test_anthropic_structured_outputs(anthropic_client, http, parse_sse):
    """``messages.parse`` (output_config.format) gives a parsed model; the raw stream's text is JSON matching the
    schema; the beta's top-level output_format works alike; a bad format is a 400 naming the field."""
    parsed = anthropic_client.messages.parse(
        model="claude-any",
        max_tokens=60,
        messages=HELLO,
        output_format=Verdict,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert isinstance(parsed.parsed_output, Verdict)
    assert parsed.stop_reason == "end_turn"
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    for field in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        body = {
            "model": "claude-any",
            "messages": HELLO,
            "max_tokens": 40,
            "temperature": 0,
            "thinking": {"type": "disabled"},
            **field,
        }
        whole = http.post("/v1/messages", json=body).json()
        assert 0 <= json.loads(whole["content"][-1]["text"])["n"] <= 9, whole
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
            events = [json.loads(data) for _, data in parse_sse(response.read())]
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        assert text == whole["content"][-1]["text"]
    for field, param in [
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
        ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
        (
            {"output_format": {"type": "json_schema", "schema": {"type": "string", "pattern": "[a-"}}},
            "output_format.schema",
        ),
    ]:
        bad = http.post("/v1/messages", json={"model": "c", "messages": HELLO, "max_tokens": 4, **field})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
        assert param in bad.text


def test_stop_string_does_not_end_the_reasoning(openai_client):
    """A +100 bias makes the demo open a reasoning block and stay in it (every token ``<think>``): a stop string
    found there does not end the request (it did, with an empty reply); without reasoning tags it would."""
    think = _token_id(None, "<think>")
    kwargs = {"model": "m", "messages": HELLO, "max_tokens": 5, "temperature": 0, "logit_bias": {str(think): 100}}
    choice = openai_client.chat.completions.create(**kwargs, stop=["<think>"]).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content == "<think>" * 4  # the first of the 5 opens the block
    no_think = openai_client.chat.completions.create(
        **kwargs, stop=["<think>"], extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    ).choices[0]
    assert (no_think.finish_reason, no_think.message.content) == ("stop", "")


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_change_greedy_output_at_the_first_repeat(openai_client, penalty):
    """The demo's greedy output repeats a token; with the penalty the output is the same up to that repeat and
    differs there (the penalty lowers only tokens already generated)."""
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "temperature": 0,
        "logprobs": True,
    }
    base = [t.token for t in openai_client.chat.completions.create(**kwargs).choices[0].logprobs.content]
    repeat = next(i for i, token in enumerate(base) if token in base[:i])
    penalized = openai_client.chat.completions.create(**kwargs, **{penalty: 2.0}).choices[0].logprobs.content
    penalized = [t.token for t in penalized]
    assert penalized[:repeat] == base[:repeat]
    assert penalized[repeat] != base[repeat]
    repetition = openai_client.chat.completions.create(**kwargs, extra_body={"repetition_penalty": 1.5})
    assert [t.token for t in repetition.choices[0].logprobs.content] != base
    for bad in ({"frequency_penalty": 2.5}, {"repetition_penalty": 0}):
        with pytest.raises(Exception, match="400"):
            openai_client.chat.completions.create(**{**kwargs, "max_tokens": 1}, extra_body=bad)
