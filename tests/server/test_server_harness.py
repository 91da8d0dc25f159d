"""What agent harnesses send (issue 19), against a real `ft serve` process: the official SDKs and raw HTTP, streamed
and not.

Each test pins the prompt the server built by its token count (usage, count_tokens), compared with the demo's chat
template rendering of what the request should become, so it fails when the server renders anything else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import anthropic
import openai
import pytest

from conftest import MAX_MODEL_LEN, ServerProcess, start_server

USER = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0}
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SEARCH = {"name": "search_files", "description": "Find files", "input_schema": {"type": "object", "properties": {}}}


def as_function(tool: dict) -> dict:
    """An Anthropic tool as the chat template takes it."""
    return {"type": "function", "function": {
        "name": tool["name"], **({"description": tool["description"]} if "description" in tool else {}),
        "parameters": tool["input_schema"],
    }}  # fmt: skip


def num_tokens(tokenizer, messages, tools=None, *, thinking: bool | None = False, prefill: str | None = None) -> int:
    """Tokens of `messages` rendered by the demo's template with the generation prompt (+ `prefill`);
    `thinking` None leaves the template's default (thinking on)."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
    return len(tokenizer.encode(text + (prefill or "")))


def prompt_tokens(usage) -> int:
    """All of an Anthropic usage's prompt tokens: input_tokens leaves out those read from or written to the
    prefix cache."""
    u = usage if isinstance(usage, dict) else usage.model_dump()
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


def anthropic_usage_streamed(http, parse_sse, body: dict) -> tuple[int, dict]:
    """POST a streamed Messages request; (message_start's prompt tokens, the message_delta event)."""
    response = http.post("/v1/messages", json={**body, "stream": True}, headers=ANTHROPIC_HEADERS)
    assert response.status_code == 200, response.text
    events = [(name, json.loads(data)) for name, data in parse_sse(response.content)]
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    delta = next(data for name, data in events if name == "message_delta")
    return prompt_tokens(events[0][1]["message"]["usage"]), delta


def count(anthropic_client, **body) -> int:
    return anthropic_client.messages.count_tokens(model="claude-any", **body).input_tokens


# --- 1. role "system" entries inside Anthropic messages ---------------------------------------------------------


ENV_BLOCK = "# Environment\n - Primary working directory: /tmp/x"


def test_system_entries_in_messages_merge_into_the_system_turn(anthropic_client, http, parse_sse, demo_tokenizer):
    messages = [*USER, {"role": "system", "content": [{"type": "text", "text": ENV_BLOCK}]}]
    expected = num_tokens(demo_tokenizer, [{"role": "system", "content": f"Be brief.\n\n{ENV_BLOCK}"}, *USER])
    assert count(anthropic_client, system="Be brief.", messages=messages) == expected
    message = anthropic_client.messages.create(
        model="claude-any", system="Be brief.", messages=messages, max_tokens=2, extra_body=GREEDY
    )
    assert prompt_tokens(message.usage) == expected
    streamed, _ = anthropic_usage_streamed(
        http, parse_sse, {"model": "m", "system": "Be brief.", "messages": messages, "max_tokens": 2, **GREEDY}
    )
    assert streamed == expected
    # Without a system field, in order, as the leading system turn.
    two = [{"role": "system", "content": "one"}, *USER, {"role": "system", "content": "two"}]
    assert count(anthropic_client, messages=two) == num_tokens(
        demo_tokenizer, [{"role": "system", "content": "one\n\ntwo"}, *USER]
    )


# --- 2 and 12. thinking: adaptive, enabled without a budget, unknown types; absent = off ----------------------


