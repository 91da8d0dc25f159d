"""Model output parsers: generated text -> content, reasoning and tool calls, streamed or whole.

Each model family writes reasoning and tool calls its own way (Qwen3: ``<think>...</think>`` and
``<tool_call>{json}</tool_call>``; Qwen3.5 and Qwen3-Coder: ``<tool_call><function=NAME><parameter=ARG>``,
`qwen3_xml`). A family registers one `OutputParser` factory here with a test on the tokenizer (and its chat
template, `Tokenizer.chat_template_source`); the server asks `parser_for` and never branches on the family. A new
family adds a module and one `register` call.

Parsers are incremental: `OutputParser.feed` takes each text delta the engine emits and returns a
`ParsedDelta`; `finish` flushes what was held back. They never leak part of a tag into content (a
partial tag is held until it is decided), and malformed model output becomes content, never an
exception. `parse_text` runs a parser over a whole completion for non-streaming responses, so both
paths give the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCallDelta:
    """A piece of one tool call.

    Attributes:
        index: the call's position among this completion's calls (0, 1, ...).
        name: the function name, set on the call's first delta only.
        arguments: the next piece of the arguments' JSON text.
    """

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one piece of generated text adds to the answer.

    Attributes:
        content: text for the user.
        reasoning: the model's reasoning (thinking) text.
        tool_calls: pieces of tool calls, in order.
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        """Append `other`'s pieces to this delta."""
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ToolCall:
    """One whole tool call: the function name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole completion, parsed.

    Attributes:
        content: text for the user.
        reasoning: the reasoning text ("" when the model did not think).
        tool_calls: the tool calls in order.
    """

    content: str
    reasoning: str
    tool_calls: list[ToolCall]


class OutputParser(Protocol):
    """Turns a stream of generated text into content, reasoning and tool-call deltas."""

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of generated text; return what can be decided now."""
        ...

    def finish(self) -> ParsedDelta:
        """The end of generation: return everything still held back."""
        ...

    def tool_call_prefix(self, name: str | None) -> str | None:
        """Text that, appended to the prompt, starts a tool call (of function `name`, if given); None when
        this model or prompt cannot be made to call a tool that way. Called before any `feed`."""
        ...

    def reasoning_grammar(self, optional: bool = True) -> str:
        """A Lark expression (llguidance's dialect) for the reasoning this output may start with, "" for none:
        a constrained output (`freetoken.engine.structured.json_grammar`) lets the model think first. Without
        `optional`, only the reasoning the output must have (the rest of a block the prompt opened). Called
        before any `feed`."""
        ...

    def tool_calls_grammar(self, tools: list[dict[str, Any]]) -> str:
        """A Lark expression for one or more calls of `tools` (chat template format, each with its parameters'
        schema) in this family's markup, "" when it has none: a constrained output may be tool calls instead
        of the answer, their arguments matching the tools' schemas."""
        ...

    def reasoning_tags(self) -> tuple[str, str] | None:
        """(open, close) of the reasoning block this output may start with (open "" when the prompt opened it),
        None when it cannot have one: stop strings skip it (`SamplingParams.reasoning_tags`). Called before any
        `feed`."""
        ...


@dataclass(frozen=True)
class ParserOptions:
    """What a parser needs to know about the request.

    Attributes:
        prompt_text: the rendered prompt (a template may open the reasoning block in it).
        parse_tools: tools were offered, so tool calls are parsed; otherwise their markup is content.
        tools: the offered tools (chat template format, each with its parameters' schema) when parsed, else None:
            a family whose calls write arguments as text types them by it.
    """

    prompt_text: str
    parse_tools: bool
    tools: list[dict[str, Any]] | None = None


class PlainTextParser:
    """The parser of a model without known markup: everything is content."""

    def __init__(self, options: ParserOptions) -> None:
        del options

    def feed(self, text: str) -> ParsedDelta:
        """All of `text` is content."""
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        """Nothing is held back."""
        return ParsedDelta()

    def tool_call_prefix(self, name: str | None) -> None:
        """No markup for tool calls is known."""
        del name

    def reasoning_grammar(self, optional: bool = True) -> str:
        """No markup for reasoning is known."""
        del optional
        return ""

    def tool_calls_grammar(self, tools: list[dict[str, Any]]) -> str:
        """No markup for tool calls is known."""
        del tools
        return ""

    def reasoning_tags(self) -> None:
        """No markup for reasoning is known."""


@dataclass(frozen=True)
class ParserFamily:
    """A registered model family.

    Attributes:
        name: the family's name (for logs).
        matches: true for a tokenizer of this family.
        create: a new parser for one request.
    """

    name: str
    matches: Callable[[Any], bool]
    create: Callable[[ParserOptions], OutputParser]


_FAMILIES: list[ParserFamily] = []


def register(family: ParserFamily, first: bool = False) -> None:
    """Add a family; families are tried in registration order, those registered `first` before the others (a
    variant of a family, with a narrower test, goes before it)."""
    if first:
        _FAMILIES.insert(0, family)
    else:
        _FAMILIES.append(family)


def parser_for(tokenizer: Any, options: ParserOptions) -> OutputParser:
    """A parser for the model of `tokenizer` (the first family that matches), else `PlainTextParser`."""
    for family in _FAMILIES:
        if family.matches(tokenizer):
            return family.create(options)
    return PlainTextParser(options)


def parse_text(parser: OutputParser, text: str, before: ParsedDelta | None = None) -> ParsedOutput:
    """Run `parser` over a whole completion; `before` is what it parsed earlier (a forced prefix)."""
    return collect_deltas([before or ParsedDelta(), parser.feed(text), parser.finish()])


def collect_deltas(deltas: list[ParsedDelta]) -> ParsedOutput:
    """Join streamed deltas into the whole output."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                calls.append(ToolCall(piece.name or "", ""))
            calls[piece.index].arguments += piece.arguments
    return ParsedOutput("".join(content), "".join(reasoning), calls)


from freetoken.server.parsers import qwen3, qwen3_xml  # noqa: E402 (after the base classes the family modules import)

__all__ = [
    "OutputParser",
    "ParsedDelta",
    "ParsedOutput",
    "ParserFamily",
    "ParserOptions",
    "PlainTextParser",
    "ToolCall",
    "ToolCallDelta",
    "collect_deltas",
    "parse_text",
    "parser_for",
    "qwen3",
    "qwen3_xml",
    "register",
]
