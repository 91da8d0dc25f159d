"""Qwen3 output: ``<think>...</think>`` reasoning and ``<tool_call>`` JSON tool calls.

What the model writes (Qwen3 chat template)::

    <think>
    reasoning
    </think>

    content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

- Reasoning: ``<think>`` opens it only at the very start of the output; when the rendered prompt
  already ends inside an open ``<think>`` (thinking templates, e.g. Qwen3-2507 Thinking), the output
  starts in reasoning. With ``enable_thinking=False`` the template closes an empty block in the prompt,
  so the output is content.
- Tool calls (only when tools were offered): several per turn, text allowed before them. Once a call's
  header ``{"name": "...", "arguments": {`` is complete, the call starts (its name is sent) and the
  arguments' JSON text streams as it arrives, holding back a trailing run of ``}`` and whitespace (it
  may close the outer object). A block whose JSON is malformed, or that lacks a name, becomes content
  when it closes, tags included; a call already started keeps the arguments text the model wrote.
- Whitespace next to tags (the newlines the template puts around them) is dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from freetoken.engine.structured import json_expression
from freetoken.server.parsers import (
    ParsedDelta,
    ParserFamily,
    ParserOptions,
    ToolCallDelta,
    register,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

# A call's header, up to (not including) the "{" that opens its arguments.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')

_REASONING, _CONTENT, _TOOL, _START = "reasoning", "content", "tool", "start"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def _raw_arguments(body: str, args_start: int) -> str:
    """The arguments' JSON text of a call body whose arguments begin at `args_start`: the rest, without
    the outer object's closing brace and the whitespace around it."""
    raw = body[args_start:].rstrip()
    if raw.endswith("}"):
        raw = raw[:-1].rstrip()
    return raw


def _arguments_text(body: str, arguments: Any) -> str:
    """The arguments of a well-formed call as JSON text: as the model wrote them when that text is
    exactly the arguments object (so streamed and whole parses agree), else re-encoded."""
    if isinstance(arguments, str):
        return arguments
    header = _HEADER.match(body)
    if header is not None:
        raw = _raw_arguments(body, header.end())
        try:
            if json.loads(raw) == arguments:
                return raw
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


class _Segment:
    """One run of content or reasoning text between tags: drops leading whitespace when asked, and holds
    trailing whitespace back until more text follows (a tag after it drops it)."""

    def __init__(self, strip_leading: bool) -> None:
        self._strip_leading = strip_leading
        self._held = ""

    def push(self, text: str) -> str:
        """Add text; return what can be sent."""
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self._strip_leading = False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body

    def flush(self) -> str:
        """The held-back whitespace, at the end of the output."""
        held, self._held = self._held, ""
        return held


