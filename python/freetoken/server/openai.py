"""OpenAI chat completions: ``POST /v1/chat/completions``, streaming (SSE) and not.

Accepted: roles system, developer (rendered as system), user, assistant (with ``tool_calls`` whose
arguments are a JSON string or an object, and ``reasoning_content``), tool; content as a string, an
array of text parts, or null; max_tokens / max_completion_tokens (the latter wins), temperature, top_p,
seed, stop (string or array; it ends the answer, never the model's reasoning), logit_bias, presence_penalty and
frequency_penalty (OpenAI's definitions: subtracted from a generated token's logit once, and per time generated),
stream, stream_options.include_usage, tools, tool_choice; non-standard ``top_k``, ``ignore_eos``,
``repetition_penalty`` (CTRL / Hugging Face: the logit of a token of the prompt or output divided by it when
positive, multiplied when negative), ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``) and
``continue_final_message`` (the last message, the assistant's, is continued instead of closed: a prefill), as in
vLLM.
Accepted and ignored for now: parallel_tool_calls, user, metadata, store.
Every check (a ``logit_bias`` id past the vocabulary included) runs before the response starts: a streamed bad
request is a 400, never a 200 stream that ends in an error event.
``n`` (up to 16 choices, each its own engine request; seeded choices use seed + index).
``response_format`` ``json_object`` / ``json_schema`` (``strict`` or not) constrain decoding with a grammar
(`freetoken.engine.structured`): the content is one compact JSON value matching the schema (an object for
json_object), after the model's reasoning when it thinks, and the request ends when it is complete (or is cut
by max_tokens: finish_reason length). A system instruction with the schema is added to the prompt too, so the
model knows what to write. With tools offered (tool_choice auto) the model may call them instead, and then the
calls' arguments match the tools' parameter schemas. A schema the grammar library cannot enforce is a 400 on
``response_format.json_schema.schema`` (or ``tools``); a forced tool call with a response format is a 400.
``logprobs: true`` with ``top_logprobs`` (0..20) gives ``choices[i].logprobs.content`` (per chunk when
streaming; see `freetoken.server.logprobs` for the values, ``token`` and ``bytes``); ``top_logprobs``
without ``logprobs: true`` is a 400.
Image, audio and file content parts become a short text placeholder saying what was dropped (this model reads
text only; logged once per request); other unknown part types are skipped (logged once).

Output goes through the model family's parser (`freetoken.server.parsers`): reasoning becomes
``reasoning_content``, tool calls ``message.tool_calls`` (content null when there is no text) with
finish_reason ``tool_calls``; streamed, they come as ``delta.reasoning_content`` and ``delta.tool_calls``
(the first piece of a call has index, id, type and name; later pieces add to its arguments).

tool_choice, and what is enforced: ``none`` leaves the tools out of the prompt and parses no calls;
``auto`` offers them and parses calls; ``required`` and ``{"type": "function", "function": {"name": N}}``
offer them and constrain decoding with a grammar (as response_format is): after the model's reasoning, when it
thinks, the output is one or more calls (of N), their arguments matching the tool's ``parameters`` schema.
A tool-call text that cannot be parsed is dropped (and logged), never sent as raw markup.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    SamplingParams,
    TokenLogprob,
)
from freetoken.server.errors import (
    ApiError,
    ErrorCode,
    invalid_request,
    openai_error_body,
)
from freetoken.server.generation import (
    Completion,
    JsonFormat,
    OutputPlan,
    ToolChoice,
    aclose_shielded,
    check_params,
    choice_params,
    collect,
    constrain_output,
    context_fit,
    fit_context,
    fit_output_budget,
    merged_chunks,
    plan_output,
    render_prompt,
)
from freetoken.server.logprobs import chat_logprobs
from freetoken.server.notices import note_once_per_process, note_unknown_fields, omitted
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
    get_tool_name,
    get_tool_schema,
    join_path,
    parse_json_object,
    read_body,
    wrong_type,
)
from freetoken.server.sse import (
    OPENAI_DONE,
    EventStreamResponse,
    guard_stream,
    sse_data,
)

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Most choices (n) one request may ask for; each is an engine request.
MAX_CHOICES = 16


@dataclass
class Sampling:
    """The sampling and streaming fields both OpenAI completion endpoints share.

    Attributes:
        params: sampling parameters; ``max_tokens`` is set from the context once the prompt is known.
        n: the number of choices (each its own engine request; see `choice_params` for seeds).
        max_tokens: the client's completion budget, or None.
        max_tokens_param: the field `max_tokens` came from.
        stream: answer with server-sent events.
        include_usage: send a final usage chunk when streaming.
    """

    params: SamplingParams
    n: int
    max_tokens: int | None
    max_tokens_param: str
    stream: bool
    include_usage: bool


@dataclass
class ChatRequest:
    """A validated chat completions request.

    Attributes:
        messages: the conversation in the Hugging Face chat format (content always a string).
        tools: tool definitions for the chat template, or None.
        tool_choice: how the model may use `tools`.
        template_kwargs: extra chat template variables (``chat_template_kwargs``).
        sampling: sampling and streaming.
        response_format: the JSON the output is constrained to, or None for free text.
        continue_final: continue the last (assistant) message instead of closing it (``continue_final_message``).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    template_kwargs: dict[str, Any]
    sampling: Sampling
    response_format: JsonFormat | None = None
    continue_final: bool = False


