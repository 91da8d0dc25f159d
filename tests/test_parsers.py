"""Model output parsers, driven directly with realistic model text (the demo model's output is random).

Every input is parsed whole, cut in two at every split point, and fed one character at a time: the
streamed deltas must join to the whole parse, and no content delta may carry part of a tag.
"""

from __future__ import annotations

import json

import pytest
from freetoken.server.parsers import (
    ParsedOutput,
    ParserOptions,
    PlainTextParser,
    ToolCall,
    collect_deltas,
    parse_text,
    parser_for,
)
from freetoken.server.parsers.qwen3 import Qwen3Parser

PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
PROMPT_OPEN = PROMPT + "<think>\n"
PROMPT_NO_THINK = PROMPT + "<think>\n\n</think>\n\n"

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
NESTED = (
    '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py", "edits": [{"old": "x = {}", '
    '"new": "x = {\\"k\\": 1}"}], "opts": {"dry": false}}}\n</tool_call>'
)

# (prompt, parse_tools, model text, expected)
CASES = [
    (PROMPT, True, "Hello there, how can I help?", ParsedOutput("Hello there, how can I help?", "", [])),
    (PROMPT, True, "<think>\nThe user greets.\n</think>\n\nHello!", ParsedOutput("Hello!", "The user greets.", [])),
    (PROMPT_OPEN, True, "Let me think: 2 < 3.\n</think>\n\nYes.", ParsedOutput("Yes.", "Let me think: 2 < 3.", [])),
    (PROMPT_NO_THINK, True, "Plain answer with <b>html</b>.", ParsedOutput("Plain answer with <b>html</b>.", "", [])),
    (PROMPT, True, "<think>\n\n</think>\n\nShort.", ParsedOutput("Short.", "", [])),
    (PROMPT, True, WEATHER, ParsedOutput("", "", [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    (
        PROMPT,
        True,
        "<think>\nNeed the weather.\n</think>\n\nChecking.\n" + WEATHER + "\n" + NESTED,
        ParsedOutput(
            "Checking.",
            "Need the weather.",
            [
                ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ToolCall(
                    "edit_file",
                    '{"path": "a.py", "edits": [{"old": "x = {}", "new": "x = {\\"k\\": 1}"}], "opts": {"dry": false}}',
                ),
            ],
        ),
    ),
    (
        PROMPT_OPEN,
        True,
        "Call it.\n</think>\n\n" + '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>',
        ParsedOutput("", "Call it.", [ToolCall("ls", "{}")]),
    ),
    # arguments written before the name, or as a string: parsed when the block closes
    (
        PROMPT,
        True,
        '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
        ParsedOutput("", "", [ToolCall("search", '{"q": "x"}')]),
    ),
    (
        PROMPT,
        True,
        '<tool_call>\n{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>',
        ParsedOutput("", "", [ToolCall("run", '{"cmd": "ls"}')]),
    ),
    # malformed: becomes text, tags included
    (
        PROMPT,
        True,
        "Oops <tool_call>\nnot json at all\n</tool_call> done",
        ParsedOutput("Oops<tool_call>\nnot json at all\n</tool_call> done", "", []),
    ),
    (
        PROMPT,
        True,
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        ParsedOutput('<tool_call>\n{"arguments": {}}\n</tool_call>', "", []),
    ),
    # truncated (max_tokens) before the header completes: text
    (PROMPT, True, '<tool_call>\n{"name": "get_w', ParsedOutput('<tool_call>\n{"name": "get_w', "", [])),
    # tools not offered: the markup is content
    (PROMPT, False, "A " + WEATHER, ParsedOutput("A " + WEATHER, "", [])),
    # unclosed reasoning stays reasoning
    (PROMPT, True, "<think>\nStill thinking", ParsedOutput("", "Still thinking", [])),
    (PROMPT, True, "Ends with space ", ParsedOutput("Ends with space ", "", [])),
    (PROMPT, True, "Text mentioning </think> and <think> later", ParsedOutput(
        "Text mentioning </think> and <think> later", "", [])),
    (PROMPT, True, "héllo wörld 🙂 <tool", ParsedOutput("héllo wörld 🙂 <tool", "", [])),
]


def _parser(prompt: str, parse_tools: bool) -> Qwen3Parser:
    return Qwen3Parser(ParserOptions(prompt_text=prompt, parse_tools=parse_tools))


def _stream(prompt: str, parse_tools: bool, pieces: list[str]) -> ParsedOutput:
    parser = _parser(prompt, parse_tools)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return collect_deltas(deltas), deltas


def _no_partial_tags(deltas, expected: ParsedOutput) -> None:
    if "<" not in expected.content:
        assert all("<" not in d.content for d in deltas)
    if "<" not in expected.reasoning:
        assert all("<" not in d.reasoning for d in deltas)


@pytest.mark.parametrize(("prompt", "parse_tools", "text", "expected"), CASES)
def test_whole_and_every_split(prompt, parse_tools, text, expected):
    assert parse_text(_parser(prompt, parse_tools), text) == expected
    for cut in range(len(text) + 1):
        got, deltas = _stream(prompt, parse_tools, [text[:cut], text[cut:]])
        assert got == expected, cut
        _no_partial_tags(deltas, expected)
    got, deltas = _stream(prompt, parse_tools, list(text))
    assert got == expected
    _no_partial_tags(deltas, expected)


def test_arguments_stream_incrementally():
    parser = _parser(PROMPT, True)
    pieces = ["<tool_call>", '\n{"name": "get_weather", "arguments": {', '"city": "Pa', 'ris"', "}}", "\n</tool_call>"]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].index == 0 and calls[0].name == "get_weather" and calls[0].arguments == ""
    streamed = [c.arguments for c in calls[1:]]
    assert len(streamed) >= 3  # arguments arrive in several pieces, before the block closes
    assert all(c.name is None for c in calls[1:])
    assert json.loads("".join(streamed)) == {"city": "Paris"}


def test_second_call_gets_next_index():
    parser = _parser(PROMPT, True)
    delta = parser.feed(WEATHER + "\n" + WEATHER)
    delta.extend(parser.finish())
    assert [c.index for c in delta.tool_calls] == [0, 1]


def test_malformed_arguments_after_header_never_raise():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1,,}\n</tool_call> tail'
    whole = parse_text(_parser(PROMPT, True), text)
    assert whole == ParsedOutput(text, "", [])  # seen whole, the block is checked before a call starts
    for cut in range(len(text) + 1):
        got, _ = _stream(PROMPT, True, [text[:cut], text[cut:]])
        # a call already started when the block turns out malformed keeps the arguments text the model wrote
        assert got == whole or (got.tool_calls[0].name == "f" and got.content == "tail")


def test_registry_picks_by_tokenizer(demo_tokenizer):
    options = ParserOptions(prompt_text="", parse_tools=True)
    assert isinstance(parser_for(demo_tokenizer, options), Qwen3Parser)

    class NoTags:
        def token_to_id(self, token):
            return None

    assert isinstance(parser_for(NoTags(), options), PlainTextParser)


def test_real_template_prompts(demo_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    thinking = demo_tokenizer.apply_chat_template(messages)
    no_thinking = demo_tokenizer.apply_chat_template(messages, enable_thinking=False)
    out = parse_text(_parser(no_thinking, True), "Hi </think> there")
    assert out.reasoning == "" and out.content == "Hi </think> there"
    out = parse_text(_parser(thinking, True), "<think>\nr\n</think>\n\nc")
    assert (out.reasoning, out.content) == ("r", "c")


def test_tool_call_prefix_forces_a_call():
    parser = _parser(PROMPT, True)
    first = parser.feed(parser.tool_call_prefix("get_weather"))
    assert first.tool_calls[0].name == "get_weather"  # the call starts with the prefix
    out = parse_text(parser, '"city": "Paris"}}\n</tool_call>', first)
    assert out == ParsedOutput("", "", [ToolCall("get_weather", '{"city": "Paris"}')])
    parser = _parser(PROMPT, True)
    out = parse_text(parser, parser.tool_call_prefix(None) + '{"name": "ls", "arguments": {}}\n</tool_call>')
    assert out.tool_calls == [ToolCall("ls", "{}")]
    assert _parser(PROMPT_OPEN, True).tool_call_prefix(None) is None  # inside the prompt's open <think>


def test_random_markup_never_raises():
    """Random mixes of tags, tag fragments, JSON pieces and text: no exception at any split, and with tools
    off (reasoning only) streaming equals the whole parse."""
    import random

    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<tool", "think>", "\n", " ",
              '{"name": "f", "arguments": {', '"a": 1}', "}", "{", '"', "text", "é🙂", ",", "null"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for parse_tools in (True, False):
            whole = parse_text(_parser(PROMPT, parse_tools), text)
            cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            got, _ = _stream(PROMPT, parse_tools, chunks)
            if not parse_tools:
                assert got == whole, (text, chunks)
