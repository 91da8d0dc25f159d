"""OpenAI Responses: ``POST /v1/responses`` (what Codex speaks), streaming (SSE) and not.

Accepted: ``instructions`` (a system message); ``input`` as a string or an array of items: messages
(role user, assistant, system, developer as system; content a string or input_text/output_text parts),
``function_call`` (arguments a JSON string), ``function_call_output`` (output a string or text parts),
``reasoning`` (its reasoning_text content or summary becomes the next assistant turn's reasoning),
``custom_tool_call`` / ``custom_tool_call_output``; item types this server does not know are skipped. ``tools``:
``function``; ``custom`` (freeform, Codex's ``apply_patch``: offered as a function of one string ``input``, whose
calls are answered as ``custom_tool_call`` items); ``namespace`` (its member functions are offered, their calls
carry ``namespace``); hosted tool types (``web_search`` and the like: this server runs none) are dropped and logged
once per type. ``tool_choice`` (auto, none, required, {"type": "function", "name"},
enforced as in chat completions), ``max_output_tokens``, temperature, top_p, stream, ``reasoning.effort``
("none" or "minimal" turn the template's thinking off), ``text.format`` (``json_object`` or ``json_schema``
with name, schema, strict beside type: decoding constrained as for chat completions' response_format).
``store`` (default true) keeps the finished response in a bounded in-memory LRU (`ResponseStore`, the last 256),
so ``previous_response_id`` continues from its input and output items (its instructions are not carried over;
an id not stored is a 400, code previous_response_not_found), and ``GET``/``DELETE /v1/responses/{id}``
retrieve or forget it. Accepted and ignored: parallel_tool_calls, include, metadata, user, truncation.
Images, files and audio become a short text placeholder saying what was dropped (this model reads text only;
logged once per request).

Output items: ``reasoning`` (content: one reasoning_text), ``message`` (one output_text), one
``function_call`` (or ``custom_tool_call``) per tool call; status ``incomplete`` (reason max_output_tokens) when
the budget ran out.
Stream events, each with a sequence_number: response.created, response.in_progress; per item
response.output_item.added, then for a message response.content_part.added, response.output_text.delta…,
response.output_text.done, response.content_part.done; for reasoning response.reasoning_text.delta…,
response.reasoning_text.done; for a call response.function_call_arguments.delta…,
response.function_call_arguments.done (for a custom tool call, response.custom_tool_call_input.delta with the whole
input, then .done, once the call is complete); then response.output_item.done; last response.completed (or
response.incomplete). A failure mid-stream ends with an ``error`` event.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.types import GenerationChunk, SamplingParams
from freetoken.server.errors import (
    ApiError,
    ErrorCode,
    invalid_request,
    openai_error_body,
)
from freetoken.server.generation import (
    OutputPlan,
    ToolChoice,
    check_params,
    collect,
    constrain_output,
    context_fit,
    converted_events,
    fit_context,
    fit_output_budget,
    plan_output,
    render_prompt,
)
from freetoken.server.notices import note_unknown_fields, omitted
from freetoken.server.openai import (
    parse_response_format,
    parse_tool_choice,
    with_system_instruction,
)
from freetoken.server.parsers import ParsedDelta, ParsedOutput
from freetoken.server.schema import (
    get_field,
    get_int,
    get_number,
    get_object_list,
    get_tool_name,
    get_tool_schema,
    join_path,
    parse_json_object,
    read_body,
    wrong_type,
)
from freetoken.server.sse import EventStreamResponse, guard_stream, sse_event

logger = logging.getLogger("freetoken.server")

# Most responses `ResponseStore` keeps (least recently used dropped first).
RESPONSE_STORE_CAPACITY = 256
# ... and at most this many bytes of them (the request bodies and response objects as JSON): stored input is kept
# as sent, images included, so 256 bodies of up to 32 MiB would hold 8 GiB.
RESPONSE_STORE_MAX_BYTES = 256 << 20

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Parts a text-only model cannot read: each becomes a placeholder saying what was dropped (`omitted`).
_OMITTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


# Top-level fields of a Responses body this server reads, or knows and ignores; any other is logged once.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "reasoning",
        "text",
        "store",
        "previous_response_id",
        "parallel_tool_calls",
        "include",
        "metadata",
        "user",
        "truncation",
    }
)


def _text(value: Any, path: str) -> str:
    """Content as one string: a string, or its text parts joined by newlines (images and files as placeholders,
    other parts skipped)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or an array of content parts", value)
    texts = []
    for i, part in enumerate(value):
        part_path = join_path(path, i)
        if not isinstance(part, dict):
            raise wrong_type(part_path, "an object", part)
        kind = get_field(part, "type", str, parent=part_path, required=True)
        if kind in _TEXT_PARTS:
            texts.append(get_field(part, "text", str, parent=part_path, required=True))
        elif kind in _OMITTED_PARTS:
            detail = part.get("filename") if isinstance(part.get("filename"), str) else ""
            texts.append(omitted(_OMITTED_PARTS[kind], detail))
    return "\n".join(texts)


