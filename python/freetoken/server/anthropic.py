"""Anthropic Messages: ``POST /v1/messages`` (streaming and not) and ``POST /v1/messages/count_tokens``.

Accepted: ``system`` as a string or an array of text blocks; message content as a string or blocks
(text; tool_use in assistant turns and tool_result in user turns are rendered through the chat
template as tool calls and tool messages; thinking blocks are dropped); ``max_tokens`` (required),
stop_sequences, temperature, top_p, top_k, stream, tools (``input_schema`` becomes the function's
``parameters``), ``thinking`` (sets the template's ``enable_thinking``). Accepted and ignored for now:
tool_choice, metadata, service_tier, cache_control. Rejected with 400 (code unsupported): image and
document blocks. The ``anthropic-version`` header is accepted, whatever its value.

Stream event order: message_start, content_block_start, ping, content_block_delta (text_delta)…,
content_block_stop, message_delta (stop_reason, usage), message_stop; an ``error`` event replaces
the tail when the request fails mid-stream.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.types import SamplingParams
from freetoken.server.errors import (
    ApiError,
    ErrorCode,
    anthropic_error_body,
    invalid_request,
)
from freetoken.server.generation import (
    Completion,
    aclose_shielded,
    check_params,
    closing_chunks,
    collect,
    fit_context,
    render_prompt,
)
from freetoken.server.schema import (
    get_field,
    get_int,
    get_number,
    get_object_list,
    get_string_list,
    join_path,
    parse_json_object,
    read_body,
    wrong_type,
)
from freetoken.server.sse import EventStreamResponse, guard_stream, sse_event


@dataclass
class MessagesRequest:
    """A validated Messages request.

    Attributes:
        messages: the conversation in the Hugging Face chat format (system first, if any).
        tools: tool definitions in the function format the chat template takes, or None.
        template_kwargs: extra chat template variables.
        params: sampling parameters (max_tokens as asked).
        stop_sequences: the client's stop sequences, to tell stop_sequence from end_turn.
        stream: answer with server-sent events.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    params: SamplingParams
    stop_sequences: list[str]
    stream: bool


