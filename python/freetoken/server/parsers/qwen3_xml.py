"""Qwen3.5 / Qwen3-Coder output: ``<think>`` reasoning (as Qwen3) and tool calls in XML form.

What the model writes (the chat template's own instructions and the form it renders past calls in)::

    content<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

- Chosen over the JSON form of `freetoken.server.parsers.qwen3` when the model's chat template writes calls this way
  (it contains ``<function=``); a ``<tool_call>`` block that starts with ``{`` is still read as a JSON call.
- A parameter's value is the text between ``<parameter=NAME>`` and the next ``</parameter>`` less the one newline
  the template puts on each side. It becomes a JSON value by the offered tool's schema for that parameter: strings
  stay text; integer, number, boolean, null, object and array values are read as JSON (Python's ``True``/
  ``False``/``None`` too), the schema's types tried in its order (``null`` first where it is one); a value that
  does not read as its type, and a parameter the schema does not name, stay text (the model's words are never
  lost).
- Streaming: the call's name is sent at ``<function=NAME>``; its arguments' JSON text grows by one
  ``"name": value`` pair per parameter once the parameter closes (its type can only be decided on the whole value),
  and the closing brace at ``</function>``. The pieces join to ``json.dumps`` of the arguments, whole or streamed.
- A block that is neither form is dropped and logged (never content); a call cut off by the end of the output keeps
  the parameters that closed; a missing ``</function>`` before ``</tool_call>`` closes the call there.
- Forced calls (`tool_calls_grammar`): the form exactly as the template renders it, the offered tools' parameters in
  their schema's order (required ones present, no others), each value text with no ``</parameter>`` in it where the
  schema allows a string, else JSON matching the parameter's schema (what `convert_parameter` reads back).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from freetoken.engine.structured import json_expression, rebase_refs
from freetoken.server.parsers import (
    ParsedDelta,
    ParserFamily,
    ParserOptions,
    ToolCallDelta,
    register,
)
from freetoken.server.parsers.qwen3 import (
    _CONTENT,
    TOOL_CLOSE,
    TOOL_OPEN,
    Qwen3Parser,
    _is_qwen3,
)

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# Python literals a model trained on Python tools may write for JSON's.
_PY_LITERALS = {"True": True, "False": False, "None": None}

logger = logging.getLogger("freetoken.server")


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (its `type`, or those of its anyOf/oneOf branches), in order."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [t for branch in schema.get("anyOf") or schema.get("oneOf") or [] for t in _types(branch)]


def convert_parameter(text: str, schema: Any) -> Any:
    """A parameter's value text as the JSON value its schema's type asks for; the text itself where the schema says
    string, names no type, or the text does not read as any type it allows (see the module docstring)."""
    types = _types(schema)
    if "null" in types and text.strip() in ("null", "None"):  # before "string": an optional string left out
        return None
    for kind in types:
        if kind == "string":
            return text
        value = text.strip()
        try:
            parsed = _PY_LITERALS[value] if value in _PY_LITERALS else json.loads(value)
        except (json.JSONDecodeError, ValueError):
            continue
        fits = {
            "integer": (isinstance(parsed, int) and not isinstance(parsed, bool))
            or (isinstance(parsed, float) and parsed.is_integer()),
            "number": isinstance(parsed, int | float) and not isinstance(parsed, bool),
            "boolean": isinstance(parsed, bool),
            "null": parsed is None,
            "object": isinstance(parsed, dict),
            "array": isinstance(parsed, list),
        }.get(kind, False)
        if fits:
            return int(parsed) if kind == "integer" and isinstance(parsed, int | float) else parsed
    return text


# A string parameter's value and its closing line, as one lexeme: any text ending in the template's closing line,
# with no other `</parameter>` in it (the parser ends a value at the first one).
_TEXT_VALUE = "TEXT_VALUE: /(?s:.*)\\n<\\/parameter>\\n/ & ~/(?s:.*)<\\/parameter>(?s:.*)<\\/parameter>(?s:.*)/"
_LITERALS = {"boolean": ("true", "false", "True", "False"), "null": ("null", "None")}
_VALUE_END = json.dumps("\n" + PARAMETER_CLOSE + "\n")


def _value_grammar(schema: Any, root: dict[str, Any] | None = None) -> str:
    """A Lark expression for one parameter's value and its closing line (see `tool_calls_grammar`): one of the
    strings of an enum/const of strings, free text where the schema allows a string or names no type, a boolean or
    null in JSON's or Python's spelling (the template writes values with Jinja's `string`, so ``False``), else JSON
    matching the schema, whose references (``#/$defs/...``) resolve against `root` (the tool's parameters)."""
    if not isinstance(schema, dict):
        return "TEXT_VALUE"
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    types = _types(schema)
    if choices and all(isinstance(c, str) for c in choices) and types in ([], ["string"]):
        return "(" + " | ".join(json.dumps(f"{c}\n{PARAMETER_CLOSE}\n") for c in choices) + ")"
    if not types or "string" in types:
        return "TEXT_VALUE"
    if set(types) <= {"boolean", "null"}:  # as JSON or as the template renders them (Python's `str`)
        words = [w for t in types for w in _LITERALS[t]]
        return "(" + " | ".join(json.dumps(f"{w}\n{PARAMETER_CLOSE}\n") for w in words) + ")"
    rebased, has_refs = rebase_refs(schema, "#/$defs/__tool")
    if has_refs and root is not None:
        own = rebased.get("$defs")
        rebased["$defs"] = {**(own if isinstance(own, dict) else {}), "__tool": rebase_refs(root, "#/$defs/__tool")[0]}
        return f"{json_expression(rebased)} {_VALUE_END}"
    return f"{json_expression(schema)} {_VALUE_END}"


def _value_text(raw: str) -> str:
    """A parameter's text without the newline the template writes after ``<parameter=NAME>`` and before
    ``</parameter>``."""
    raw = raw.removeprefix("\n")
    raw = raw.removesuffix("\n")
    return raw


def _undecided(text: str, *tags: str) -> bool:
    """True when `text` is a proper prefix of one of `tags` (more text may complete it)."""
    return any(tag.startswith(text) and len(text) < len(tag) for tag in tags)


class Qwen3XmlParser(Qwen3Parser):
    """Incremental parser of Qwen3.5 / Qwen3-Coder output (see the module docstring); reasoning and content as
    `Qwen3Parser`, whose JSON calls it also reads."""

    def __init__(self, options: ParserOptions) -> None:
        super().__init__(options)
        self._schemas: dict[str, dict[str, Any]] = {}
        for tool in options.tools or []:
            function = tool.get("function") or {}
            if isinstance(function.get("name"), str):
                properties = (function.get("parameters") or {}).get("properties")
                self._schemas[function["name"]] = properties if isinstance(properties, dict) else {}
        self._open_call()

    def tool_call_prefix(self, name: str | None) -> str | None:
        """``<tool_call>``, and for `name` the ``<function=NAME>`` line; None inside a reasoning block the prompt
        opened."""
        prefix = super().tool_call_prefix(None)
        if prefix is None or name is None:
            return prefix
        return f"{prefix}{FUNCTION_OPEN}{name}>\n"

    def tool_calls_grammar(self, tools: list[dict[str, Any]]) -> str:
        """One or more calls of `tools` as the template renders them (a nested Lark grammar: llguidance's
        ``%lark``)::

            <tool_call>
            <function=NAME>
            <parameter=ARG>
            VALUE
            </parameter>
            </function>
            </tool_call>

        Parameters in the order of the tool's ``properties``, the ``required`` ones present, no others (any
        names when a tool declares no properties and does not forbid more); values as `_value_grammar`."""
        rules, calls = [_TEXT_VALUE], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = function.get("parameters")
            schema = schema if isinstance(schema, dict) else {}
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = set(schema.get("required") or [])
            params = []
            for j, (name, prop) in enumerate(properties.items()):
                rules.append(
                    f"p{i}_{j}: {json.dumps(f'{PARAMETER_OPEN}{name}>' + chr(10))} {_value_grammar(prop, schema)}"
                )
                params.append(f"p{i}_{j}" if name in required else f"p{i}_{j}?")
            if not properties and schema.get("additionalProperties") is not False:
                rules.append(f'p{i}_any: {json.dumps(PARAMETER_OPEN)} /[^>\\n]+/ ">\\n" TEXT_VALUE')
                params.append(f"p{i}_any*")
            head = json.dumps(f"\n{FUNCTION_OPEN}{function['name']}>\n")
            rules.append(
                f"call{i}: {TOOL_OPEN} {head} {' '.join(params)} {json.dumps(FUNCTION_CLOSE + chr(10))} {TOOL_CLOSE}"
            )
            calls.append(f"call{i}")
        rules.insert(0, f"start: (({' | '.join(calls)}) /\\n?/)+")
        return "%lark {\n" + "\n".join(rules) + "\n}"

    def _open_call(self) -> None:
        super()._open_call()
        self._form: str | None = None  # "json" or "xml", once the block's first character decides it
        self._function: str | None = None  # the XML call's name, once read
        self._num_params = 0
        self._closed = False  # the XML call's arguments object is closed

    def _tool_step(self, out: ParsedDelta, final: bool) -> bool:
        if self._form is None:
            head = self._buf.lstrip()
            if head.startswith("{"):
                self._form = "json"
            elif head.startswith(FUNCTION_OPEN):
                self._form = "xml"
            elif (not head or _undecided(head, FUNCTION_OPEN)) and not final:
                return False  # the block's first characters are still to come
            elif not head:
                self._drop("the output ended inside it", head)
                self._buf = ""
                self._switch(_CONTENT)
                return False
            else:
                return self._skip_block(out, "it is neither a JSON nor an XML call", final)
        if self._form == "json":
            return super()._tool_step(out, final)
        return self._xml_step(out, final)

    def _xml_step(self, out: ParsedDelta, final: bool) -> bool:
        """Read the XML call in `_buf` as far as it is decided; True when the block ended (content follows)."""
        while True:
            head = self._buf.lstrip()
            if self._function is None:
                end = head.find(">")
                if end < 0:
                    if final:
                        self._drop("the output ended inside it", head)
                        self._buf = ""
                        self._switch(_CONTENT)
                    return False
                name = head[len(FUNCTION_OPEN) : end].strip()
                if not name or "\n" in name:
                    return self._skip_block(out, "its <function=...> tag has no name", final)
                self._function = name
                out.tool_calls.append(ToolCallDelta(self._num_calls, name=name))
                self._num_calls += 1
                self._buf = head[end + 1 :]
                continue
            if self._closed:
                if head.startswith(TOOL_CLOSE):
                    self._buf = head[len(TOOL_CLOSE) :]
                elif _undecided(head, TOOL_CLOSE) and not final:
                    return False
                else:  # no closing tag: the text after the call is content
                    self._buf = head
                self._switch(_CONTENT)
                return True
            if head.startswith(PARAMETER_OPEN):
                name_end = head.find(">")
                value_end = head.find(PARAMETER_CLOSE, name_end + 1) if name_end >= 0 else -1
                if value_end < 0:
                    if final:
                        self._close_call(out, "the output ended inside a parameter")
                        self._buf = ""
                        return True
                    return False
                name = head[len(PARAMETER_OPEN) : name_end].strip()
                value = _value_text(head[name_end + 1 : value_end])
                self._add_parameter(out, name, value)
                self._buf = head[value_end + len(PARAMETER_CLOSE) :]
                continue
            if head.startswith(FUNCTION_CLOSE):
                self._close_call(out, None)
                self._buf = head[len(FUNCTION_CLOSE) :]
                continue
            if head.startswith(TOOL_CLOSE):
                self._close_call(out, "</function> is missing")
                continue
            if _undecided(head, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CLOSE) and not final:
                return False
            if not head:
                if final:
                    self._close_call(out, "the output ended inside it")
                    return True
                return False
            self._close_call(out, f"unexpected text {head[:40]!r}")
            return self._skip_block(out, "it has text outside the call's tags", final)

    def _add_parameter(self, out: ParsedDelta, name: str, value: str) -> None:
        schema = self._schemas.get(self._function or "", {}).get(name)
        pair = [json.dumps(x, ensure_ascii=False) for x in (name, convert_parameter(value, schema))]
        self._send(out, ("{" if self._num_params == 0 else ", ") + ": ".join(pair))
        self._num_params += 1

    def _close_call(self, out: ParsedDelta, why: str | None) -> None:
        """Close the call's arguments object (`why` it closed early, logged, or None)."""
        if self._closed:
            return
        if why is not None:
            logger.warning("tool call %d: %s; kept with the parameters read", self._num_calls - 1, why)
        self._send(out, "}" if self._num_params else "{}")
        self._closed = True

    def _send(self, out: ParsedDelta, piece: str) -> None:
        index = self._num_calls - 1
        if out.tool_calls and out.tool_calls[-1].index == index:
            out.tool_calls[-1].arguments += piece
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=piece))

    def _skip_block(self, out: ParsedDelta, why: str, final: bool) -> bool:
        """Drop the rest of the block, to its ``</tool_call>`` (or the end of the output); True once dropped."""
        end = self._buf.find(TOOL_CLOSE)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        if self._function is None:
            self._drop(why, body)
        self._buf = "" if end < 0 else self._buf[end + len(TOOL_CLOSE) :]
        self._switch(_CONTENT)
        return True

    def _drop(self, why: str, body: str) -> None:
        logger.warning("dropped a tool-call block of the model's output (%s): %.200r", why, body)


def _writes_xml_calls(tokenizer: Any) -> bool:
    """Qwen3 tags, and a chat template that writes tool calls as ``<function=NAME>`` blocks."""
    return _is_qwen3(tokenizer) and FUNCTION_OPEN in (getattr(tokenizer, "chat_template_source", None) or "")


register(ParserFamily(name="qwen3-xml", matches=_writes_xml_calls, create=Qwen3XmlParser), first=True)
