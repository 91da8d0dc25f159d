"""From validated chat messages to engine output, shared by both APIs.

- `render_prompt`: chat template (with tool definitions) -> prompt text and token ids, off the event loop.
- `plan_output`: the model family's output parsers for one request, and how a forced tool choice is enforced.
- `constrain_output`: the request's grammar (a response format's, or a forced tool call's) and the reasoning tags
  its stop strings skip; then the engine's own checks (`check_request`), all before any response byte.
- `fit_context`: checks the prompt against the engine's context length and fits the completion budget to it.
- `collect`: runs one request (its n choices) to completion for a non-streaming response, and aborts
  it when the client disconnects first; `merged_chunks` interleaves the choices' chunks.
- `closing_chunks`: runs the engine's generator so that it is always closed (the engine aborts the
  request and frees its KV blocks) however the consumer stops; `parsed_chunks` adds the output parser's
  view of each chunk, for streams of one choice.

API shapes live in `openai.py`, `completions.py`, `responses.py` and `anthropic.py`; this module knows none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from freetoken.engine import RequestError
from freetoken.engine.structured import GrammarError, GrammarMatcher, json_grammar
from freetoken.engine.types import GenerationChunk, SamplingParams, TokenLogprob
from freetoken.errors import FreetokenError
from freetoken.server import telemetry
from freetoken.server.engine_client import EngineClient
from freetoken.server.errors import ApiError, ApiFlavor, ErrorCode, invalid_request
from freetoken.server.notices import note_once_per_request
from freetoken.server.parsers import (
    OutputParser,
    ParsedDelta,
    ParsedOutput,
    ParserOptions,
    parse_text,
    parser_for,
)
from freetoken.tokenizer import PromptTooLong

logger = logging.getLogger("freetoken.server")

# Arguments of apply_chat_template that a client's template kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "add_generation_prompt", "tokenize"})


class ClientDisconnected(FreetokenError):
    """The client went away before its response was ready; nothing can be sent back."""


@dataclass
class Completion:
    """The whole output of one finished request.

    Attributes:
        text: all generated text.
        finish_reason: "stop" or "length".
        stop_reason: the stop string or stop token id that ended it, if any.
        num_prompt_tokens: tokens in the prompt.
        num_output_tokens: tokens generated.
        logprobs: one entry per generated token when the request asked for logprobs, else None.
        num_cached_tokens: prompt tokens the KV prefix cache supplied.
        num_cache_write_tokens: prompt tokens this request added to the KV prefix cache.
        prompt_logprobs: one entry per prompt token (None for the first) when the request asked for them
            (`SamplingParams.prompt_logprobs`), else None.
    """

    text: str
    finish_reason: str
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Prompt:
    """A rendered prompt.

    Attributes:
        text: the chat template's output.
        ids: its token ids (plus those of a forced tool call's opening, see `plan_output`).
    """

    text: str
    ids: list[int]


@dataclass(frozen=True)
class ToolChoice:
    """How the model may use the offered tools.

    Attributes:
        mode: "auto" (the model decides), "none" (tools not offered, calls not parsed), "required"
            (a call is forced), or "function" (a call of `name` is forced).
        name: the function of mode "function".
    """

    mode: str = "auto"
    name: str | None = None


async def render_prompt(
    engine: EngineClient,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    max_tokens: int | None = None,
    *,
    continue_final: bool = False,
    flavor: ApiFlavor = ApiFlavor.OPENAI,
) -> Prompt:
    """Render `messages` (Hugging Face chat format) with the model's chat template and tokenize.

    With `continue_final` the last message (the assistant's, a prefill) is continued, not closed: the messages
    before it are rendered with the assistant's generation header (which holds the template's choices, such as an
    empty reasoning block when thinking is off), and its content follows the header as the start of the answer
    (transformers' ``continue_final_message``, without searching the rendered text for it).

    Only the template's markup yields control tokens: client text is tokenized as plain text
    (`Tokenizer.encode_chat`). The work is bounded: a prompt past `max_tokens` (default: the context) is
    refused, as a 400 (context_length_exceeded) naming `messages`, in `flavor`'s wording (see `fit_context`),
    without tokenizing more than that many tokens' worth of text (`Tokenizer.max_token_chars` characters a token).
    Template errors (for example a conversation the template rejects) become a 400 naming `messages`.
    """
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # ft serve refuses a model directory without one
    template_kwargs = {k: v for k, v in template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    limit = max_tokens or engine.max_model_len
    prefill = messages[-1].get("content") or "" if continue_final else ""
    if continue_final:
        messages = messages[:-1]
        if not messages:  # templates start from messages[0] ("list object has no element 0" from Qwen's)
            raise invalid_request(
                ErrorCode.INVALID_VALUE,
                "messages holds only the assistant message to continue (a prefill); put the user's message (or a "
                "system prompt) before it",
                "messages",
            )

    def render() -> Prompt:
        text, ids = tokenizer.encode_chat(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            max_tokens=limit,
            **template_kwargs,
        )
        if prefill:  # client text: plain text, as encode_chat tokenizes the messages' text
            text, ids = text + prefill, ids + tokenizer.encode_plain(prefill)
        return Prompt(text, ids)

    try:
        return await run_in_threadpool(render)
    except PromptTooLong as exc:
        raise prompt_too_long(exc.num_tokens, engine.max_model_len, flavor, "messages", exact=exc.exact) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise invalid_request(
            ErrorCode.TEMPLATE_ERROR, f"the chat template cannot render these messages: {exc}", "messages"
        ) from None
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):
            raise invalid_request(
                ErrorCode.TEMPLATE_ERROR, f"the chat template cannot render these messages: {exc}", "messages"
            ) from None
        raise


@dataclass
class OutputPlan:
    """How one request's outputs are parsed.

    Attributes:
        tokenizer: the model's tokenizer (it picks the parser family).
        options: the parsers' options.
        prefix: the forced tool call's opening appended to the prompt, or "" (a model without a grammar engine).
        forced_tools: the tools a call is forced among, enforced by a grammar (`constrain_output`), or None.
    """

    tokenizer: Any
    options: ParserOptions
    prefix: str
    forced_tools: list[dict[str, Any]] | None = None

    def parser(self) -> tuple[OutputParser, ParsedDelta]:
        """A new parser for one choice, and what it made of `prefix` (the forced call's name, say)."""
        parser = parser_for(self.tokenizer, self.options)
        return parser, parser.feed(self.prefix) if self.prefix else ParsedDelta()

    def parse(self, text: str) -> ParsedOutput:
        """One choice's whole output text, parsed by a new parser."""
        parser, first = self.parser()
        return parse_text(parser, text, first)


def plan_output(
    engine: EngineClient, prompt: Prompt, tools: list[dict[str, Any]] | None, tool_choice: ToolChoice
) -> OutputPlan:
    """The output plan of one request; `tools` are those offered in the prompt (None when none are).

    A tool choice "required" or "function" is enforced by a grammar when the engine has one and the model family
    writes tool calls in known markup (`OutputParser.tool_calls_grammar`): the output ends the reasoning block the
    prompt opened, if any, then must be one or more calls of the offered tools (of the named one for "function"),
    their arguments matching the tools' parameter schemas (`constrain_output` compiles it). Without a grammar
    engine, the opening of a tool call (naming the function for "function") is appended to `prompt.ids`, so the
    output continues inside the call; a prompt that cannot be forced that way (see
    `OutputParser.tool_call_prefix`) is left to choose.
    """
    parse_tools = bool(tools) and tool_choice.mode != "none"
    options = ParserOptions(prompt_text=prompt.text, parse_tools=parse_tools, tools=tools if parse_tools else None)
    if not (parse_tools and tool_choice.mode in ("required", "function")):
        return OutputPlan(engine.tokenizer, options, "")
    parser = parser_for(engine.tokenizer, options)
    forced = [t for t in tools or [] if tool_choice.mode == "required" or t["function"]["name"] == tool_choice.name]
    if engine.grammars is not None and parser.tool_calls_grammar(forced):
        return OutputPlan(engine.tokenizer, options, "", forced)
    prefix = parser.tool_call_prefix(tool_choice.name) or ""
    if prefix:
        assert engine.tokenizer is not None  # ft serve refuses a model directory without one
        prompt.ids = prompt.ids + engine.tokenizer.encode(prefix)
    return OutputPlan(engine.tokenizer, options, prefix)


@dataclass(frozen=True)
class JsonFormat:
    """A JSON output the client asked for (``response_format`` / ``text.format``), enforced by a grammar.

    Attributes:
        schema: the JSON schema the output must match (``{"type": "object"}`` for ``json_object``).
        param: the request field holding it, for errors.
    """

    schema: dict[str, Any]
    param: str


async def format_grammar(
    engine: EngineClient, fmt: JsonFormat, plan: OutputPlan, tools: list[dict[str, Any]] | None = None
) -> GrammarMatcher:
    """Compile `fmt` into a grammar matcher for one choice (`GrammarMatcher.fork` for more), off the event loop.

    The grammar lets the model's reasoning block (its parser's `reasoning_grammar`) come first, then either one
    JSON value matching the schema or, when `tools` are offered and parsed, tool calls in the family's markup
    (`tool_calls_grammar`; their arguments then match the tools' parameter schemas), then EOS.

    Raises:
        ApiError: 400 naming `fmt.param` when the schema is invalid or uses what the grammar library does not
            support (``tools`` when it is a tool's parameters); 400 on the format when the model has no
            tokenizer; 400 on tool_choice when a tool call is forced (its opening is already in the prompt).
    """
    if engine.grammars is None:
        raise invalid_request(
            ErrorCode.UNSUPPORTED, "structured output needs the model's tokenizer.json", fmt.param.split(".")[0]
        )
    if plan.prefix or plan.forced_tools:
        raise invalid_request(
            ErrorCode.UNSUPPORTED,
            f"{fmt.param.split('.')[0]} cannot be combined with a forced tool call (tool_choice 'required' or a "
            "named function); use tool_choice 'auto' or 'none'",
            "tool_choice",
        )
    parser, _ = plan.parser()
    reasoning = parser.reasoning_grammar()
    tool_calls = parser.tool_calls_grammar(tools) if tools and plan.options.parse_tools else ""
    try:
        return await run_in_threadpool(engine.grammars.matcher, json_grammar(fmt.schema, reasoning, tool_calls))
    except GrammarError as exc:
        error, param = exc, fmt.param
    if tool_calls:  # whose schema is it? the format's alone decides
        try:
            await run_in_threadpool(engine.grammars.matcher, json_grammar(fmt.schema, reasoning))
            param = "tools"
        except GrammarError as exc:
            error = exc
    raise _schema_error(error, param)


def _schema_error(error: GrammarError, param: str) -> ApiError:
    """The 400 of a schema (of `param`: a format's, or "tools") the grammar library refused."""
    # llguidance's first line says what is wrong; it starts with a position in the generated grammar text, which
    # means nothing to the client, and goes on with that text. A regex error ends that line with ":" and names
    # the problem on its own "error: ..." line after the pattern.
    lines = str(error).strip().splitlines()
    detail = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    reason = next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), None)
    if detail.endswith(":") and reason:
        detail = f"{detail} {reason}"
    what = "a tool's parameters are not a JSON schema" if param == "tools" else f"{param} is not a JSON schema"
    return invalid_request(ErrorCode.INVALID_VALUE, f"{what} this server can enforce: {detail}", param)


async def constrain_output(
    engine: EngineClient,
    plan: OutputPlan,
    params: SamplingParams,
    prompt_ids: list[int],
    fmt: JsonFormat | None = None,
    tools: list[dict[str, Any]] | None = None,
    *,
    messages_param: str = "messages",
) -> None:
    """Finish one request's `params` before its response starts: the grammar of `fmt` (see `format_grammar`) or of the
    plan's forced tool call (the end of the reasoning block the prompt opened, if any, then calls of
    `plan.forced_tools`, their arguments matching the tools' schemas, then EOS), the reasoning tags its stop
    strings skip (`SamplingParams.reasoning_tags`), then the engine's own checks (`check_request`).

    Raises:
        ApiError: 400 as `format_grammar` and `check_request` raise them; 400 on ``tools`` when a forced tool's
            parameters are a schema the grammar library cannot enforce.
    """
    parser, _ = plan.parser()
    params.reasoning_tags = parser.reasoning_tags()
    if fmt is not None:
        params.grammar = await format_grammar(engine, fmt, plan, tools)
    elif plan.forced_tools:
        # A forced call comes at once (as a call opened in the prompt would): the output thinks only when the
        # prompt opened its reasoning block. Thinking first would spend a budget sized for the call.
        reasoning = parser.reasoning_grammar(optional=False)
        grammar = json_grammar(None, reasoning, parser.tool_calls_grammar(plan.forced_tools))
        assert engine.grammars is not None  # forced_tools is set only with a grammar backend (output_plan)
        try:
            params.grammar = await run_in_threadpool(engine.grammars.matcher, grammar)
        except GrammarError as exc:
            raise _schema_error(exc, "tools") from None
    check_request(engine, prompt_ids, params, messages_param=messages_param)


def check_request(engine: EngineClient, prompt_ids: list[int], params: SamplingParams, *, messages_param: str) -> None:
    """The engine's checks of a request (`AsyncEngine.check_request`: token ids in the vocabulary, ...), run before
    the response starts, so that a streamed bad request is a 400 and never a 200 that ends in an error event.

    Raises:
        ApiError: 400 naming the field (`messages_param` for the prompt).
    """
    try:
        engine.check_request(prompt_ids, params)
    except RequestError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise invalid_request(
            ErrorCode.INVALID_VALUE, message, messages_param if field == "prompt" else field
        ) from None


@dataclass(frozen=True)
class ContextFit:
    """How a request's completion budget is fitted to the context (`fit_context`).

    Attributes:
        max_model_len: the engine's context length in tokens.
        strict: refuse a budget past the room the prompt leaves (400) instead of lowering it to that room.
        flavor: whose wording the errors take (clients match them: Anthropic's "prompt is too long: N tokens > M
            maximum", OpenAI's code context_length_exceeded).
    """

    max_model_len: int
    strict: bool = False
    flavor: ApiFlavor = ApiFlavor.OPENAI


def prompt_too_long(
    num_tokens: int, max_model_len: int, flavor: ApiFlavor, messages_param: str, *, exact: bool = True
) -> ApiError:
    """The 400 (code context_length_exceeded) for a prompt that leaves no room for output, in `flavor`'s wording
    (Anthropic's ``prompt is too long: N tokens > M maximum``, which clients match; `exact` False: counting
    stopped at `num_tokens`, a lower bound)."""
    if flavor is ApiFlavor.ANTHROPIC:
        message = f"prompt is too long: {num_tokens} tokens > {max_model_len - 1} maximum"
    else:
        count = f"{num_tokens}" if exact else f"more than {max_model_len} (counting stopped there)"
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your {messages_param} "
            f"resulted in {count} tokens, which leaves no room for output. Please reduce the length of the "
            f"{messages_param}."
        )
    anthropic = flavor is ApiFlavor.ANTHROPIC
    return invalid_request(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, messages_param, verbatim=anthropic)


