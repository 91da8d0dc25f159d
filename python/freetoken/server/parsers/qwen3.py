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
- Tool calls (only when tools were offered): several per turn, text allowed before them. A block's end
  is found by following its JSON object (strings, escapes, nesting) to the brace that closes it, never by
  looking for ``</tool_call>``: an argument may contain that text. Once a call's header
  ``{"name": "...", "arguments": {`` is read, the call starts (its name is sent) and the arguments' JSON
  text streams as it arrives, up to the brace that closes the arguments. A block whose JSON breaks (a
  character JSON cannot have outside a string, such as ``<``) ends at the next ``</tool_call>``; a block
  that is not a call (malformed, no name, cut off by the end of the output) is dropped and logged, never
  sent as content; a call already started keeps the arguments text read so far. Fed whole or in pieces
  split anywhere, the parser gives the same result.
- Whitespace next to tags (the newlines the template puts around them) is dropped.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from freetoken.engine.structured import json_expression, rebase_refs
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

logger = logging.getLogger("freetoken.server")


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
        self._held = text[len(body) :]
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
        self._scan = _JsonScan()

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of generated text."""
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """Flush: an unclosed reasoning block stays reasoning, a call that has started keeps the arguments read,
        an unclosed tool-call block that is not a call is dropped."""
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
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

    def reasoning_grammar(self, optional: bool = True) -> str:
        """The rest of the reasoning block the prompt opened, or (with `optional`) an optional whole one; then at
        most a few blank characters (Qwen3 writes two newlines after ``</think>``; a bound, so they cannot loop).
        Nothing when the prompt closed the block (``enable_thinking=False``)."""
        body = f"/(?s:.*)/ {THINK_CLOSE} /[ \\n]{{0,4}}/"
        if self._mode == _REASONING:
            return body
        if self._thinking_off or not optional:
            return ""
        return f"({THINK_OPEN} {body})?"

    def reasoning_tags(self) -> tuple[str, str] | None:
        """``("", "</think>")`` when the prompt opened the block, None when it closed one (thinking off), else
        ``("<think>", "</think>")``."""
        if self._mode == _REASONING:
            return "", THINK_CLOSE
        if self._thinking_off:
            return None
        return THINK_OPEN, THINK_CLOSE

    def tool_calls_grammar(self, tools: list[dict[str, Any]]) -> str:
        """Calls as the template shows them, one ``<tool_call>`` block each: a newline, the call's JSON (the
        name one of `tools`, the arguments its parameters' schema), a newline, the closing tag."""
        calls, defs = [], {}
        for i, tool in enumerate(tools):
            # The parameters' own references ("#/$defs/...") resolve against their root, now under "$defs".
            base = f"tool{i}"
            arguments, has_refs = rebase_refs(
                tool["function"].get("parameters") or {"type": "object"}, f"#/$defs/{base}"
            )
            if has_refs:
                defs[base] = arguments
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool["function"]["name"]}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"anyOf": calls, "$defs": defs} if defs else {"anyOf": calls}
        call = f'{TOOL_OPEN} "\\n" {json_expression(schema)} "\\n" {TOOL_CLOSE}'
        return f"({call} /\\n?/)+"

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
                self._buf = head[len(THINK_OPEN) :]
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
            self._buf = self._buf[end + len(tag) :]
            self._switch(next_mode)
            if next_mode == _TOOL:
                self._open_call()
            return True
        keep = 0 if final else _partial_tag(self._buf, tag)
        self._emit(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _send_arguments(self, out: ParsedDelta, arguments: str) -> None:
        """Send what `arguments` adds to the arguments sent so far (in the call's delta of `out`, if it has one)."""
        if arguments.startswith(self._args_sent) and len(arguments) > len(self._args_sent):
            more, index = arguments[len(self._args_sent) :], self._num_calls - 1
            if out.tool_calls and out.tool_calls[-1].index == index:
                out.tool_calls[-1].arguments += more
            else:
                out.tool_calls.append(ToolCallDelta(index, arguments=more))
            self._args_sent = arguments

    def _open_call(self) -> None:
        """A ``<tool_call>`` tag was read: its block starts at `_buf`'s start."""
        self._call_started, self._args_sent = False, ""
        self._scan = _JsonScan()

    def _arguments_so_far(self) -> str:
        """The started call's arguments text as far as it is decided: to the arguments object's closing brace
        once read, else to the scan's end (or the text that broke the JSON) less trailing whitespace (more text
        may follow it)."""
        scan = self._scan
        if scan.args_end is not None:
            return self._buf[self._args_start : scan.args_end]
        return self._buf[self._args_start : scan.pos].rstrip()

    def _tool_step(self, out: ParsedDelta, final: bool) -> bool:
        """Inside a ``<tool_call>`` block: follow its JSON object to the brace that closes it (so a
        ``</tool_call>`` inside a string is just text), starting the call once its header is read and streaming
        its arguments. The block ends after the object at ``</tool_call>``, at other text (which is content), or
        at the end of the output. A block whose JSON breaks (a character JSON cannot have outside a string) ends
        at the next ``</tool_call>``; a block that is not a call is dropped and logged, never sent as text."""
        scan = self._scan
        if not self._call_started:
            header = _HEADER.match(self._buf)
            if header is not None and (scan.broken is None or header.end() < scan.broken):
                try:
                    name = json.loads(f'"{header.group(1)}"')
                except json.JSONDecodeError:
                    name = None
                if name:
                    self._call_started, self._args_start = True, header.end()
                    out.tool_calls.append(ToolCallDelta(self._num_calls, name=name))
                    self._num_calls += 1
        scan.advance(self._buf)
        if self._call_started:
            self._send_arguments(out, self._arguments_so_far())
        if scan.broken is not None:
            end = self._buf.find(TOOL_CLOSE, scan.broken)
            if end < 0 and not final:
                return False
            rest = "" if end < 0 else self._buf[end + len(TOOL_CLOSE) :]
            self._drop_block("its JSON is malformed", self._buf[: end if end >= 0 else len(self._buf)])
            self._buf = rest
            self._switch(_CONTENT, strip_leading=self._call_started)
            return True
        if scan.end is None:
            if final:
                self._drop_block("the output ended inside it", self._buf)
                self._buf = ""
                self._switch(_CONTENT, strip_leading=self._call_started)
            return False
        after = self._buf[scan.end :]
        tail = after.lstrip()
        if TOOL_CLOSE.startswith(tail) and len(tail) < len(TOOL_CLOSE) and not final:
            return False  # the closing tag may still come
        body = self._buf[: scan.end]
        if not self._call_started:
            call = _parse_call(body)
            if call is None:
                self._drop_block("it is not a call with a name", body)
                self._buf = tail[len(TOOL_CLOSE) :] if tail.startswith(TOOL_CLOSE) else tail
                self._switch(_CONTENT, strip_leading=False)
                return True
            out.tool_calls.append(ToolCallDelta(self._num_calls, name=call[0], arguments=call[1]))
            self._num_calls += 1
        self._buf = tail[len(TOOL_CLOSE) :] if tail.startswith(TOOL_CLOSE) else tail
        self._switch(_CONTENT)
        return True

    def _drop_block(self, why: str, body: str) -> None:
        if self._call_started:
            logger.warning("tool call %d: %s; kept with the arguments read so far", self._num_calls - 1, why)
        else:
            logger.warning("dropped a tool-call block of the model's output (%s): %.200r", why, body)


class _JsonScan:
    """Follows one JSON object through a growing text, outside and inside strings, without parsing values.

    Attributes:
        pos: how far the text has been read.
        end: the index after the brace that closes the object, once read.
        args_end: the index after the first value that closes at depth 1 again (a call's arguments object).
        broken: where the text stopped being a JSON object (a character JSON cannot have there), if it did.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.end: int | None = None
        self.args_end: int | None = None
        self.broken: int | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False

    def advance(self, text: str) -> None:
        """Read `text` (the same text as before, possibly longer) from `pos` on."""
        i = self.pos
        while i < len(text) and self.end is None and self.broken is None:
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif self._depth == 0:
                if c == "{":
                    self._depth = 1
                elif not c.isspace():
                    self.broken = i
                    break
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self.args_end is None:
                    self.args_end = i + 1
                if self._depth == 0:
                    self.end = i + 1
            elif c not in _JSON_OUTSIDE_STRINGS:
                self.broken = i
                break
            i += 1
        self.pos = i


# What a JSON text may hold outside its strings besides brackets and quotes: separators, numbers, literals.
_JSON_OUTSIDE_STRINGS = frozenset(" \t\r\n,:-+.0123456789eEtrufalsn")


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
