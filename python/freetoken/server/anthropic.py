"""Anthropic Messages: ``POST /v1/messages`` (streaming and not) and ``POST /v1/messages/count_tokens``.

Accepted: ``system`` as a string or an array of text blocks; message content as a string or blocks
(text; tool_use in assistant turns and tool_result in user turns are rendered through the chat
template as tool calls and tool messages; thinking blocks become the turn's ``reasoning_content``, which
the template keeps or drops; redacted_thinking and block types this server does not know are skipped);
``max_tokens`` (required), stop_sequences, temperature, top_p, top_k, stream, tools (``input_schema``
becomes the function's ``parameters``), tool_choice, ``output_config.format`` (and the earlier beta's
``output_format``) ``{"type": "json_schema", "schema": ...}``: the answer is constrained by a grammar to one JSON
value matching the schema, as OpenAI's response_format (after the model's reasoning, when it thinks; a schema the
grammar library cannot enforce is a 400 on that field), ``thinking`` (sets the template's
``enable_thinking``; absent leaves the template's default). Accepted and ignored: metadata,
service_tier, cache_control, disable_parallel_tool_use. Rejected with 400 (code unsupported): image and
document blocks. The ``anthropic-version`` header is accepted, whatever its value.

Output goes through the model family's parser (`freetoken.server.parsers`): reasoning becomes a
``thinking`` block (with an empty ``signature``; no signature_delta is streamed, which the SDK accepts),
text a ``text`` block, each tool call a ``tool_use`` block (``toolu_`` id; ``input`` is the parsed
arguments, ``{}`` when the model's JSON is not an object), and ``stop_reason`` is ``tool_use`` when the
model stopped after calling tools. tool_choice: ``none`` leaves the tools out of the prompt; ``auto``
offers them; ``any`` and ``tool`` constrain the output with a grammar to tool calls (of the named tool for
``tool``) whose input matches the tool's ``input_schema``, as the OpenAI module's ``required`` and named choice do.

Stream event order: message_start (sent as soon as the request is accepted, with usage.input_tokens), a ping
every few seconds while the prompt prefills (and whenever the stream is idle); per block content_block_start,
content_block_delta (thinking_delta, text_delta or input_json_delta)…, content_block_stop, with one ping after
the first block starts; message_delta (stop_reason, usage), message_stop. A block starts when its first piece
arrives; a completion with no output has one empty text block. An ``error`` event replaces the tail when the
request fails mid-stream. """

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.types import GenerationChunk, SamplingParams
from freetoken.server.errors import (
    ApiError,
    ErrorCode,
    anthropic_error_body,
    invalid_request,
)
from freetoken.server.generation import (
    Completion,
    JsonFormat,
    OutputPlan,
    ToolChoice,
    check_params,
    collect,
    constrain_output,
    converted_events,
    fit_context,
    plan_output,
    render_prompt,
)
from freetoken.server.openai import schema_instruction, with_system_instruction
from freetoken.server.parsers import (
    ParsedDelta,
    ParsedOutput,
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

# Anthropic's keep-alive: a ping event, sent whenever the stream is idle (a long prompt's prefill).
PING_EVENT = sse_event("ping", {"type": "ping"})


@dataclass
class MessagesRequest:
    """A validated Messages request.

    Attributes:
        messages: the conversation in the Hugging Face chat format (system first, if any).
        tools: tool definitions in the function format the chat template takes, or None.
        tool_choice: how the model may use `tools`.
        template_kwargs: extra chat template variables.
        params: sampling parameters (max_tokens as asked).
        stop_sequences: the client's stop sequences, to tell stop_sequence from end_turn.
        stream: answer with server-sent events.
        output_format: the JSON the answer is constrained to (``output_config.format`` or ``output_format``), or
            None for free text.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    template_kwargs: dict[str, Any]
    params: SamplingParams
    stop_sequences: list[str]
    stream: bool
    output_format: JsonFormat | None = None


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


# Blocks the model cannot take and must not silently lose; any other unknown type is skipped.
_REFUSED_BLOCKS = frozenset({"image", "document"})


def _text_of(blocks: list[dict[str, Any]], path: str) -> str:
    """Join text blocks; images and documents are unsupported, other block types are skipped."""
    texts = []
    for i, block in enumerate(blocks):
        block_path = join_path(path, i)
        if block["type"] == "text":
            texts.append(get_field(block, "text", str, parent=block_path, required=True))
        elif block["type"] in _REFUSED_BLOCKS:
            raise _unsupported_block(block["type"], block_path)
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
        elif kind in _REFUSED_BLOCKS:
            raise _unsupported_block(kind, block_path)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _convert_assistant(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """An assistant turn: text joined, tool_use blocks become tool_calls, thinking becomes reasoning."""
    texts = []
    thoughts = []
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
        elif kind == "thinking":
            thoughts.append(get_field(block, "thinking", str, parent=block_path, default=""))
        elif kind in _REFUSED_BLOCKS:
            raise _unsupported_block(kind, block_path)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if any(thoughts):
        message["reasoning_content"] = "\n".join(thoughts)
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


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice``: auto (the default), any, tool (named, among `tools`), none."""
    value = get_field(body, "tool_choice", dict)
    if value is None:
        return ToolChoice()
    kind = get_field(value, "type", str, parent="tool_choice", required=True)
    get_field(value, "disable_parallel_tool_use", bool, parent="tool_choice")
    if kind in ("auto", "none"):
        return ToolChoice(kind)
    if kind not in ("any", "tool"):
        raise invalid_request(
            ErrorCode.INVALID_VALUE,
            f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}",
            "tool_choice.type",
        )
    if not tools:
        raise invalid_request(ErrorCode.INVALID_VALUE, f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "any":
        return ToolChoice("required")
    name = get_field(value, "name", str, parent="tool_choice", required=True)
    if name not in {tool["function"]["name"] for tool in tools}:
        raise invalid_request(
            ErrorCode.INVALID_VALUE, f"tool_choice names tool {name!r}, which is not among tools", "tool_choice.name"
        )
    return ToolChoice("function", name)


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


def _output_format(body: dict[str, Any]) -> JsonFormat | None:
    """``output_config.format`` (the API's structured outputs; what the SDK's ``messages.parse`` sends) or the
    earlier beta's top-level ``output_format``: ``{"type": "json_schema", "schema": {...}}``, or None."""
    config = get_field(body, "output_config", dict, default={})
    value = get_field(config, "format", dict, parent="output_config")
    param = "output_config.format"
    if value is None:
        value, param = get_field(body, "output_format", dict), "output_format"
    if value is None:
        return None
    kind = get_field(value, "type", str, parent=param, required=True)
    if kind != "json_schema":
        raise invalid_request(
            ErrorCode.INVALID_VALUE, f"{param}.type must be 'json_schema', got {kind!r}", join_path(param, "type")
        )
    schema = get_field(value, "schema", dict, parent=param, required=True)
    return JsonFormat(schema, join_path(param, "schema"))


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body (`count_only`: the count_tokens body, where max_tokens is not needed)."""
    get_field(body, "model", str, required=True)
    messages = convert_messages(body)
    output_format = _output_format(body)
    if output_format is not None:
        messages = with_system_instruction(messages, schema_instruction(output_format.schema))
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
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
        tool_choice=tool_choice,
        template_kwargs=template_kwargs,
        params=params,
        stop_sequences=list(params.stop),
        stream=stream,
        output_format=output_format,
    )


def stop_fields(
    finish_reason: str, stop_reason: str | int | None, stop_sequences: list[str], used_tools: bool
) -> dict[str, Any]:
    """The engine's finish -> Anthropic ``stop_reason`` and ``stop_sequence``."""
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if used_tools:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int, num_cache_write_tokens: int
) -> dict[str, int]:
    """Anthropic's ``usage``: the prompt's tokens split into those read from the KV prefix cache, those this
    request added to it (whole blocks) and the rest (``input_tokens``); the three add up to the prompt."""
    return {
        "input_tokens": num_prompt_tokens - num_cached_tokens - num_cache_write_tokens,
        "output_tokens": num_output_tokens,
        "cache_creation_input_tokens": num_cache_write_tokens,
        "cache_read_input_tokens": num_cached_tokens,
    }


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use ``input`` object; ``{}`` when they are not a JSON object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(
    message_id: str, model: str, completion: Completion, output: ParsedOutput, stop_sequences: list[str]
) -> dict[str, Any]:
    """The non-streaming ``message`` object of `completion`, parsed into `output`."""
    content: list[dict[str, Any]] = []
    if output.reasoning:
        content.append({"type": "thinking", "thinking": output.reasoning, "signature": ""})
    if output.content or not output.tool_calls:
        content.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        content.append({"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                        "input": _tool_input(call.arguments)})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        **stop_fields(
            completion.finish_reason, completion.stop_reason, stop_sequences, bool(output.tool_calls)
        ),
        "usage": _usage(
            completion.num_prompt_tokens, completion.num_output_tokens, completion.num_cached_tokens,
            completion.num_cache_write_tokens,
        ),
    }