def context_fit(state: Any, flavor: ApiFlavor = ApiFlavor.OPENAI) -> ContextFit:
    """The `ContextFit` of the app whose ``state`` this is (see `freetoken.server.app.build_app`)."""
    return ContextFit(state.engine.max_model_len, state.strict_max_tokens, flavor)


def fit_context(
    num_prompt_tokens: int,
    max_tokens: int | None,
    fit: ContextFit,
    *,
    max_tokens_param: str,
    messages_param: str = "messages",
) -> int:
    """The completion budget of a request: `max_tokens`, lowered to the room the prompt leaves in the context.

    Harnesses ask for more output than a small context holds (Claude Code: 32000 or 128000 tokens whatever the
    model), so a budget past the room is lowered to it (logged once per request; the output then ends with finish
    reason length / stop reason max_tokens when it fills the context), unless `fit.strict`.

    Args:
        num_prompt_tokens: tokens in the rendered prompt.
        max_tokens: the client's completion budget, or None for "whatever the context leaves".
        fit: the context length, strictness, and error wording.
        max_tokens_param: the field the budget came from, for the error.
        messages_param: the field holding the prompt, for the error.

    Raises:
        ApiError: 400 (code context_length_exceeded) when the prompt leaves no room for one output token, or, in
            strict mode, when the budget does not fit.
    """
    limit = fit.max_model_len
    anthropic = fit.flavor is ApiFlavor.ANTHROPIC
    if num_prompt_tokens >= limit:
        raise prompt_too_long(num_prompt_tokens, limit, fit.flavor, messages_param)
    room = limit - num_prompt_tokens
    if max_tokens is None or max_tokens <= room:
        return room if max_tokens is None else max_tokens
    if fit.strict:
        if anthropic:
            message = (
                f"input length and `{max_tokens_param}` exceed context limit: {num_prompt_tokens} + {max_tokens} > "
                f"{limit}, decrease input length or `{max_tokens_param}` and try again"
            )
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {messages_param}, {max_tokens} "
                f"in {max_tokens_param}). Please reduce the length of the {messages_param} or {max_tokens_param} "
                f"(at most {room})."
            )
        raise invalid_request(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, max_tokens_param, verbatim=anthropic)
    note_once_per_request(
        "max_tokens-lowered",
        "%s %d lowered to %d: the prompt takes %d of the %d-token context (--strict-max-tokens refuses instead)",
        max_tokens_param,
        max_tokens,
        room,
        num_prompt_tokens,
        limit,
    )
    return room