# Content parts a text-only model cannot read: each becomes a placeholder saying what was dropped (`omitted`).
_OMITTED_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def _content_text(message: dict[str, Any], path: str, *, required: bool) -> str:
    """A message's content as one string: a string, or the text parts of an array joined by newlines."""
    content = get_field(message, "content", (str, list), parent=path, required=required, default="")
    if isinstance(content, str):
        return content
    content_path = join_path(path, "content")
    texts = []
    for i, part in enumerate(content):
        part_path = join_path(content_path, i)
        if not isinstance(part, dict):
            raise wrong_type(part_path, "an object", part)
        kind = get_field(part, "type", str, parent=part_path, required=True)
        if kind == "text":
            texts.append(get_field(part, "text", str, parent=part_path, required=True))
        elif kind in _OMITTED_PARTS:
            texts.append(omitted(_OMITTED_PARTS[kind]))
        else:
            note_once_per_process(
                f"chat-part:{kind}",
                "/v1/chat/completions: content part type %r is not known to this server and is skipped (logged once)",
                kind,
            )
    return "\n".join(texts)


def _tool_calls(message: dict[str, Any], path: str) -> list[dict[str, Any]]:
    calls = get_object_list(message, "tool_calls", parent=path)
    out = []
    for i, call in enumerate(calls):
        call_path = join_path(join_path(path, "tool_calls"), i)
        function = get_field(call, "function", dict, parent=call_path, required=True)
        function_path = join_path(call_path, "function")
        name = get_field(function, "name", str, parent=function_path, required=True)
        arguments = get_field(function, "arguments", (str, dict), parent=function_path, default="{}")
        if isinstance(arguments, str):
            # Templates differ: some index into the arguments, some print them; a mapping serves both.
            try:
                parsed = json.loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
            except json.JSONDecodeError:
                pass
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        call_id = get_field(call, "id", str, parent=call_path)
        if call_id is not None:
            entry["id"] = call_id
        out.append(entry)
    return out


def convert_messages(raw_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the Hugging Face chat format the tokenizer's template takes."""
    messages = []
    for i, message in enumerate(raw_messages):
        path = join_path("messages", i)
        role = get_field(message, "role", str, parent=path, required=True)
        if role not in _ROLES:
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"{path}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                join_path(path, "role"),
            )
        if role == "developer":
            role = "system"
        converted: dict[str, Any] = {"role": role}
        if role == "assistant":
            converted["content"] = _content_text(message, path, required=False)
            tool_calls = _tool_calls(message, path)
            if tool_calls:
                converted["tool_calls"] = tool_calls
            reasoning = get_field(message, "reasoning_content", str, parent=path)
            if reasoning is not None:
                converted["reasoning_content"] = reasoning
        else:
            converted["content"] = _content_text(message, path, required=True)
        if role == "tool":
            converted["tool_call_id"] = get_field(message, "tool_call_id", str, parent=path, required=True)
        name = get_field(message, "name", str, parent=path)
        if name is not None:
            converted["name"] = name
        messages.append(converted)
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = get_object_list(body, "tools")
    for i, tool in enumerate(tools):
        path = join_path("tools", i)
        kind = get_field(tool, "type", str, parent=path, default="function")
        if kind != "function":
            raise invalid_request(
                ErrorCode.UNSUPPORTED, f"{path}.type must be 'function', got {kind!r}", join_path(path, "type")
            )
        function = get_field(tool, "function", dict, parent=path, required=True)
        function_path = join_path(path, "function")
        get_tool_name(function, parent=function_path)
        # The chat template renders these as they are: a string `parameters` would reach the model as a schema.
        get_field(function, "description", str, parent=function_path)
        get_tool_schema(function, "parameters", parent=function_path)
    return tools or None


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None, *, nested: bool = True) -> ToolChoice:
    """``tool_choice``: "auto" (the default), "none", "required", or a named function among `tools`.

    The function is named as ``{"type": "function", "function": {"name": N}}`` (chat completions) or, with
    `nested` false, ``{"type": "function", "name": N}`` (Responses).
    """
    value = get_field(body, "tool_choice", (str, dict), default="auto")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"tool_choice must be 'auto', 'none', 'required' or a function object, got {value!r}",
                "tool_choice",
            )
        choice = ToolChoice(value)
    else:
        kind = get_field(value, "type", str, parent="tool_choice", required=True)
        if kind != "function":
            raise invalid_request(
                ErrorCode.UNSUPPORTED, f"tool_choice.type must be 'function', got {kind!r}", "tool_choice.type"
            )
        parent = "tool_choice.function" if nested else "tool_choice"
        holder = get_field(value, "function", dict, parent="tool_choice", required=True) if nested else value
        name = get_field(holder, "name", str, parent=parent, required=True)
        if name not in {tool["function"]["name"] for tool in tools or []}:
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"tool_choice names function {name!r}, which is not among tools",
                join_path(parent, "name"),
            )
        choice = ToolChoice("function", name)
    if choice.mode == "required" and not tools:
        raise invalid_request(ErrorCode.INVALID_VALUE, "tool_choice 'required' needs tools", "tool_choice")
    return choice