@pytest.mark.parametrize("thinking", [
    {"type": "adaptive"}, {"type": "adaptive", "display": "omitted"}, {"type": "enabled"},
    {"type": "enabled", "budget_tokens": 2048}, {"type": "future_mode_2027"},
])  # fmt: skip
def test_thinking_types_turn_thinking_on(anthropic_client, http, parse_sse, demo_tokenizer, thinking):
    expected = num_tokens(demo_tokenizer, USER, thinking=True)
    assert count(anthropic_client, messages=USER, thinking=thinking) == expected
    body = {"model": "m", "messages": USER, "max_tokens": 2, "thinking": thinking, **GREEDY}
    response = http.post("/v1/messages", json=body, headers=ANTHROPIC_HEADERS)
    assert response.status_code == 200, response.text
    assert prompt_tokens(response.json()["usage"]) == expected
    assert anthropic_usage_streamed(http, parse_sse, body)[0] == expected


def test_no_thinking_field_means_thinking_off(anthropic_client, demo_tokenizer):
    off = num_tokens(demo_tokenizer, USER, thinking=False)
    assert off != num_tokens(demo_tokenizer, USER, thinking=True)
    assert count(anthropic_client, messages=USER) == off
    assert count(anthropic_client, messages=USER, thinking={"type": "disabled"}) == off
    message = anthropic_client.messages.create(model="claude-any", messages=USER, max_tokens=2, extra_body=GREEDY)
    assert prompt_tokens(message.usage) == off


# --- 12. prefill: a final assistant message is continued -------------------------------------------------------


def test_anthropic_prefill_is_continued(anthropic_client, http, parse_sse, demo_tokenizer):
    prefill = "The answer is"
    messages = [*USER, {"role": "assistant", "content": prefill}]
    expected = num_tokens(demo_tokenizer, USER, prefill=prefill)
    closed = num_tokens(demo_tokenizer, [*USER, {"role": "assistant", "content": prefill}])
    assert expected != closed
    assert count(anthropic_client, messages=messages) == expected
    message = anthropic_client.messages.create(model="claude-any", messages=messages, max_tokens=2, extra_body=GREEDY)
    assert prompt_tokens(message.usage) == expected
    body = {
        "model": "m",
        "messages": [*USER, {"role": "assistant", "content": [{"type": "text", "text": prefill}]}],
        "max_tokens": 2,
        **GREEDY,
    }
    assert anthropic_usage_streamed(http, parse_sse, body)[0] == expected


def test_openai_continue_final_message(openai_client, http, demo_tokenizer):
    prefill = "Sure, here"
    messages = [*USER, {"role": "assistant", "content": prefill}]
    expected = num_tokens(demo_tokenizer, USER, thinking=None, prefill=prefill)
    response = openai_client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, temperature=0, extra_body={"continue_final_message": True}
    )
    assert response.usage.prompt_tokens == expected
    stream = openai_client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"continue_final_message": True},
    )  # fmt: skip
    assert [chunk.usage for chunk in stream if chunk.usage][0].prompt_tokens == expected
    # Without the flag the assistant turn is closed and a new one opened.
    closed = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    assert closed.usage.prompt_tokens == num_tokens(demo_tokenizer, messages, thinking=None)
    bad = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


# --- 12. server tools; 8. deferred tools and tool_reference ----------------------------------------------------


def test_server_tools_are_not_offered(anthropic_client, demo_tokenizer):
    server_tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "web_fetch_20250910", "name": "web_fetch"},
    ]
    expected = num_tokens(demo_tokenizer, USER, [as_function(WEATHER)])
    assert count(anthropic_client, messages=USER, tools=[*server_tools, WEATHER]) == expected
    message = anthropic_client.messages.create(
        model="claude-any", messages=USER, tools=[*server_tools, WEATHER], max_tokens=2, extra_body=GREEDY
    )
    assert prompt_tokens(message.usage) == expected
    assert count(anthropic_client, messages=USER, tools=server_tools) == num_tokens(demo_tokenizer, USER)


def _tool_search_history(result_content) -> list[dict]:
    return [
        *USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "files"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}]},
    ]


def _rendered_history(tool_text: str) -> list[dict]:
    return [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "ToolSearch", "arguments": {"query": "files"}},
                }
            ],
        },
        {"role": "tool", "content": tool_text, "tool_call_id": "toolu_1"},
    ]