def fit_output_budget(
    engine: EngineClient, n: int, max_tokens: int, asked: int | None, *, max_tokens_param: str
) -> int:
    """Check `n` choices of `max_tokens` each against the engine's cap on one request's output tokens
    (`EngineConfig.max_request_output_tokens`); return the per-choice budget.

    `asked` is the client's own `max_tokens_param`, None when it gave none (`max_tokens` may be less: what
    `fit_context` lowered it to). A budget the client gave over the cap is a 400 naming `max_tokens_param` and
    quoting `asked` (a client that sent 1e9 reads 1e9, not the context's rest); one it did not give (a default or
    the context's rest) is lowered to the cap's share, ``cap // n``.
    """
    cap = engine.max_request_output_tokens
    if n * max_tokens <= cap:
        return max_tokens
    if asked is None:
        return max(1, cap // n)
    asked_text = (
        f"{max_tokens_param} is {asked} tokens;"
        if n == 1
        else (f"n x {max_tokens_param} is {n} x {asked} = {n * asked} tokens;")
    )
    raise invalid_request(
        ErrorCode.INVALID_VALUE,
        f"{asked_text} this server allows {cap} per request (--max-request-output-tokens); lower {max_tokens_param} "
        f"to at most {max(1, cap // n)}" + ("" if n == 1 else " or n"),
        max_tokens_param,
    )


# A positive temperature below this samples greedily: dividing the logits by a smaller one overflows them to
# inf and the engine's sampling step fails (vLLM draws the same line).
MIN_TEMPERATURE = 1e-5


def check_params(params: SamplingParams) -> None:
    """Run the engine's own range checks; a failure is a 400 naming the field. A temperature in
    (0, MIN_TEMPERATURE) becomes 0 (greedy)."""
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise invalid_request(ErrorCode.INVALID_VALUE, message, field) from None
    if 0.0 < params.temperature < MIN_TEMPERATURE:
        params.temperature = 0.0


async def aclose_shielded(chunks: AsyncIterator[Any]) -> None:
    """Close an async generator, shielded from a pending cancellation so its cleanup runs to the end."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def closing_chunks(
    engine: EngineClient, prompt_ids: list[int], params: SamplingParams, request_id: str, group: str | None = None
) -> AsyncIterator[GenerationChunk]:
    """Yield the engine's chunks for one request; the engine generator is closed on any exit.

    Closing happens even when this generator is cancelled or closed early (client disconnect), and is
    shielded from the cancellation so that the engine's abort path runs to the end. A chunk with
    finish_reason "abort" becomes a 503 `ApiError` (code request_aborted).
    """
    chunks = engine.generate(prompt_ids, params, request_id=request_id, group=group)
    finished = False
    try:
        async for chunk in chunks:
            if chunk.finish_reason == "abort":
                raise ApiError(
                    503,
                    ErrorCode.REQUEST_ABORTED,
                    "the engine aborted this request (the server is shutting down, or the client stopped reading)",
                )
            finished = chunk.finish_reason is not None
            telemetry.observe_chunk(request_id, chunk.num_prompt_tokens, len(chunk.token_ids))
            yield chunk
    except RequestError as exc:
        raise invalid_request(ErrorCode.INVALID_VALUE, f"the engine refused the request: {exc}") from None
    finally:
        await aclose_shielded(chunks)
        if not finished:
            logger.info("request %s: closed before it finished (client gone or error); aborted", request_id)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of `n` choices of one request: copies of `params`, the i-th seeded ``seed + i`` (when
    seeded), so that choices differ yet a seeded request is reproducible; each gets its own fork of a grammar
    matcher (it holds the sequence's state)."""
    if n == 1:
        return [params]
    seeds = [None] * n if params.seed is None else [params.seed + i for i in range(n)]
    return [
        dataclasses.replace(
            params, seed=seed, stop=list(params.stop), grammar=params.grammar.fork() if params.grammar else None
        )
        for seed in seeds
    ]


async def merged_chunks(
    engine: EngineClient, prompt_ids: list[int], params: list[SamplingParams], request_id: str
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(choice index, chunk) of one engine request per entry of `params`, as they arrive.

    Every engine generator is closed on any exit (see `closing_chunks`); the first error ends them all.
    """
    if len(params) == 1:
        chunks = closing_chunks(engine, prompt_ids, params[0], request_id)
        try:
            async for chunk in chunks:
                yield 0, chunk
        finally:
            await aclose_shielded(chunks)
        return
    # The choices are one group: together they take at most the engine's per-request share of the batch.
    streams = [
        closing_chunks(engine, prompt_ids, p, f"{request_id}-{i}", group=request_id) for i, p in enumerate(params)
    ]
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, stream in enumerate(streams):
            pending[asyncio.ensure_future(stream.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, chunk
    finally:
        with anyio.CancelScope(shield=True):
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for stream in streams:
                await stream.aclose()


async def parsed_chunks(
    engine: EngineClient, prompt_ids: list[int], params: SamplingParams, plan: OutputPlan, request_id: str
) -> AsyncIterator[tuple[ParsedDelta, GenerationChunk]]:
    """One engine request's chunks, each with what the output parser made of its text (a forced call's
    opening joins the first, the parser's held-back tail the last); a 500 when the engine ends the request
    without a finish reason. The engine generator is closed on any exit."""
    parser, pending = plan.parser()
    chunks = merged_chunks(engine, prompt_ids, [params], request_id)
    last = None
    try:
        async for _, out in chunks:
            pending.extend(parser.feed(out.text))
            if out.finish_reason is not None:
                pending.extend(parser.finish())
            yield pending, out
            pending = ParsedDelta()
            last = out
    finally:
        await aclose_shielded(chunks)
    if last is None or last.finish_reason is None:
        raise ApiError(500, ErrorCode.INTERNAL_ERROR, "the engine ended the request without a finish reason")


class EventConverter(Protocol):
    """Turns one request's parsed output into an API's stream events (Anthropic blocks, Responses items)."""

    def events(self, parsed: ParsedDelta) -> list[bytes]:
        """The events of one parsed delta (possibly none)."""
        ...

    def close(self, last: GenerationChunk) -> list[bytes]:
        """The events that end the output (the open block or item closes); `last` is the request's last chunk
        (its finish reason says whether the budget cut the output)."""
        ...


async def converted_events(
    engine: EngineClient,
    prompt_ids: list[int],
    params: SamplingParams,
    plan: OutputPlan,
    request_id: str,
    converter: EventConverter,
    head: list[bytes],
    tail: Callable[[GenerationChunk], list[bytes]],
) -> AsyncGenerator[bytes, None]:
    """The events of one streamed request: `head`, then `converter`'s events of each parsed chunk and of its
    close, then `tail` of the last chunk (it has the finish reason and the token counts).

    The engine request is closed (aborted if unfinished) on any exit, this generator's early close included.
    Raises what `parsed_chunks` raises (for `guard_stream`).
    """
    for event in head:
        yield event
    chunks = parsed_chunks(engine, prompt_ids, params, plan, request_id)
    last: GenerationChunk | None = None
    try:
        async for parsed, last in chunks:  # noqa: B007 (`last` is read after the loop)
            for event in converter.events(parsed):
                yield event
    finally:
        await aclose_shielded(chunks)
    assert last is not None  # parsed_chunks raises when the engine sent nothing
    for event in converter.close(last):
        yield event
    for event in tail(last):
        yield event


async def _drain(
    chunks: AsyncIterator[tuple[int, GenerationChunk]], n: int, num_prompt_tokens: int
) -> list[Completion]:
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * n
    last: list[GenerationChunk | None] = [None] * n
    async for i, chunk in chunks:
        parts[i].append(chunk.text)
        if chunk.logprobs is not None:
            logprobs[i] = (logprobs[i] or []) + list(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            prompt_logprobs[i] = chunk.prompt_logprobs
        last[i] = chunk
    completions = []
    for i, chunk in enumerate(last):
        if chunk is None or chunk.finish_reason is None:
            raise ApiError(500, ErrorCode.INTERNAL_ERROR, "the engine ended the request without a finish reason")
        completions.append(
            Completion(
                text="".join(parts[i]),
                finish_reason=chunk.finish_reason,
                stop_reason=chunk.stop_reason,
                num_prompt_tokens=chunk.num_prompt_tokens or num_prompt_tokens,
                num_output_tokens=chunk.num_output_tokens,
                logprobs=logprobs[i],
                num_cached_tokens=chunk.num_cached_tokens,
                num_cache_write_tokens=chunk.num_cache_write_tokens,
                prompt_logprobs=prompt_logprobs[i],
            )
        )
    return completions


async def collect(
    request: Request, engine: EngineClient, prompt_ids: list[int], params: list[SamplingParams], request_id: str
) -> list[Completion]:
    """Run one engine request per entry of `params` (the choices) to the end; abort them all and raise
    `ClientDisconnected` if the client leaves first."""
    result: list[list[Completion]] = []
    error: list[BaseException] = []
    disconnected = False

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                scope.cancel()
                return

    chunks = merged_chunks(engine, prompt_ids, params, request_id)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            try:
                result.append(await _drain(chunks, len(params), len(prompt_ids)))
            except Exception as exc:
                error.append(exc)
            tg.cancel_scope.cancel()
    finally:
        await aclose_shielded(chunks)
    if error:
        raise error[0]
    if disconnected or not result:
        raise ClientDisconnected(request_id)
    return result[0]