def _blocks(value: Any, path: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise wrong_type(path, "a string or an array of content blocks", value)
    for i, block in enumerate(value):
        if not isinstance(block, dict):
            raise wrong_type(join_path(path, i), "an object", block)
        get_field(block, "type", str, parent=join_path(path, i), required=True)
    return value


def _unsupported_block(kind: str, path: str) -> ApiError:
    return invalid_request(
        ErrorCode.UNSUPPORTED, f"content block type {kind!r} is not supported here", join_path(path, "type")
    )


def _text_of(blocks: list[dict[str, Any]], path: str) -> str:
    """Join text blocks; anything else is unsupported at this place."""
    texts = []
    for i, block in enumerate(blocks):
        block_path = join_path(path, i)
        if block["type"] != "text":
            raise _unsupported_block(block["type"], block_path)
        texts.append(get_field(block, "text", str, parent=block_path, required=True))
    return "\n".join(texts)


def _system_message(body: dict[str, Any]) -> dict[str, Any] | None:
    system = body.get("system")
    if system is None:
        return None
    return {"role": "system", "content": _text_of(_blocks(system, "system"), "system")}


def _convert_user(blocks: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """A user turn: tool_result blocks become tool messages (first), text becomes one user message."""
    out: list[dict[str, Any]] = []
    texts = []
    for i, block in enumerate(blocks):
        block_path = join_path(path, i)
        kind = block["type"]
        if kind == "text":
            texts.append(get_field(block, "text", str, parent=block_path, required=True))
        elif kind == "tool_result":
            tool_use_id = get_field(block, "tool_use_id", str, parent=block_path, required=True)
            content = block.get("content")
            text = "" if content is None else _text_of(_blocks(content, join_path(block_path, "content")),
                                                      join_path(block_path, "content"))
            out.append({"role": "tool", "content": text, "tool_call_id": tool_use_id})
        else:
            raise _unsupported_block(kind, block_path)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _convert_assistant(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """An assistant turn: text joined, tool_use blocks become tool_calls, thinking dropped."""
    texts = []
    tool_calls = []
    for i, block in enumerate(blocks):
        block_path = join_path(path, i)
        kind = block["type"]
        if kind == "text":
            texts.append(get_field(block, "text", str, parent=block_path, required=True))
        elif kind == "tool_use":
            tool_calls.append({
                "id": get_field(block, "id", str, parent=block_path, required=True),
                "type": "function",
                "function": {
                    "name": get_field(block, "name", str, parent=block_path, required=True),
                    "arguments": get_field(block, "input", dict, parent=block_path, default={}),
                },
            })
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported_block(kind, block_path)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def convert_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` -> the Hugging Face chat format."""
    raw_messages = get_object_list(body, "messages", required=True, non_empty=True)
    messages = []
    system = _system_message(body)
    if system is not None:
        messages.append(system)
    for i, message in enumerate(raw_messages):
        path = join_path("messages", i)
        role = get_field(message, "role", str, parent=path, required=True)
        if role not in ("user", "assistant"):
            raise invalid_request(
                ErrorCode.INVALID_VALUE, f"{path}.role must be 'user' or 'assistant', got {role!r}",
                join_path(path, "role"),
            )
        content_path = join_path(path, "content")
        content = get_field(message, "content", (str, list), parent=path, required=True)
        blocks = _blocks(content, content_path)
        if role == "user":
            messages.extend(_convert_user(blocks, content_path))
        else:
            messages.append(_convert_assistant(blocks, content_path))
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(get_object_list(body, "tools")):
        path = join_path("tools", i)
        function = {"name": get_field(tool, "name", str, parent=path, required=True)}
        description = get_field(tool, "description", str, parent=path)
        if description is not None:
            function["description"] = description
        function["parameters"] = get_field(tool, "input_schema", dict, parent=path, default={"type": "object"})
        tools.append({"type": "function", "function": function})
    return tools or None


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    thinking = get_field(body, "thinking", dict)
    if thinking is None:
        return {}
    kind = get_field(thinking, "type", str, parent="thinking", required=True)
    if kind not in ("enabled", "disabled"):
        raise invalid_request(
            ErrorCode.INVALID_VALUE, f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", "thinking.type"
        )
    return {"enable_thinking": kind == "enabled"}


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body (`count_only`: the count_tokens body, where max_tokens is not needed)."""
    get_field(body, "model", str, required=True)
    messages = convert_messages(body)
    tools = _tools(body)
    template_kwargs = _template_kwargs(body)
    max_tokens = get_int(body, "max_tokens", lo=1, required=not count_only, default=1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", lo=0.0, hi=1.0, default=1.0),
        top_p=get_number(body, "top_p", lo=0.0, hi=1.0, lo_open=True, default=1.0),
        top_k=get_int(body, "top_k", lo=0, default=0),
        stop=get_string_list(body, "stop_sequences"),
    )
    stream = get_field(body, "stream", bool, default=False)
    check_params(params)
    return MessagesRequest(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        params=params,
        stop_sequences=list(params.stop),
        stream=stream,
    )


def stop_fields(finish_reason: str, stop_reason: str | int | None, stop_sequences: list[str]) -> dict[str, Any]:
    """The engine's finish -> Anthropic ``stop_reason`` and ``stop_sequence``."""
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": num_prompt_tokens,
        "output_tokens": num_output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(
    message_id: str, model: str, completion: Completion, stop_sequences: list[str]
) -> dict[str, Any]:
    """The non-streaming ``message`` object."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": completion.text}],
        **stop_fields(completion.finish_reason, completion.stop_reason, stop_sequences),
        "usage": _usage(completion.num_prompt_tokens, completion.num_output_tokens),
    }


async def _stream_events(
    engine: Any, prompt_ids: list[int], req: MessagesRequest, message_id: str, model: str
) -> AsyncGenerator[bytes, None]:
    """The SSE events of one streamed message; raises on failure (`guard_stream`)."""
    num_prompt_tokens = len(prompt_ids)
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(num_prompt_tokens, 0),
    }
    yield sse_event("message_start", {"type": "message_start", "message": start})
    yield sse_event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    yield sse_event("ping", {"type": "ping"})
    chunks = closing_chunks(engine, prompt_ids, req.params, message_id)
    last = None
    try:
        async for out in chunks:
            if out.text:
                yield sse_event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": out.text}},
                )
            last = out
    finally:
        await aclose_shielded(chunks)
    if last is None or last.finish_reason is None:
        raise ApiError(500, ErrorCode.INTERNAL_ERROR, "the engine ended the request without a finish reason")
    yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    usage = {"input_tokens": last.num_prompt_tokens or num_prompt_tokens, "output_tokens": last.num_output_tokens}
    delta = stop_fields(last.finish_reason, last.stop_reason, req.stop_sequences)
    yield sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
    yield sse_event("message_stop", {"type": "message_stop"})


def _error_events(err: ApiError) -> list[bytes]:
    return [sse_event("error", anthropic_error_body(err))]


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    state = request.app.state
    engine = state.engine
    req = parse_messages_request(parse_json_object(await read_body(request)))
    prompt_ids = (await render_prompt(engine, req.messages, req.tools, req.template_kwargs)).ids
    fit_context(len(prompt_ids), req.params.max_tokens, engine.max_model_len, max_tokens_param="max_tokens")
    message_id = f"msg_{uuid.uuid4().hex}"
    model = state.served_model_name
    if req.stream:
        events = _stream_events(engine, prompt_ids, req, message_id, model)
        return EventStreamResponse(guard_stream(events, message_id, _error_events))
    completion = await collect(request, engine, prompt_ids, req.params, message_id)
    return JSONResponse(message_body(message_id, model, completion, req.stop_sequences))


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's token count, as the chat template renders it."""
    engine = request.app.state.engine
    req = parse_messages_request(parse_json_object(await read_body(request)), count_only=True)
    prompt = await render_prompt(engine, req.messages, req.tools, req.template_kwargs)
    return JSONResponse({"input_tokens": len(prompt.ids)})