def input_items(body: dict[str, Any]) -> list[Any]:
    """``input`` as a list of items (a string is one user message); the items are checked by `convert_input`."""
    raw = get_field(body, "input", (str, list), required=True)
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    return raw


def convert_input(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``instructions`` + the `history` items (a previous response's input and output, see `ResponseStore`) +
    ``input`` -> the Hugging Face chat format. The previous response's instructions are not carried over."""
    messages: list[dict[str, Any]] = []
    instructions = get_field(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    history = history or []
    reasoning: list[str] = []
    skipped: list[str] = []  # item types with no place in a chat (a harness's web_search_call, say): left out
    for i, item in enumerate([*history, *input_items(body)]):
        # The history was checked when it was input (or made here, as output); an error can only be in input.
        path = join_path("input", i - len(history)) if i >= len(history) else "previous_response_id"
        if not isinstance(item, dict):
            raise wrong_type(path, "an object", item)
        kind = get_field(item, "type", str, parent=path, default="message")
        if kind == "message":
            role = get_field(item, "role", str, parent=path, required=True)
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid_request(
                    ErrorCode.INVALID_VALUE,
                    f"{path}.role must be user, assistant, system or developer, got {role!r}",
                    join_path(path, "role"),
                )
            message = {
                "role": "system" if role == "developer" else role,
                "content": _text(item.get("content", ""), join_path(path, "content")),
            }
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "\n".join(reasoning), []
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "custom_tool_call":  # offered as a function of one string, `input` (see `_tools`)
                arguments = json.dumps(
                    {"input": get_field(item, "input", str, parent=path, default="")}, ensure_ascii=False
                )
            else:
                arguments = get_field(item, "arguments", str, parent=path, default="{}")
            call = {
                "id": get_field(item, "call_id", str, parent=path, required=True),
                "type": "function",
                "function": {"name": get_field(item, "name", str, parent=path, required=True), "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = "\n".join(reasoning), []
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": get_field(item, "call_id", str, parent=path, required=True),
                    "content": _text(item.get("output", ""), join_path(path, "output")),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if isinstance(parts, list):
                reasoning += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        elif kind not in skipped:
            skipped.append(kind)
    if not messages:
        left_out = f" (items of type {', '.join(map(repr, skipped))} are left out)" if skipped else ""
        raise invalid_request(
            ErrorCode.INVALID_VALUE, f"input must hold at least one message or tool call{left_out}", "input"
        )
    return messages


@dataclass
class ToolKinds:
    """What the offered functions stand for in the client's terms, to answer each call as its own item type.

    Attributes:
        custom: names of ``custom`` (freeform) tools: offered as functions of one string parameter ``input``,
            answered as ``custom_tool_call`` items whose ``input`` is that string.
        namespaces: function name -> its ``namespace`` tool's name, for the members of namespace tools (offered
            as plain functions; their calls carry ``namespace``).
    """

    custom: frozenset[str] = frozenset()
    namespaces: dict[str, str] = field(default_factory=dict)


# Hosted tool types already logged as dropped (one line per type per process).
_DROPPED_TOOL_TYPES: set[str] = set()


def _function(tool: dict[str, Any], path: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tool as the chat template's function: name, description, parameters (`parameters` if given)."""
    function = {"name": get_tool_name(tool, parent=path)}
    description = get_field(tool, "description", str, parent=path)
    if description is not None:
        function["description"] = description
    schema = parameters or get_tool_schema(tool, "parameters", parent=path)
    function["parameters"] = schema if schema is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _custom_parameters(tool: dict[str, Any], path: str) -> dict[str, Any]:
    """A custom tool's input as a function's one string parameter, described with the tool's grammar if any."""
    fmt = get_field(tool, "format", dict, parent=path, default={})
    description = "The tool's whole input, as raw text (not JSON)."
    definition = fmt.get("definition")
    if fmt.get("type") == "grammar" and isinstance(definition, str):
        description += f" It must match this {fmt.get('syntax', '')} grammar:\n{definition}"
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": description}},
        "required": ["input"],
        "additionalProperties": False,
    }


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolKinds]:
    """The offered tools in the chat template's format, and what they stand for.

    ``function`` tools as they are; ``custom`` (freeform) tools as a function of one string ``input``; the
    member functions of ``namespace`` tools as plain functions; hosted tool types (``web_search`` and the like,
    which this server does not run) are dropped, logged once per type.
    """
    tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    for i, tool in enumerate(get_object_list(body, "tools")):
        path = join_path("tools", i)
        kind = get_field(tool, "type", str, parent=path, required=True)
        if kind == "function":
            tools.append(_function(tool, path))
        elif kind == "custom":
            tools.append(_function(tool, path, _custom_parameters(tool, path)))
            custom.add(tools[-1]["function"]["name"])
        elif kind == "namespace":
            namespace = get_tool_name(tool, parent=path)
            for j, member in enumerate(get_object_list(tool, "tools", parent=path)):
                member_path = join_path(join_path(path, "tools"), j)
                if get_field(member, "type", str, parent=member_path, default="function") != "function":
                    continue
                tools.append(_function(member, member_path))
                namespaces[tools[-1]["function"]["name"]] = namespace
        elif kind not in _DROPPED_TOOL_TYPES:
            _DROPPED_TOOL_TYPES.add(kind)
            logger.info("responses: tools of type %r are hosted tools this server does not run; dropped", kind)
    return tools or None, ToolKinds(frozenset(custom), namespaces)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    reasoning = get_field(body, "reasoning", dict)
    effort = reasoning and get_field(reasoning, "effort", str, parent="reasoning")
    return {"enable_thinking": False} if effort in ("none", "minimal") else {}


def _usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(text: str, status: str) -> dict[str, Any]:
    """A message item; one that is still in progress has no content parts yet."""
    content = (
        [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant", "content": content}


def _call_item(name: str, arguments: str, status: str, kinds: ToolKinds) -> dict[str, Any]:
    """The item of a call of `name`: a ``custom_tool_call`` (``input``: `custom_input` of the arguments) for a
    custom tool, else a ``function_call`` (with its ``namespace`` for a namespace's member)."""
    if name in kinds.custom:
        return {
            "type": "custom_tool_call",
            "id": _item_id("ctc"),
            "call_id": _item_id("call"),
            "name": name,
            "input": custom_input(arguments),
            "status": status,
        }
    item = {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": _item_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if name in kinds.namespaces:
        item["namespace"] = kinds.namespaces[name]
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments of the function it was offered as: their ``input`` string, or the
    arguments text as it is when the model wrote something else."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def final_item_status(finish_reason: str | None) -> str:
    """The status of the item being written when the output ended: ``incomplete`` when the token budget cut it
    (finish reason ``length``), as OpenAI's Responses API marks it; ``completed`` otherwise."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(output: ParsedOutput, kinds: ToolKinds, finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of a parsed completion; the last one is `final_item_status` (those before it were
    finished before the output ended)."""
    items = []
    if output.reasoning:
        items.append(_reasoning_item(output.reasoning, "completed"))
    if output.content or not output.tool_calls:
        items.append(_message_item(output.content, "completed"))
    items += [_call_item(call.name, call.arguments, "completed", kinds) for call in output.tool_calls]
    items[-1]["status"] = final_item_status(finish_reason)
    return items


@dataclass
class StoredResponse:
    """A finished response kept for ``previous_response_id`` and ``GET /v1/responses/{id}``.

    Attributes:
        body: the response object as it was returned.
        items: the conversation so far as Responses items: the previous response's items (when this one
            continued one), this request's input items, then its output items.
        num_bytes: what keeping it costs, estimated as its request body's and response object's JSON sizes (the
            previous responses' items are shared with their own entries, which count them).
    """

    body: dict[str, Any]
    items: list[dict[str, Any]]
    num_bytes: int = 0


class ResponseStore:
    """The responses stored with ``store`` (the default), most recently used last, at most `capacity` of them and
    `max_bytes` of their `StoredResponse.num_bytes`: the least recently used are dropped to make room. In memory
    only; touched only from the event loop.

    Args:
        capacity: most responses kept (>= 1).
        max_bytes: most bytes kept; a response larger than this alone is not kept (logged).
    """

    def __init__(self, capacity: int = RESPONSE_STORE_CAPACITY, max_bytes: int = RESPONSE_STORE_MAX_BYTES) -> None:
        self.capacity = max(1, capacity)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep `entry` under `response_id`, dropping the least recently used beyond `capacity` or `max_bytes`."""
        self.delete(response_id)
        if entry.num_bytes > self.max_bytes:
            logger.info(
                "responses: %s is not stored: %d MB alone is past the store's %d MB",
                response_id,
                entry.num_bytes >> 20,
                self.max_bytes >> 20,
            )
            return
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        while len(self._entries) > self.capacity or self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None when unknown or dropped."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget `response_id`; False when it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True


class _Response:
    """The response object's fields, filled in as the request runs."""

    def __init__(self, body: dict[str, Any], model: str, params: SamplingParams) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self._fixed = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "error": None,
        }

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        """The response object in `status`."""
        if finish_reason == "length":
            status = "incomplete"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self._fixed, "status": status, "incomplete_details": incomplete, "output": output, "usage": usage}


class _ItemStream:
    """Turns parsed deltas into output-item events; numbers every event."""

    def __init__(self, kinds: ToolKinds) -> None:
        self.kinds = kinds
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        """One event of type `kind`, numbered."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(kind, payload)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self._open, self._text = item, ""
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _stop(self, status: str = "completed") -> list[bytes]:
        item = self._open
        if item is None:
            return []
        events, where = [], self._where()
        if item["type"] == "message":
            part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": []}
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=self._text, logprobs=[])
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self._text))
            item["content"] = [{"type": "reasoning_text", "text": self._text}]
        elif item["type"] == "custom_tool_call":
            # The input is the string inside the arguments' JSON: whole only once the call is.
            item["input"] = custom_input(self._text)
            events.append(self.event("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            events.append(self.event("response.custom_tool_call_input.done", **where, input=item["input"]))
        else:
            events.append(
                self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=self._text)
            )
            item["arguments"] = self._text
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self._open = None
        return events

    def events(self, parsed: ParsedDelta) -> list[bytes]:
        """The events of one parsed delta."""
        events: list[bytes] = []
        if parsed.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._start(_reasoning_item("", "in_progress") | {"content": []})
            self._text += parsed.reasoning
            events.append(
                self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=parsed.reasoning)
            )
        if parsed.content:
            if self._open is None or self._open["type"] != "message":
                events += self._start(_message_item("", "in_progress"))
            self._text += parsed.content
            events.append(
                self.event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=parsed.content, logprobs=[]
                )
            )
        for piece in parsed.tool_calls:
            if piece.name is not None:
                events += self._start(_call_item(piece.name, "", "in_progress", self.kinds))
            if piece.arguments:
                self._text += piece.arguments
                if self._open["type"] == "function_call":
                    events.append(
                        self.event("response.function_call_arguments.delta", **self._where(), delta=piece.arguments)
                    )
        return events

    def close(self, last: GenerationChunk) -> list[bytes]:
        """Close the open item (``incomplete`` when the budget cut it); an output without items gets one empty
        message."""
        events = [] if self.items else self._start(_message_item("", "in_progress"))
        return events + self._stop(final_item_status(last.finish_reason))


def _stream_events(
    engine: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    plan: OutputPlan,
    response: _Response,
    on_done: Callable[[dict[str, Any]], None],
    kinds: ToolKinds,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of one streamed response; `on_done` gets the final response object before the last
    event; raises on failure (`guard_stream`)."""
    items = _ItemStream(kinds)
    head = [
        items.event("response.created", response=response.body("in_progress", [], None, None)),
        items.event("response.in_progress", response=response.body("in_progress", [], None, None)),
    ]

    def tail(last: GenerationChunk) -> list[bytes]:
        usage = _usage(last.num_prompt_tokens or len(prompt_ids), last.num_output_tokens, last.num_cached_tokens)
        final = response.body("completed", items.items, usage, last.finish_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        on_done(final)
        return [items.event(kind, response=final)]

    return converted_events(engine, prompt_ids, params, plan, response.id, items, head, tail)


def _error_events(err: ApiError) -> list[bytes]:
    body = openai_error_body(err)["error"]
    return [
        sse_event(
            "error",
            {
                "type": "error",
                "sequence_number": 0,
                "code": body.get("code"),
                "message": body["message"],
                "param": body.get("param"),
            },
        )
    ]


async def responses(request: Request) -> Response:
    """``POST /v1/responses``."""
    state = request.app.state
    engine = state.engine
    raw = await read_body(request)
    body = parse_json_object(raw)
    get_field(body, "model", str, required=True)
    note_unknown_fields(body, KNOWN_FIELDS, "/v1/responses")
    store: ResponseStore = state.response_store
    history: list[dict[str, Any]] = []
    previous_id = get_field(body, "previous_response_id", str)
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise invalid_request(
                ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                f"previous_response_id {previous_id!r} is not found: it was never stored here (store false), or "
                f"it was dropped (this server keeps the last {store.capacity} responses in memory) or the "
                "server restarted; send the whole conversation in input instead",
                "previous_response_id",
            )
        history = previous.items
    keep = get_field(body, "store", bool, default=True)
    messages = convert_input(body, history)
    text = get_field(body, "text", dict, default={})
    response_format = parse_response_format(text.get("format"), "text.format", nested=False)
    if response_format is not None:
        messages = with_system_instruction(messages, response_format[0])
    tools, kinds = _tools(body)
    tool_choice = parse_tool_choice(body, tools, nested=False)
    max_output_tokens = get_int(body, "max_output_tokens", lo=1)
    params = SamplingParams(
        max_tokens=max_output_tokens or 1,
        temperature=get_number(body, "temperature", lo=0.0, hi=2.0, default=1.0),
        top_p=get_number(body, "top_p", lo=0.0, hi=1.0, lo_open=True, default=1.0),
    )
    check_params(params)
    stream = get_field(body, "stream", bool, default=False)
    offered = None if tool_choice.mode == "none" else tools
    prompt = await render_prompt(engine, messages, offered, _template_kwargs(body))
    plan = plan_output(engine, prompt, offered, tool_choice)
    params.max_tokens = fit_context(
        len(prompt.ids),
        max_output_tokens,
        context_fit(state),
        max_tokens_param="max_output_tokens",
        messages_param="input",
    )
    params.max_tokens = fit_output_budget(
        engine,
        1,
        params.max_tokens,
        max_output_tokens,
        max_tokens_param="max_output_tokens",
    )
    fmt = response_format[1] if response_format is not None else None
    await constrain_output(engine, plan, params, prompt.ids, fmt, offered, messages_param="input")
    response = _Response(body, state.served_model_name, params)
    conversation = [*history, *input_items(body)]

    def on_done(final: dict[str, Any]) -> None:
        if keep:
            num_bytes = len(raw) + len(json.dumps(final))
            store.put(final["id"], StoredResponse(final, [*conversation, *final["output"]], num_bytes))

    if stream:
        events = _stream_events(engine, prompt.ids, params, plan, response, on_done, kinds)
        return EventStreamResponse(guard_stream(events, response.id, _error_events, keepalive_s=state.keepalive_s))
    [completion] = await collect(request, engine, prompt.ids, [params], response.id)
    output = plan.parse(completion.text)
    usage = _usage(completion.num_prompt_tokens, completion.num_output_tokens, completion.num_cached_tokens)
    final = response.body(
        "completed", output_items(output, kinds, completion.finish_reason), usage, completion.finish_reason
    )
    on_done(final)
    return JSONResponse(final)


# Most tokens of a `compact` summary unless the request says (``max_output_tokens``).
COMPACTION_MAX_TOKENS = 2048
# What `compact` asks the model for (the history's summary, which replaces the history's model turns).
COMPACTION_INSTRUCTION = (
    "Summarize the conversation so far for a continuation of this work: the goal, what was done (commands run, files "
    "changed, results), what is left, and any facts needed to go on. Write the summary only."
)


async def compact(request: Request) -> Response:
    """``POST /v1/responses/compact``: the conversation (``instructions`` + ``input``, or a stored
    ``previous_response_id``) compacted by the served model. The output is the input's user messages, then one user
    message holding the model's summary of the whole history (the model's own turns and tool calls are dropped),
    as ``{"object": "response.compaction", "output": [...]}``; its items can be sent back as ``input``. The summary
    is at most ``max_output_tokens`` (an extension) or `COMPACTION_MAX_TOKENS` tokens, greedy, within
    ``--max-request-output-tokens`` as every request (`fit_output_budget`). Codex calls
    this only for providers it knows to support it (OpenAI's, Azure's); with any other provider it compacts by a
    normal turn."""
    state = request.app.state
    engine = state.engine
    body = parse_json_object(await read_body(request))
    get_field(body, "model", str, required=True)
    history: list[dict[str, Any]] = []
    previous_id = get_field(body, "previous_response_id", str)
    if previous_id is not None:
        previous = state.response_store.get(previous_id)
        if previous is None:
            raise invalid_request(
                ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                f"previous_response_id {previous_id!r} is not found",
                "previous_response_id",
            )
        history = previous.items
    messages = convert_input(body, history)
    messages.append({"role": "user", "content": COMPACTION_INSTRUCTION})
    prompt = await render_prompt(engine, messages, None, {"enable_thinking": False})
    plan = plan_output(engine, prompt, None, ToolChoice())
    params = SamplingParams(temperature=0.0)
    max_output_tokens = get_int(body, "max_output_tokens", lo=1)
    params.max_tokens = min(
        max_output_tokens or COMPACTION_MAX_TOKENS,
        fit_context(
            len(prompt.ids), None, context_fit(state), max_tokens_param="max_output_tokens", messages_param="input"
        ),
    )
    # --max-request-output-tokens holds here too: a budget asked past it is a 400, the default is lowered to it.
    params.max_tokens = fit_output_budget(
        engine,
        1,
        params.max_tokens,
        max_output_tokens,
        max_tokens_param="max_output_tokens",
    )
    await constrain_output(engine, plan, params, prompt.ids, messages_param="input")
    response_id = f"resp_{uuid.uuid4().hex}"
    [completion] = await collect(request, engine, prompt.ids, [params], response_id)
    summary = plan.parse(completion.text).content
    users = [
        item
        for item in [*history, *input_items(body)]
        if isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user"
    ]
    output = [*users, {"type": "message", "role": "user", "content": [{"type": "input_text", "text": summary}]}]
    return JSONResponse(
        {
            "id": response_id,
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": output,
            "usage": _usage(completion.num_prompt_tokens, completion.num_output_tokens, completion.num_cached_tokens),
        }
    )


def _stored(request: Request) -> tuple[ResponseStore, str, StoredResponse]:
    store: ResponseStore = request.app.state.response_store
    response_id = request.path_params["response_id"]
    entry = store.get(response_id)
    if entry is None:
        raise ApiError(
            404,
            ErrorCode.RESPONSE_NOT_FOUND,
            f"no stored response with id {response_id!r} (responses "
            f"created with store false are not kept; this server keeps the last {store.capacity})",
        )
    return store, response_id, entry


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response as it was returned, or 404."""
    _, _, entry = _stored(request)
    return JSONResponse(entry.body)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: forget a stored response (later continuations of it are 400s)."""
    store, response_id, _ = _stored(request)
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