def test_deferred_tools_wait_for_a_tool_reference(anthropic_client, http, parse_sse, demo_tokenizer):
    deferred = {**SEARCH, "defer_loading": True}
    tool_search = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {}}}
    tools = [tool_search, deferred]
    # Not referenced: not offered.
    assert count(anthropic_client, messages=USER, tools=tools) == num_tokens(
        demo_tokenizer, USER, [as_function(tool_search)]
    )
    # A tool_reference in a tool_result: its text is rendered, and the tool is offered from then on.
    history = _tool_search_history([{"type": "tool_reference", "tool_name": "search_files"}])
    expected = num_tokens(
        demo_tokenizer,
        _rendered_history("Tool search_files is now available."),
        [as_function(tool_search), as_function(SEARCH)],
    )
    assert count(anthropic_client, messages=history, tools=tools) == expected
    message = anthropic_client.messages.create(
        model="claude-any", messages=history, tools=tools, max_tokens=2, extra_body=GREEDY
    )
    assert prompt_tokens(message.usage) == expected
    body = {"model": "m", "messages": history, "tools": tools, "max_tokens": 2, **GREEDY}
    assert anthropic_usage_streamed(http, parse_sse, body)[0] == expected
    # A deferred tool already called in the history is loaded too.
    called = [
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "search_files", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "a.py"}]},
    ]
    rendered = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "toolu_2", "type": "function", "function": {"name": "search_files", "arguments": {}}}
            ],
        },
        {"role": "tool", "content": "a.py", "tool_call_id": "toolu_2"},
    ]
    assert count(anthropic_client, messages=called, tools=tools) == num_tokens(
        demo_tokenizer, rendered, [as_function(tool_search), as_function(SEARCH)]
    )


# --- 5. images and documents become placeholders -----------------------------------------------------------------


PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
IMAGE_TEXT = "[image (image/png) omitted: this model reads text only]"


def test_anthropic_images_and_documents_become_placeholders(anthropic_client, http, parse_sse, demo_tokenizer, server):
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
        "title": "spec",
    }
    text_doc = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "Line one."},
        "title": "notes",
    }
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": PNG}, pdf,
                                     text_doc]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [
            {"type": "text", "text": "Sunny."}, {"type": "image", "source": PNG}]}]},
    ]  # fmt: skip
    rendered = [
        {"role": "user", "content": "\n".join([
            "Look:", IMAGE_TEXT, "[document (application/pdf, 'spec') omitted: this model reads text only]",
            "notes\n\nLine one.",
        ])},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": f"Sunny.\n{IMAGE_TEXT}", "tool_call_id": "toolu_9"},
    ]  # fmt: skip
    expected = num_tokens(demo_tokenizer, rendered, [as_function(WEATHER)])
    assert count(anthropic_client, messages=messages, tools=[WEATHER]) == expected
    message = anthropic_client.messages.create(
        model="claude-any", messages=messages, tools=[WEATHER], max_tokens=2, extra_body=GREEDY
    )
    assert prompt_tokens(message.usage) == expected
    body = {"model": "m", "messages": messages, "tools": [WEATHER], "max_tokens": 2, **GREEDY}
    assert anthropic_usage_streamed(http, parse_sse, body)[0] == expected
    assert "image content replaced by a text placeholder" in server.log_tail(200_000)


def test_openai_image_parts_become_placeholders(openai_client, demo_tokenizer):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
    ]}]  # fmt: skip
    expected = num_tokens(
        demo_tokenizer,
        [{"role": "user", "content": "What is this?\n[image omitted: this model reads text only]"}],
        thinking=None,
    )
    response = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    assert response.usage.prompt_tokens == expected
    stream = openai_client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    assert [chunk.usage for chunk in stream if chunk.usage][0].prompt_tokens == expected


