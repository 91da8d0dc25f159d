"""OpenAI Responses (``POST /v1/responses``) against a real `ft serve` process, through the official SDK."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server_openai import CARD_SCHEMA

from conftest import SERVED_MODEL_NAME

TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
    {"type": "web_search"},
]


def test_shape_and_usage(openai_client, demo_tokenizer):
    response = openai_client.responses.create(
        model="m", input="Say hello.", instructions="Be terse.", max_output_tokens=4, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == SERVED_MODEL_NAME
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].type == "output_text"
    assert response.output_text == response.output[0].content[0].text
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hello."}]
    )
    assert response.usage.input_tokens == len(demo_tokenizer.encode(prompt))
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_forced_function_call_and_stream(openai_client):
    kwargs = {
        "model": "m",
        "input": "List files.",
        "tools": TOOLS,
        "max_output_tokens": 20,
        "temperature": 0,
        "tool_choice": {"type": "function", "name": "shell"},
    }
    response = openai_client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "shell" and calls[0].call_id.startswith("call_")
    assert calls[0].arguments.startswith("{")

    events = list(openai_client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == deltas == calls[0].arguments
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in response.output]
    assert final.output[0].name == "shell" and final.output[0].arguments == deltas


def test_sdk_stream_helper_text(openai_client):
    """The SDK's stream helper takes the events (its get_final_response wants response.completed, which a
    response cut by max_output_tokens replaces with response.incomplete, as the spec says)."""
    full = openai_client.responses.create(model="m", input="Hi.", max_output_tokens=6, temperature=0)
    with openai_client.responses.stream(model="m", input="Hi.", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.output_text == full.output_text


def test_cut_by_max_output_tokens_is_incomplete(openai_client):
    """A response the budget cut says so in the response (``incomplete_details.reason``) and in the item being
    written (``incomplete``), streamed or not, as OpenAI's spec does; the demo's random weights never end a turn
    themselves, so a 3-token budget always cuts."""
    kwargs = {"model": "m", "input": "Write a long story.", "max_output_tokens": 3, "reasoning": {"effort": "none"}}
    response = openai_client.responses.create(**kwargs, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]
    events = list(openai_client.responses.create(**kwargs, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"]
    assert [item.status for item in events[-1].response.output] == ["incomplete"]
    whole = openai_client.responses.create(**{**kwargs, "max_output_tokens": 200}, temperature=0)
    assert whole.output_text.startswith(response.output_text)


def test_multi_turn_items(openai_client, http):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is in the folder?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run ls."}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": '{"cmd": "pwd"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "/w"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a.py in /w"}]},
        {"type": "some_future_item", "x": 1},
        {"role": "user", "content": "Thanks."},
    ]
    response = openai_client.responses.create(
        model="m", input=items, tools=TOOLS, max_output_tokens=3, temperature=0, reasoning={"effort": "minimal"}
    )
    assert response.status in ("completed", "incomplete")
    for body, param in [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": []}, "input"),
    ]:
        bad = http.post("/v1/responses", json={"model": "m", "max_output_tokens": 1, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    # only items of types a chat has no place for: the 400 says they were left out, not just "no message"
    only_unknown = [{"type": "some_future_item"}, {"type": "web_search_call"}, {"type": "some_future_item"}]
    bad = http.post("/v1/responses", json={"model": "m", "max_output_tokens": 1, "input": only_unknown})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
    assert "'some_future_item', 'web_search_call' are left out" in bad.json()["error"]["message"]


def test_reasoning_and_calls_validate_as_sdk_events():
    """Realistic Qwen3 output, streamed as this server does: every event validates as the SDK's type, and the
    final response's items equal those of the non-streamed parse."""
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from freetoken.engine.types import GenerationChunk
    from freetoken.server.parsers import ParserOptions, parse_text
    from freetoken.server.parsers.qwen3 import Qwen3Parser
    from freetoken.server.responses import ToolKinds, _ItemStream, output_items

    text = (
        '<think>\nNeed ls.\n</think>\n\nRunning it.\n<tool_call>\n{"name": "shell", "arguments": '
        '{"cmd": "ls -la"}}\n</tool_call>'
    )
    options = ParserOptions(prompt_text="", parse_tools=True)
    whole = output_items(parse_text(Qwen3Parser(options), text), ToolKinds(), "stop")
    parser, items = Qwen3Parser(options), _ItemStream(ToolKinds())
    raw = [e for i in range(0, len(text), 5) for e in items.events(parser.feed(text[i : i + 5]))]
    raw += items.events(parser.finish()) + items.close(GenerationChunk(text="", token_ids=[], finish_reason="stop"))
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(e.split(b"data: ", 1)[1])) for e in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Need ls."
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items.items]
    assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole]
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]


