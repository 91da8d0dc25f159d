"""Model output parsers, driven directly with realistic model text (the demo model's output is random).

Every input is parsed whole, cut in two at every split point, and fed one character at a time: the
streamed deltas must join to the whole parse, and no content delta may carry part of a tag.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    # malformed: dropped, never sent as markup
    (PROMPT, True, "Oops <tool_call>\nnot json at all\n</tool_call> done", ParsedOutput("Oops done", "", [])),
    (PROMPT, True, '<tool_call>\n{"arguments": {}}\n</tool_call>', ParsedOutput("", "", [])),
    # truncated (max_tokens) before the header completes: dropped
    (PROMPT, True, '<tool_call>\n{"name": "get_w', ParsedOutput("", "", [])),
    (PROMPT, True, "A <tool_call>\n", ParsedOutput("A", "", [])),
    # the closing tag inside an argument is text of the argument
    (
        PROMPT,
        True,
        '<tool_call>\n{"name": "write", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>\nDone.',
        ParsedOutput("Done.", "", [ToolCall("write", '{"text": "a </tool_call> b"}')]),
    ),
    (
        PROMPT,
        True,
        '<tool_call>\n{"arguments": {"text": "</tool_call>"}, "name": "write"}\n</tool_call>',
        ParsedOutput("", "", [ToolCall("write", '{"text": "</tool_call>"}')]),
    ),
    # no closing tag after the object: the call stands, what follows is content
    (
        PROMPT,
        True,
        '<tool_call>\n{"name": "ls", "arguments": {}}\nAnd more.',
        ParsedOutput("And more.", "", [ToolCall("ls", "{}")]),
    ),
    # tools not offered: the markup is content
    (PROMPT, False, "A " + WEATHER, ParsedOutput("A " + WEATHER, "", [])),
    # unclosed reasoning stays reasoning
    (PROMPT, True, "<think>\nStill thinking", ParsedOutput("", "Still thinking", [])),
    (PROMPT, True, "Ends with space ", ParsedOutput("Ends with space ", "", [])),
    (
        PROMPT,
        True,
        "Text mentioning </think> and <think> later",
        ParsedOutput("Text mentioning </think> and <think> later", "", []),
    ),
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
    assert calls[0].index == 0 and calls[0].name == "get_weather" and calls[0].arguments == "{"
    streamed = [c.arguments for c in calls]
    assert len(streamed) >= 3 and "}" in streamed[-1]  # arguments arrive in pieces, whole before the block closes
    assert all(not d.tool_calls for d in deltas[-2:])
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
    # a call started when the block turns out malformed keeps the arguments text the model wrote
    assert whole == ParsedOutput("tail", "", [ToolCall("f", '{"a": 1,,}')])
    for cut in range(len(text) + 1):
        got, _ = _stream(PROMPT, True, [text[:cut], text[cut:]])
        assert got == whole


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
    """Random mixes of tags, tag fragments, JSON pieces and text: no exception at any split, and streaming
    equals the whole parse."""
    import random

    pieces = [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<",
        "</",
        "<tool",
        "think>",
        "\n",
        " ",
        '{"name": "f", "arguments": {',
        '"a": 1}',
        "}",
        "{",
        '"',
        "text",
        "é🙂",
        ",",
        "null",
    ]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for parse_tools in (True, False):
            whole = parse_text(_parser(PROMPT, parse_tools), text)
            cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            got, _ = _stream(PROMPT, parse_tools, chunks)
            assert got == whole, (text, chunks)


# Text with what breaks naive tool-call parsing: tags, brackets, quotes, backslashes, non-ASCII.
_TRICKY_TEXT = st.lists(
    st.sampled_from(list('ab <>/{}[]":,\\\n') + ["</tool_call>", "<tool_call>", "</think>", "é", "🙂"]), max_size=8
).map("".join)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY_TEXT, inner, max_size=3),
    max_leaves=6,
)
_CALLS = st.lists(
    st.tuples(
        st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True),
        st.dictionaries(_TRICKY_TEXT, _JSON_VALUES, max_size=3),
        st.booleans(),  # arguments written before the name
        st.sampled_from([None, 2]),  # compact or indented JSON
    ),
    min_size=1,
    max_size=3,
)


def _call_text(name, arguments, arguments_first, indent):
    call = {"arguments": arguments, "name": name} if arguments_first else {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False, indent=indent)}\n</tool_call>"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=_CALLS,
    reasoning=st.sampled_from(["", "<think>\nI should call </tool_call> a tool.\n</think>\n\n"]),
    content=st.sampled_from(["", "Let me check.\n", "x < y and {z}\n"]),
    cut=st.floats(0.0, 1.0),
)
def test_generated_tool_calls_whole_equals_every_split(calls, reasoning, content, cut):
    """Generated tool-call texts (arguments full of tags, brackets, quotes and escapes): the whole parse has
    every call with its exact arguments; fed split at every position, the stream joins to the whole parse;
    cut short anywhere (max_tokens), whole and split parses still agree and no markup reaches the content."""
    text = reasoning + content + "\n".join(_call_text(*call) for call in calls)
    whole = parse_text(_parser(PROMPT, True), text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(n, a) for n, a, _, _ in calls]
    assert whole.content == content.strip()
    for position in range(len(text) + 1):
        got, _ = _stream(PROMPT, True, [text[:position], text[position:]])
        assert got == whole, position
    truncated = text[: int(cut * len(text))]
    whole = parse_text(_parser(PROMPT, True), truncated)
    assert "<tool_call>" not in whole.content and "</tool_call>" not in whole.content
    for position in range(len(truncated) + 1):
        got, _ = _stream(PROMPT, True, [truncated[:position], truncated[position:]])
        assert got == whole, position


# A tool's parameters as pydantic writes them: the nested model under "$defs", referred to from the root ("#/...").
# In the tool-calls grammar the parameters sit inside a larger schema, where those references used to resolve against
# the wrong root: every forced call of such a tool was a 400 ("Pointer '/$defs/Step' does not exist").
PYDANTIC_TOOL = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "$defs": {"Step": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}},
            "type": "object",
            "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}}, "next": {"$ref": "#"}},
            "required": ["steps"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # llguidance warns of each refused token
@pytest.mark.parametrize(
    ("arguments", "ok"),
    [
        ({"steps": [{"n": 1}]}, True),
        ({"steps": [{"n": 1}], "next": {"steps": []}}, True),  # "#" is the parameters' root, not the grammar's
        ({"steps": [{"n": 10}]}, False),  # the referred schema is enforced
        ({"steps": [], "next": {"name": "plan", "arguments": {"steps": []}}}, False),
    ],
)
def test_tool_calls_grammar_resolves_the_parameters_own_references(demo_tokenizer, arguments, ok):
    from freetoken.config import ModelConfig
    from freetoken.engine.structured import GrammarBackend, json_grammar
    from freetoken.models.demo import demo_checkpoint_dir

    backend = GrammarBackend(demo_tokenizer, ModelConfig.from_dir(demo_checkpoint_dir()).vocab_size, [151645])
    parser = _parser(PROMPT_NO_THINK, True)
    matcher = backend.matcher(
        json_grammar(None, parser.reasoning_grammar(optional=False), parser.tool_calls_grammar([PYDANTIC_TOOL]))
    )
    call = json.dumps({"name": "plan", "arguments": arguments}, separators=(",", ":"))
    tokens = demo_tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>")
    accepted = all(matcher.matcher.consume_token(t) for t in tokens) and matcher.is_accepting
    assert accepted is ok