class _BlockStream:
    """Turns parsed deltas into content-block events: a block starts when its first piece arrives and
    stops when a piece of another block (or the end) comes; one ping follows the first block's start."""

    def __init__(self) -> None:
        self._kind: str | None = None  # the open block's type
        self._num_blocks = 0
        self.used_tools = False

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self._kind = block["type"]
        events.append(sse_event(
            "content_block_start", {"type": "content_block_start", "index": self._num_blocks, "content_block": block}
        ))
        if self._num_blocks == 0:
            events.append(sse_event("ping", {"type": "ping"}))
        self._num_blocks += 1
        return events

    def _stop(self) -> list[bytes]:
        if self._kind is None:
            return []
        self._kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self._num_blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": self._num_blocks - 1, "delta": delta}
        )

    def events(self, parsed: ParsedDelta) -> list[bytes]:
        """The events of one parsed delta (reasoning, then content, then tool-call pieces)."""
        events: list[bytes] = []
        if parsed.reasoning:
            if self._kind != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            if self._kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for piece in parsed.tool_calls:
            if piece.name is not None:
                self.used_tools = True
                events += self._start({"type": "tool_use", "id": _tool_use_id(), "name": piece.name, "input": {}})
            if piece.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def close(self) -> list[bytes]:
        """Stop the open block; a completion without blocks gets one empty text block."""
        events = [] if self._num_blocks else self._start({"type": "text", "text": ""})
        return events + self._stop()