def test_text_format_json_schema(openai_client, http):
    """``text.format`` constrains the output as chat completions' response_format does (reasoning effort
    "none" turns the demo template's thinking off), and the response echoes the format."""
    fmt = {"type": "json_schema", "name": "card", "schema": CARD_SCHEMA, "strict": True}
    kwargs = {
        "model": "m",
        "input": "Make a card.",
        "max_output_tokens": 200,
        "text": {"format": fmt},
        "reasoning": {"effort": "none"},
    }
    response = openai_client.responses.create(**kwargs, temperature=0)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CARD_SCHEMA)
    assert response.text.format.type == "json_schema"
    events = list(openai_client.responses.create(**kwargs, temperature=1.0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), CARD_SCHEMA)
    assert events[-1].type == "response.completed"
    bad = http.post("/v1/responses", json={**kwargs, "text": {"format": {**fmt, "schema": {"type": "strin"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text
    bad = http.post("/v1/responses", json={**kwargs, "text": {"format": {"type": "yaml"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.type", bad.text


def test_previous_response_id_continues_the_conversation(openai_client, demo_tokenizer):
    no_thinking = {"reasoning": {"effort": "none"}, "max_output_tokens": 6, "temperature": 0}
    first = openai_client.responses.create(model="m", input="Say hi.", instructions="Be terse.", **no_thinking)
    assert first.store is True
    second = openai_client.responses.create(model="m", input="Again.", previous_response_id=first.id, **no_thinking)
    assert second.previous_response_id == first.id
    # The prompt is the first input and output, then the new input; the first's instructions are not carried over.
    history = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again."},
    ]
    prompt = demo_tokenizer.apply_chat_template(history, add_generation_prompt=True, enable_thinking=False)
    assert second.usage.input_tokens == len(demo_tokenizer.encode(prompt))

    # A chain, streamed: the third continues the second (and so the first); what it streamed is what is stored.
    events = list(
        openai_client.responses.create(
            model="m",
            input=[{"role": "user", "content": "Once more."}],
            previous_response_id=second.id,
            stream=True,
            **no_thinking,
        )
    )
    third = events[-1].response
    assert third.previous_response_id == second.id
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert openai_client.responses.retrieve(third.id).output == third.output

    stored = openai_client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text and stored.usage == first.usage


def test_previous_response_id_errors_and_store_false(openai_client, http):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model="m", input="x", max_output_tokens=1, previous_response_id="resp_nope")
    error = info.value.body
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"

    unsaved = openai_client.responses.create(model="m", input="x", max_output_tokens=1, store=False)
    assert unsaved.store is False
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unsaved.id)
    bad = http.post(
        "/v1/responses", json={"model": "m", "input": "y", "max_output_tokens": 1, "previous_response_id": unsaved.id}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "previous_response_id"

    kept = openai_client.responses.create(model="m", input="x", max_output_tokens=1)
    openai_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(kept.id)
    bad = http.post("/v1/responses", json={"model": "m", "input": "y", "previous_response_id": kept.id})
    assert bad.status_code == 400, bad.text


def test_an_echoed_value_is_cut_in_the_error_and_its_log_line(http, server):
    """A 100 KB id in a 400 (and 10 KB ones in URLs: HTTP servers refuse longer request lines) comes back cut to
    `MAX_MESSAGE_CHARS`, keeping the start and the message's end (the fix it suggests); so does our 4xx log line
    (uvicorn's access log line is its own)."""
    from freetoken.server.errors import MAX_MESSAGE_CHARS

    for response in (
        http.post("/v1/responses", json={"model": "m", "input": "y", "previous_response_id": "x" * 100_000}),
        http.get("/v1/responses/resp_" + "x" * 10_000),
        http.get("/v1/models/" + "m" * 10_000),
    ):
        assert response.status_code in (400, 404), response.text
        message = response.json()["error"]["message"]
        assert len(message) <= MAX_MESSAGE_CHARS + 60 and "characters cut" in message
    assert message.endswith(f"this server serves {SERVED_MODEL_NAME!r}")
    ours = [line for line in server.log_path.read_text(errors="replace").splitlines() if "freetoken" in line]
    assert ours and not any("x" * 1000 in line or "m" * 1000 in line for line in ours)


def test_response_store_is_a_bounded_lru():
    from freetoken.server.responses import ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")


def test_stored_responses_are_bounded_in_bytes(http):
    """Stored responses keep their input as sent: 256 of them with a 30 MB image each (in a 32 MiB body) held
    7.5 GB. The store now also holds at most RESPONSE_STORE_MAX_BYTES, dropping the least recently used."""
    from freetoken.server.responses import RESPONSE_STORE_MAX_BYTES

    image = "data:image/png;base64," + "A" * (24 << 20)
    ids = []
    for i in range(RESPONSE_STORE_MAX_BYTES // (24 << 20) + 1):
        content = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": f"image {i}"}]
        body = {"model": "m", "max_output_tokens": 1, "input": [{"role": "user", "content": content}]}
        response = http.post("/v1/responses", json=body, timeout=120)
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert http.get(f"/v1/responses/{ids[-1]}").status_code == 200