def test_responses_images_and_files_become_placeholders(openai_client, demo_tokenizer):
    items = [{"role": "user", "content": [
        {"type": "input_text", "text": "Read these."},
        {"type": "input_image", "image_url": "data:image/png;base64,AA"},
        {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,AA"},
    ]}]  # fmt: skip
    text = (
        "Read these.\n[image omitted: this model reads text only]\n[file (a.pdf) omitted: this model reads text only]"
    )
    expected = num_tokens(demo_tokenizer, [{"role": "user", "content": text}], thinking=None)
    response = openai_client.responses.create(model="m", input=items, max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens == expected
    events = list(
        openai_client.responses.create(model="m", input=items, max_output_tokens=2, temperature=0, stream=True)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens == expected


# --- 3. context limits: max_tokens lowered to the room left; prompt too long is a 400 in each API's wording ------


@pytest.fixture(scope="module")
def long_prompt(demo_tokenizer) -> tuple[str, int]:
    """A user text whose chat prompt (no tools, thinking off) leaves 6 to 20 tokens of the test context."""
    words = MAX_MODEL_LEN - 40
    while True:
        text = "hello " * words
        used = num_tokens(demo_tokenizer, [{"role": "user", "content": text}])
        if MAX_MODEL_LEN - 20 <= used <= MAX_MODEL_LEN - 6:
            return text, used
        words += 1 if used < MAX_MODEL_LEN - 20 else -1


def test_anthropic_max_tokens_is_lowered_to_the_room_left(anthropic_client, http, parse_sse, long_prompt, server):
    text, used = long_prompt
    room = MAX_MODEL_LEN - used
    messages = [{"role": "user", "content": text}]
    before = server.log_tail(1_000_000).count("max_tokens 32000 lowered to")
    message = anthropic_client.messages.create(
        model="claude-any", messages=messages, max_tokens=32000, extra_body=GREEDY
    )
    assert prompt_tokens(message.usage) == used
    assert message.usage.output_tokens <= room
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == room
    assert server.log_tail(1_000_000).count("max_tokens 32000 lowered to") == before + 1
    _, delta = anthropic_usage_streamed(
        http, parse_sse, {"model": "m", "messages": messages, "max_tokens": 128000, **GREEDY}
    )
    assert delta["usage"]["output_tokens"] <= room
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn")


def test_openai_max_tokens_is_lowered_to_the_room_left(openai_client, long_prompt):
    text, used = long_prompt
    room = MAX_MODEL_LEN - used
    messages = [{"role": "user", "content": text}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
    response = openai_client.chat.completions.create(
        model="m", messages=messages, max_tokens=100_000, temperature=0, extra_body=no_thinking
    )
    assert response.usage.prompt_tokens == used
    assert response.usage.completion_tokens == room and response.choices[0].finish_reason == "length"
    stream = openai_client.chat.completions.create(
        model="m", messages=messages, max_completion_tokens=100_000, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=no_thinking,
    )  # fmt: skip
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == room
    completion = openai_client.completions.create(
        model="m", prompt=text, max_tokens=10**6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == MAX_MODEL_LEN
    assert completion.choices[0].finish_reason == "length"


def test_responses_max_output_tokens_is_lowered(openai_client, long_prompt):
    text, used = long_prompt
    response = openai_client.responses.create(
        model="m", input=text, max_output_tokens=100_000, temperature=0, reasoning={"effort": "none"}
    )
    assert response.usage.input_tokens == used
    assert response.usage.output_tokens <= MAX_MODEL_LEN - used
    if response.status == "incomplete":
        assert response.usage.output_tokens == MAX_MODEL_LEN - used


TOO_LONG = [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]


def test_prompt_too_long_in_each_apis_wording(anthropic_client, openai_client, http):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="claude-any", messages=TOO_LONG, max_tokens=10)
    error = info.value.body["error"]
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
    assert match and int(match[1]) > int(match[2]) == MAX_MODEL_LEN - 1, error
    streamed = http.post(
        "/v1/messages",
        json={"model": "m", "messages": TOO_LONG, "max_tokens": 10, "stream": True},
        headers=ANTHROPIC_HEADERS,
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["message"].startswith("prompt is too long: ")
    for call in (
        lambda: openai_client.chat.completions.create(model="m", messages=TOO_LONG, max_tokens=4),
        lambda: openai_client.chat.completions.create(model="m", messages=TOO_LONG, max_tokens=4, stream=True),
        lambda: openai_client.completions.create(model="m", prompt=TOO_LONG[0]["content"], max_tokens=4),
        lambda: openai_client.responses.create(model="m", input=TOO_LONG[0]["content"], max_output_tokens=4),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.code == "context_length_exceeded", info.value.body
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in info.value.message


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server started with --strict-max-tokens and --default-thinking."""
    proc = start_server(tmp_path_factory.mktemp("strict-server"), "--strict-max-tokens", "--default-thinking")
    yield proc
    proc.stop()


def test_strict_max_tokens_refuses_in_each_apis_wording(strict_server):
    import httpx

    with httpx.Client(base_url=strict_server.base_url, timeout=60) as client:
        for stream in (False, True):
            response = client.post(
                "/v1/messages",
                json={"model": "m", "messages": USER, "max_tokens": 32000, "stream": stream},
                headers=ANTHROPIC_HEADERS,
            )
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            match = re.fullmatch(
                r"input length and `max_tokens` exceed context limit: (\d+) \+ 32000 > (\d+), "
                r"decrease input length or `max_tokens` and try again",
                message,
            )
            assert match and int(match[2]) == MAX_MODEL_LEN, message
        for path, body in [
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 32000}),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 32000, "stream": True}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 32000}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 32000}),
        ]:
            response = client.post(path, json={"model": "m", **body})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
            assert response.json()["error"]["param"] in ("max_tokens", "max_completion_tokens", "max_output_tokens")
        # What fits is served.
        assert (
            client.post(
                "/v1/messages", json={"model": "m", "messages": USER, "max_tokens": 2}, headers=ANTHROPIC_HEADERS
            ).status_code
            == 200
        )


def test_default_thinking_flag(strict_server, demo_tokenizer):
    import httpx

    with httpx.Client(base_url=strict_server.base_url, timeout=60) as client:
        counted = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": USER})
        assert counted.json()["input_tokens"] == num_tokens(demo_tokenizer, USER, thinking=True)
        off = client.post(
            "/v1/messages/count_tokens", json={"model": "m", "messages": USER, "thinking": {"type": "disabled"}}
        )
        assert off.json()["input_tokens"] == num_tokens(demo_tokenizer, USER, thinking=False)


# --- 10. every 4xx is logged with its reason and field; unknown fields once per process --------------------------


def test_client_errors_and_unknown_fields_are_logged(http, server):
    bad = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 9})
    assert bad.status_code == 400
    log = server.log_tail(1_000_000)
    assert re.search(r"POST /v1/chat/completions -> 400 invalid_value \(field temperature\): temperature must be", log)
    missing = http.post("/v1/messages", json={"model": "m", "messages": USER}, headers=ANTHROPIC_HEADERS)
    assert missing.status_code == 400
    assert "POST /v1/messages -> 400 missing_field (field max_tokens): max_tokens is required" in server.log_tail()
    for _ in range(2):
        ok = http.post(
            "/v1/messages",
            json={"model": "m", "messages": USER, "max_tokens": 1, "frobnicate_level": 3},
            headers=ANTHROPIC_HEADERS,
        )
        assert ok.status_code == 200, ok.text
        ok = http.post(
            "/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1, "frobnicate_level": 3}
        )
        assert ok.status_code == 200, ok.text
    log = server.log_tail(1_000_000)
    assert log.count("/v1/messages: field 'frobnicate_level' is not known to this server and is ignored") == 1
    assert log.count("/v1/chat/completions: field 'frobnicate_level' is not known to this server") == 1