# Digits of the largest token id a logit_bias key may have (ids past the vocabulary are the engine's 400).
MAX_TOKEN_ID_DIGITS = 18


def parse_logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """``logit_bias``: an object mapping token ids (decimal strings, as JSON keys are) to a bias in [-100, 100]
    added to that token's logit (OpenAI's parameter). Ids past the vocabulary are refused by the engine."""
    value = get_field(body, "logit_bias", dict, default={})
    bias: dict[int, float] = {}
    for key in value:
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                "logit_bias",
            )
        if len(key) > MAX_TOKEN_ID_DIGITS:  # no vocabulary is that large; int() refuses past 4300 digits
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                f"logit_bias key {key[:20]}... ({len(key)} digits) is not a token id of this model",
                "logit_bias",
            )
        number = get_number(value, key, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS, parent="logit_bias")
        if number is not None:
            bias[int(key)] = number
    return bias


def parse_sampling(body: dict[str, Any]) -> Sampling:
    """The sampling and streaming fields of a chat or text completions body."""
    n = get_int(body, "n", lo=1, hi=MAX_CHOICES, default=1)
    frequency_penalty = get_number(body, "frequency_penalty", lo=-2.0, hi=2.0, default=0.0)
    presence_penalty = get_number(body, "presence_penalty", lo=-2.0, hi=2.0, default=0.0)
    repetition_penalty = get_number(
        body, "repetition_penalty", lo=0.0, hi=MAX_REPETITION_PENALTY, lo_open=True, default=1.0
    )

    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, max_tokens_param, lo=1)
    temperature = get_number(body, "temperature", lo=0.0, hi=2.0, default=1.0)
    top_p = get_number(body, "top_p", lo=0.0, hi=1.0, lo_open=True, default=1.0)
    top_k = get_int(body, "top_k", lo=-1, default=0)  # -1 is vLLM's "disabled"
    seed = get_int(body, "seed")
    stop = get_string_list(body, "stop", allow_single=True)
    ignore_eos = get_field(body, "ignore_eos", bool, default=False)
    logit_bias = parse_logit_bias(body)

    stream = get_field(body, "stream", bool, default=False)
    stream_options = get_field(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise invalid_request(
            ErrorCode.INVALID_VALUE, "stream_options is only allowed when stream is true", "stream_options"
        )
    include_usage = bool(
        stream_options and get_field(stream_options, "include_usage", bool, parent="stream_options", default=False)
    )
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        logit_bias=logit_bias,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
    )
    check_params(params)
    return Sampling(params, n, max_tokens, max_tokens_param, stream, include_usage)


JSON_OBJECT_INSTRUCTION = "Respond with one JSON object and nothing else: no prose, no code fences."