def _stream_events(
    engine: Any, prompt_ids: list[int], req: MessagesRequest, plan: OutputPlan, message_id: str, model: str
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
        # Said before the engine admits the request: the prefix cache's split as of now (the final usage, in
        # message_delta, has the split at admission; the SDKs take it from there).
        "usage": _usage(num_prompt_tokens, 0, *engine.estimate_prefix_reuse(prompt_ids)),
    }
    blocks = _BlockStream()

    def tail(last: GenerationChunk) -> list[bytes]:
        usage = _usage(
            last.num_prompt_tokens or num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens,
            last.num_cache_write_tokens,
        )
        delta = stop_fields(last.finish_reason, last.stop_reason, req.stop_sequences, blocks.used_tools)
        return [sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
                sse_event("message_stop", {"type": "message_stop"})]

    head = [sse_event("message_start", {"type": "message_start", "message": start})]
    return converted_events(engine, prompt_ids, req.params, plan, message_id, blocks, head, tail)


def _error_events(err: ApiError) -> list[bytes]:
    return [sse_event("error", anthropic_error_body(err))]


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    state = request.app.state
    engine = state.engine
    req = parse_messages_request(parse_json_object(await read_body(request)))
    tools = None if req.tool_choice.mode == "none" else req.tools
    prompt = await render_prompt(engine, req.messages, tools, req.template_kwargs)
    plan = plan_output(engine, prompt, tools, req.tool_choice)
    prompt_ids = prompt.ids
    fit_context(len(prompt_ids), req.params.max_tokens, engine.max_model_len, max_tokens_param="max_tokens")
    await constrain_output(engine, plan, req.params, prompt_ids, req.output_format, tools)
    message_id = f"msg_{uuid.uuid4().hex}"
    model = state.served_model_name
    if req.stream:
        events = _stream_events(engine, prompt_ids, req, plan, message_id, model)
        return EventStreamResponse(guard_stream(
            events, message_id, _error_events, PING_EVENT, state.keepalive_s
        ))
    [completion] = await collect(request, engine, prompt_ids, [req.params], message_id)
    output = plan.parse(completion.text)
    return JSONResponse(message_body(message_id, model, completion, output, req.stop_sequences))


# count_tokens counts prompts of up to this many contexts; longer ones are refused untokenized (bounded work).
COUNT_TOKENS_CONTEXTS = 4


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's token count, as the chat template renders it."""
    engine = request.app.state.engine
    req = parse_messages_request(parse_json_object(await read_body(request)), count_only=True)
    tools = None if req.tool_choice.mode == "none" else req.tools
    # Counted exactly up to COUNT_TOKENS_CONTEXTS contexts (a client deciding what to trim needs the count of a
    # prompt a little past the context); past that, refused after bounded work like any prompt.
    prompt = await render_prompt(
        engine, req.messages, tools, req.template_kwargs, max_tokens=COUNT_TOKENS_CONTEXTS * engine.max_model_len
    )
    plan_output(engine, prompt, tools, req.tool_choice)  # a forced tool call's opening counts too
    return JSONResponse({"input_tokens": len(prompt.ids)})