class Qwen3Parser:
    """Incremental parser of Qwen3 output (see the module docstring)."""

    def __init__(self, options: ParserOptions) -> None:
        self._parse_tools = options.parse_tools
        self._buf = ""
        if _opens_reasoning(options.prompt_text):
            self._mode = _REASONING
            self._segment = _Segment(strip_leading=True)
        else:
            self._mode = _START
            self._segment = _Segment(strip_leading=False)
        # The template closed an (empty) reasoning block at the end of the prompt: thinking is off for this turn.
        self._thinking_off = options.prompt_text.rstrip().endswith(THINK_CLOSE)
        self._num_calls = 0
        self._call_started = False  # the current call's name has been sent
        self._args_start = 0  # where the current call's arguments begin in `_buf`
        self._args_sent = ""

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of generated text."""
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """Flush: an unclosed reasoning block stays reasoning, an unclosed call that has started gets the
        rest of its arguments, any other unclosed markup becomes content."""
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._mode == _TOOL:
            if self._call_started:
                self._send_arguments(out, _raw_arguments(self._buf, self._args_start))
            else:
                self._emit(out, TOOL_OPEN + self._buf)
            self._buf = ""
        tail = self._segment.flush()
        if self._mode == _REASONING:
            out.reasoning += tail
        else:
            out.content += tail
        return out

    def tool_call_prefix(self, name: str | None) -> str | None:
        """``<tool_call>``, and for `name` the header up to the arguments' ``{`` (so the call starts at
        once); None inside a reasoning block the prompt opened."""
        if self._mode == _REASONING:
            return None
        if name is None:
            return TOOL_OPEN + "\n"
        return f'{TOOL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {{'

    def reasoning_grammar(self) -> str:
        """The rest of the reasoning block the prompt opened, or an optional whole one; then at most a few
        blank characters (Qwen3 writes two newlines after ``</think>``; a bound, so they cannot loop). Nothing
        when the prompt closed the block (``enable_thinking=False``)."""
        body = f"/(?s:.*)/ {THINK_CLOSE} /[ \\n]{{0,4}}/"
        if self._mode == _REASONING:
            return body
        if self._thinking_off:
            return ""
        return f"({THINK_OPEN} {body})?"

    def tool_calls_grammar(self, tools: list[dict[str, Any]]) -> str:
        """Calls as the template shows them, one ``<tool_call>`` block each: a newline, the call's JSON (the
        name one of `tools`, the arguments its parameters' schema), a newline, the closing tag."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": tool["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        call = f'{TOOL_OPEN} "\\n" {json_expression({"anyOf": calls})} "\\n" {TOOL_CLOSE}'
        return f'({call} /\\n?/)+'

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._mode == _REASONING:
            out.reasoning += self._segment.push(text)
        else:
            out.content += self._segment.push(text)

    def _switch(self, mode: str, *, strip_leading: bool = True) -> None:
        """Enter `mode`; whitespace held back before the tag is dropped."""
        self._mode = mode
        self._segment = _Segment(strip_leading=strip_leading)

    def _step(self, out: ParsedDelta, *, final: bool) -> bool:
        """Process `_buf` in the current mode; return True when the mode changed (process again)."""
        if self._mode == _START:
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN):]
                self._switch(_REASONING)
                return True
            if THINK_OPEN.startswith(head) and not final:
                return False  # may still become <think>
            self._mode = _CONTENT
            return True
        if self._mode == _REASONING:
            return self._until(out, THINK_CLOSE, _CONTENT, final)
        if self._mode == _CONTENT:
            if not self._parse_tools:
                self._emit(out, self._buf)
                self._buf = ""
                return False
            return self._until(out, TOOL_OPEN, _TOOL, final)
        return self._tool_step(out, final)

    def _until(self, out: ParsedDelta, tag: str, next_mode: str, final: bool) -> bool:
        """Send text up to `tag` and enter `next_mode`; without the tag, send all but a partial tag."""
        end = self._buf.find(tag)
        if end >= 0:
            self._emit(out, self._buf[:end])
            self._buf = self._buf[end + len(tag):]
            self._switch(next_mode)
            if next_mode == _TOOL:
                self._call_started, self._args_sent = False, ""
            return True
        keep = 0 if final else _partial_tag(self._buf, tag)
        self._emit(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _send_arguments(self, out: ParsedDelta, arguments: str) -> None:
        """Send what `arguments` adds to the arguments sent so far."""
        if arguments.startswith(self._args_sent) and len(arguments) > len(self._args_sent):
            out.tool_calls.append(ToolCallDelta(self._num_calls - 1, arguments=arguments[len(self._args_sent):]))
            self._args_sent = arguments

    def _tool_step(self, out: ParsedDelta, final: bool) -> bool:
        end = self._buf.find(TOOL_CLOSE)
        if end < 0:
            if final:
                return False
            visible = self._buf[: len(self._buf) - _partial_tag(self._buf, TOOL_CLOSE)]
            if not self._call_started:
                header = _HEADER.match(visible)
                if header is None:
                    return False
                try:
                    name = json.loads(f'"{header.group(1)}"')
                except json.JSONDecodeError:
                    return False
                self._call_started, self._args_start = True, header.end()
                out.tool_calls.append(ToolCallDelta(self._num_calls, name=name))
                self._num_calls += 1
            self._send_arguments(out, visible[self._args_start:].rstrip("} \t\r\n"))
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CLOSE):]
        if self._call_started:
            self._send_arguments(out, _raw_arguments(body, self._args_start))
        else:
            call = _parse_call(body)
            if call is None:
                self._switch(_CONTENT, strip_leading=False)
                self._emit(out, TOOL_OPEN + body + TOOL_CLOSE)
                return True
            out.tool_calls.append(ToolCallDelta(self._num_calls, name=call[0], arguments=call[1]))
            self._num_calls += 1
        self._switch(_CONTENT)
        return True


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a whole call body, or None when it is not a well-formed call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict | str):
        return None
    return name, _arguments_text(body, arguments)


def _is_qwen3(tokenizer: Any) -> bool:
    """Qwen3 tokenizers have single tokens for the reasoning and tool-call tags."""
    return all(tokenizer.token_to_id(tag) is not None for tag in (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE))


register(ParserFamily(name="qwen3", matches=_is_qwen3, create=Qwen3Parser))