def parse_response_format(value: Any, param: str, *, nested: bool = True) -> tuple[str, JsonFormat] | None:
    """A ``response_format`` (chat completions) or ``text.format`` (Responses, `nested` false: the schema's
    fields sit beside ``type``) object: None for text, else the system instruction to add to the prompt and
    the `JsonFormat` the output is constrained to.

    The instruction tells the model what to write (the schema with its descriptions); the grammar makes sure
    the output parses and matches the schema whatever the model prefers.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    kind = get_field(value, "type", str, parent=param, required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_INSTRUCTION, JsonFormat({"type": "object"}, param)
    if kind != "json_schema":
        raise invalid_request(
            ErrorCode.INVALID_VALUE,
            f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            join_path(param, "type"),
        )
    spec_path = join_path(param, "json_schema") if nested else param
    spec = get_field(value, "json_schema", dict, parent=param, required=True) if nested else value
    name = get_field(spec, "name", str, parent=spec_path, required=True)
    get_field(spec, "strict", bool, parent=spec_path)
    schema = get_field(spec, "schema", dict, parent=spec_path, default={"type": "object"})
    return schema_instruction(schema, name), JsonFormat(schema, join_path(spec_path, "schema"))


def schema_instruction(schema: dict[str, Any], name: str | None = None) -> str:
    """The system instruction that tells the model to answer with JSON matching `schema` (named `name`)."""
    named = f" (named {name!r})" if name else ""
    return f"{JSON_OBJECT_INSTRUCTION} It must match this JSON schema{named}:\n{json.dumps(schema, ensure_ascii=False)}"


def with_system_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """`messages` with `instruction` appended to the first system message (or in a new one, first)."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{instruction}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


# Top-level fields of a chat completions body this server reads, or knows and ignores on purpose; any other is
# logged once (`note_unknown_fields`).
KNOWN_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "ignore_eos",
        "chat_template_kwargs",
        "continue_final_message",
        "user",
        "metadata",
        "store",
    }
)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a chat completions body; every failure is a 400 naming the field."""
    get_field(body, "model", str, required=True)
    note_unknown_fields(body, KNOWN_CHAT_FIELDS, "/v1/chat/completions")
    raw_messages = get_object_list(body, "messages", required=True, non_empty=True)
    messages = convert_messages(raw_messages)
    tools = _tools(body)
    tool_choice = parse_tool_choice(body, tools)

    logprobs = get_field(body, "logprobs", bool, default=False)
    top_logprobs = get_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid_request(
            ErrorCode.INVALID_VALUE, "top_logprobs is only allowed when logprobs is true", "top_logprobs"
        )
    response_format = parse_response_format(body.get("response_format"), "response_format")
    if response_format is not None:
        messages = with_system_instruction(messages, response_format[0])
    template_kwargs = get_field(body, "chat_template_kwargs", dict, default={})
    continue_final = get_field(body, "continue_final_message", bool, default=False)
    if continue_final and messages[-1]["role"] != "assistant":
        raise invalid_request(
            ErrorCode.INVALID_VALUE,
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    sampling = parse_sampling(body)
    if logprobs:
        sampling.params.logprobs = top_logprobs or 0
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        template_kwargs=template_kwargs,
        sampling=sampling,
        response_format=response_format[1] if response_format is not None else None,
        continue_final=continue_final,
    )


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came from the
    prefix cache."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(finish_reason: str, has_tool_calls: bool) -> str:
    """The engine's finish reason, as "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if has_tool_calls and finish_reason == "stop" else finish_reason


def _message(output: ParsedOutput) -> dict[str, Any]:
    """The ``message`` of one choice."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": output.content if output.content or not output.tool_calls else None,
        "refusal": None,
        "reasoning_content": output.reasoning or None,
    }
    if output.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in output.tool_calls
        ]
    return message


def completion_body(
    request_id: str,
    created: int,
    model: str,
    completions: list[Completion],
    outputs: list[ParsedOutput],
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object: one choice per completion, parsed into `outputs`; a
    completion with logprobs gets them (in tokens' texts through `tokenizer`)."""
    choices = [
        {
            "index": index,
            "message": _message(output),
            "logprobs": chat_logprobs(tokenizer, completion.logprobs) if completion.logprobs is not None else None,
            "finish_reason": _finish_reason(completion.finish_reason, bool(output.tool_calls)),
        }
        for index, (completion, output) in enumerate(zip(completions, outputs, strict=True))
    ]
    num_output_tokens = sum(completion.num_output_tokens for completion in completions)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(completions[0].num_prompt_tokens, num_output_tokens, completions[0].num_cached_tokens),
    }


def _delta_fields(delta: ParsedDelta, call_ids: list[str]) -> dict[str, Any]:
    """A parsed delta as the fields of a chunk's ``delta`` (empty when it carries nothing); a tool call's
    first piece gets a new id, appended to `call_ids`."""
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    calls = []
    for piece in delta.tool_calls:
        if piece.name is not None:
            call_ids.append(_call_id())
            calls.append(
                {
                    "index": piece.index,
                    "id": call_ids[piece.index],
                    "type": "function",
                    "function": {"name": piece.name, "arguments": piece.arguments},
                }
            )
        else:
            calls.append({"index": piece.index, "function": {"arguments": piece.arguments}})
    if calls:
        fields["tool_calls"] = calls
    return fields


async def _stream_events(
    engine: Any,
    prompt_ids: list[int],
    chat: ChatRequest,
    plan: OutputPlan,
    request_id: str,
    created: int,
    model: str,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of one streamed completion (its n choices interleaved), ending with ``[DONE]``;
    raises on failure (`guard_stream`)."""
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
    }
    if chat.sampling.include_usage:
        base["usage"] = None

    want_logprobs = chat.sampling.params.logprobs is not None

    def chunk_event(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        # The logprobs of the tokens since the last event go with the next one (a chunk whose text the parser
        # holds back has no event of its own); the finish event takes what is left.
        logprobs = None
        if want_logprobs and (pending_logprobs[index] or finish_reason is not None):
            logprobs = chat_logprobs(engine.tokenizer, pending_logprobs[index])
            pending_logprobs[index] = []
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice]})

    params = choice_params(chat.sampling.params, chat.sampling.n)
    parsers = [plan.parser() for _ in params]
    pending = [first for _, first in parsers]  # what a forced call's opening parsed, sent with the first text
    call_ids: list[list[str]] = [[] for _ in params]
    pending_logprobs: list[list[TokenLogprob]] = [[] for _ in params]
    last: list[Any] = [None] * len(params)
    for index in range(len(params)):
        yield chunk_event(index, {"role": "assistant", "content": ""})
    chunks = merged_chunks(engine, prompt_ids, params, request_id)
    try:
        async for index, out in chunks:
            parser = parsers[index][0]
            pending_logprobs[index].extend(out.logprobs or ())
            pending[index].extend(parser.feed(out.text))
            if out.finish_reason is not None:
                pending[index].extend(parser.finish())
            fields = _delta_fields(pending[index], call_ids[index])
            pending[index] = ParsedDelta()
            if fields:
                yield chunk_event(index, fields)
            if out.finish_reason is not None:
                yield chunk_event(index, {}, _finish_reason(out.finish_reason, bool(call_ids[index])))
            last[index] = out
    finally:
        await aclose_shielded(chunks)
    if any(out is None or out.finish_reason is None for out in last):
        raise ApiError(500, ErrorCode.INTERNAL_ERROR, "the engine ended the request without a finish reason")
    if chat.sampling.include_usage:
        num_prompt_tokens = last[0].num_prompt_tokens or len(prompt_ids)
        num_output_tokens = sum(out.num_output_tokens for out in last)
        usage_ = usage(num_prompt_tokens, num_output_tokens, last[0].num_cached_tokens)
        yield sse_data({**base, "choices": [], "usage": usage_})
    yield OPENAI_DONE


def error_events(err: ApiError) -> list[bytes]:
    """The tail of a stream that failed: an error event, then ``[DONE]``."""
    return [sse_data(openai_error_body(err)), OPENAI_DONE]


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state = request.app.state
    engine = state.engine
    chat = parse_chat_request(parse_json_object(await read_body(request)))
    tools = None if chat.tool_choice.mode == "none" else chat.tools
    prompt = await render_prompt(engine, chat.messages, tools, chat.template_kwargs, continue_final=chat.continue_final)
    plan = plan_output(engine, prompt, tools, chat.tool_choice)
    prompt_ids = prompt.ids
    sampling = chat.sampling
    sampling.params.max_tokens = fit_context(
        len(prompt_ids), sampling.max_tokens, context_fit(state), max_tokens_param=sampling.max_tokens_param
    )
    sampling.params.max_tokens = fit_output_budget(
        engine,
        sampling.n,
        sampling.params.max_tokens,
        sampling.max_tokens,
        max_tokens_param=sampling.max_tokens_param,
    )
    await constrain_output(engine, plan, sampling.params, prompt_ids, chat.response_format, tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.served_model_name
    if sampling.stream:
        events = _stream_events(engine, prompt_ids, chat, plan, request_id, created, model)
        return EventStreamResponse(guard_stream(events, request_id, error_events, keepalive_s=state.keepalive_s))
    params = choice_params(sampling.params, sampling.n)
    completions = await collect(request, engine, prompt_ids, params, request_id)
    outputs = [plan.parse(completion.text) for completion in completions]
    return JSONResponse(completion_body(request_id, created, model, completions, outputs, engine.tokenizer))
