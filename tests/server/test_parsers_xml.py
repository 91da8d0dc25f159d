"""The XML tool-call form of Qwen3.5 / Qwen3-Coder (`freetoken.server.parsers.qwen3_xml`): whole and streamed at
every split, parameters typed by the tool's schema, chosen by the chat template, malformed blocks never raising
and never sent as content."""

from __future__ import annotations

import json
import random

import pytest

from freetoken.server.parsers import (
    ParsedOutput,
    ParserOptions,
    ToolCall,
    collect_deltas,
    parse_text,
    parser_for,
)
from freetoken.server.parsers.qwen3 import Qwen3Parser
from freetoken.server.parsers.qwen3_xml import Qwen3XmlParser, convert_parameter

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "where": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "ratio": {"type": "number"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}},
]


def _parser(parse_tools: bool = True, prompt: str = "<|im_start|>assistant\n") -> Qwen3XmlParser:
    tools = TOOLS if parse_tools else None
    return Qwen3XmlParser(ParserOptions(prompt_text=prompt, parse_tools=parse_tools, tools=tools))


def _call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CASES = [
    (
        "Let me check." + _call("get_weather", city="Paris", days="3"),
        ParsedOutput("Let me check.", "", [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]),
    ),
    (
        "<think>\nweather?\n</think>\n\n"
        + _call(
            "get_weather",
            city="New York\nNY",
            metric="true",
            hours="[1, 2]",
            where='{"lat": 1.5}',
            note="null",
            ratio="0.5",
        ),
        ParsedOutput(
            "",
            "weather?",
            [
                ToolCall(
                    "get_weather",
                    '{"city": "New York\\nNY", "metric": true, "hours": [1, 2], "where": {"lat": 1.5}, "note": null, '
                    '"ratio": 0.5}',
                )
            ],
        ),
    ),
    (
        _call("ls") + "\n" + _call("get_weather", days="two", unknown='{"a": 1}'),
        ParsedOutput(
            "", "", [ToolCall("ls", "{}"), ToolCall("get_weather", '{"days": "two", "unknown": "{\\"a\\": 1}"}')]
        ),
    ),
    # A value holding tags of the form itself, and Python's literal for a boolean.
    (
        _call("get_weather", city="<function=x> </function>", metric="True"),
        ParsedOutput("", "", [ToolCall("get_weather", '{"city": "<function=x> </function>", "metric": true}')]),
    ),
    # The JSON form still reads, and a block of neither form is dropped.
    ('<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', ParsedOutput("", "", [ToolCall("ls", "{}")])),
    ("a<tool_call>\nnot a call\n</tool_call>b", ParsedOutput("ab", "", [])),
    # Cut off: a call keeps the parameters that closed; missing </function> closes at </tool_call>.
    (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nPar",
        ParsedOutput("", "", [ToolCall("get_weather", '{"days": 3}')]),
    ),
    ("<tool_call>\n<function=ls>\n</tool_call>after", ParsedOutput("after", "", [ToolCall("ls", "{}")])),
    ("<tool_call>\n<funct", ParsedOutput("", "", [])),
    ("Text with <function=x> but no block", ParsedOutput("Text with <function=x> but no block", "", [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_whole_and_every_split(text, expected):
    assert parse_text(_parser(), text) == expected
    for cut in range(len(text) + 1):
        parser = _parser()
        deltas = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
        assert collect_deltas(deltas) == expected, cut
    parser = _parser()
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    assert collect_deltas(deltas) == expected
    if "<" not in expected.content:
        assert all("<" not in d.content for d in deltas)
    for call in expected.tool_calls:
        json.loads(call.arguments)


def test_name_first_then_one_pair_per_parameter():
    parser = _parser()
    assert parser.feed("<tool_call>\n<function=get_weather>\n").tool_calls[0].name == "get_weather"
    assert parser.feed("<parameter=city>\nParis\n").tool_calls == []  # the value may go on
    assert parser.feed("</parameter>\n").tool_calls[0].arguments == '{"city": "Paris"'
    assert parser.feed("</function>\n</tool_call>").tool_calls[0].arguments == "}"


def test_without_tools_the_markup_is_content():
    text = _call("ls")
    assert parse_text(_parser(parse_tools=False), text) == ParsedOutput(text, "", [])


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),
        ("-1e3", {"type": "number"}, -1000.0),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("[1]", {"anyOf": [{"type": "array"}, {"type": "null"}]}, [1]),
        ("None", {"type": "null"}, None),
        ("42", {"type": "string"}, "42"),
        ("42", None, "42"),
        (" 7 ", {"type": ["integer", "string"]}, 7),
    ],
)
def test_parameters_take_the_schema_types(text, schema, value):
    assert convert_parameter(text, schema) == value


def test_tool_call_prefix_names_the_function():
    parser = _parser()
    first = parser.feed(parser.tool_call_prefix("get_weather"))
    assert first.tool_calls[0].name == "get_weather"
    out = parse_text(parser, "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", first)
    assert out.tool_calls == [ToolCall("get_weather", '{"days": 2}')]


def test_random_markup_never_raises():
    """Random mixes of the form's tags, fragments and text: no exception, and one piece at a time equals whole."""
    atoms = [
        "<tool_call>",
        "</tool_call>",
        "<function=ls>",
        "<function=get_weather>",
        "</function>",
        "<parameter=days>",
        "<parameter=city>",
        "</parameter>",
        "\n",
        "3",
        "Paris",
        "<",
        "{",
        "<think>",
        "</think>",
        "<func",
        "</para",
    ]
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 14)))
        whole = parse_text(_parser(), text)
        parser = _parser()
        assert collect_deltas([parser.feed(c) for c in text] + [parser.finish()]) == whole, text


def _rendered_call(tokenizer, tools: list[dict], arguments: dict) -> str:
    """The `<tool_call>` block the tokenizer's chat template renders for a past get_weather call."""
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
        },
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
    return rendered[rendered.rindex("<tool_call>") : rendered.rindex("</tool_call>") + len("</tool_call>")]


def test_chosen_by_the_template_and_reads_what_it_renders(demo_tokenizer):
    """The qwen3.5 preset's tokenizer (Qwen3.5's chat template) gets the XML parser, Qwen3's template the JSON one;
    a past call the template renders parses back to the call."""
    from freetoken.models.presets import preset_dir
    from freetoken.tokenizer import Tokenizer

    options = ParserOptions(prompt_text="", parse_tools=True, tools=TOOLS)
    assert type(parser_for(demo_tokenizer, options)) is Qwen3Parser
    tokenizer = Tokenizer.from_dir(preset_dir("qwen3.5-35b-a3b"))
    assert isinstance(parser_for(tokenizer, options), Qwen3XmlParser)
    arguments = {"city": "Paris", "days": 3, "hours": [1, 2]}
    block = _rendered_call(tokenizer, TOOLS, arguments)
    out = parse_text(parser_for(tokenizer, options), block)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", arguments)]


@pytest.fixture(scope="module")
def xml_server(tmp_path_factory):
    """`ft serve` of the demo checkpoint with Qwen3.5's chat template (the preset's), so calls are parsed in XML."""
    from conftest import start_server
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.models.presets import preset_dir

    model = tmp_path_factory.mktemp("xml-model")
    for item in demo_checkpoint_dir().iterdir():
        (model / item.name).symlink_to(item)
    (model / "chat_template.jinja").symlink_to(preset_dir("qwen3.5-35b-a3b") / "chat_template.jinja")
    server = start_server(tmp_path_factory.mktemp("xml-server"), "--model", str(model))
    yield server
    server.stop()


def test_server_sends_xml_calls_as_tool_calls_and_tool_use(xml_server, parse_sse):
    """A call forced by name (the grammar of the XML form, thinking off; the random model's free text for `city`
    is cut by max_tokens, so the call keeps no parameter): OpenAI tool_calls and Anthropic tool_use, streamed and
    not, with no markup in the text."""
    import anthropic
    import httpx
    import openai

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = {
        "model": "m",
        "messages": messages,
        "tools": tools,
        "max_tokens": 12,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    client = openai.OpenAI(base_url=xml_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    sdk_body = {k: v for k, v in body.items() if k != "chat_template_kwargs"}
    extra = {"chat_template_kwargs": body["chat_template_kwargs"]}
    choice = client.chat.completions.create(**sdk_body, extra_body=extra).choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert "<" not in (choice.message.content or "")
    with (
        httpx.Client(base_url=xml_server.base_url, timeout=60.0) as http,
        http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        events = [json.loads(data) for _, data in parse_sse(response.read()) if data != "[DONE]"]
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"].get("arguments") or "" for d in deltas) == call.function.arguments
    claude = anthropic.Anthropic(base_url=xml_server.base_url, api_key="unused", max_retries=0, timeout=60.0)
    message = claude.messages.create(
        model="claude-any",
        messages=messages,
        max_tokens=12,
        tool_choice={"type": "tool", "name": "get_weather"},
        tools=[{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}],
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    assert all("<" not in b.text for b in message.content if b.type == "text")


# ---------------------------------------------------------------------------------------------------------------------
# Forced calls: the grammar of the XML form (`Qwen3XmlParser.tool_calls_grammar`).


def _tool(name: str, **schema) -> dict:
    """An offered tool (chat template format) whose parameters are the object schema `schema`."""
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", **schema}}}


_UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
_WEATHER = {"unit": _UNIT, "metric": {"type": "boolean"}, "days": {"type": "integer"}}
FORCED_TOOLS = [
    _tool("get_weather", properties={"city": {"type": "string"}, **_WEATHER}, required=["unit", "metric"]),
    _tool("list_files"),
]
WEATHER = "<tool_call>\n<function=get_weather>\n"
CLOSE = "</function>\n</tool_call>"


def _forced_parser(prompt: str = "<|im_start|>assistant\n") -> Qwen3XmlParser:
    return Qwen3XmlParser(ParserOptions(prompt_text=prompt, parse_tools=True, tools=FORCED_TOOLS))


def _param(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


@pytest.fixture(scope="module")
def xml_grammar(demo_tokenizer):
    """(grammar text of a forced call of `FORCED_TOOLS`, the grammar backend) on the demo tokenizer (Qwen's)."""
    from freetoken.config import ModelConfig
    from freetoken.engine.structured import GrammarBackend, json_grammar
    from freetoken.models.demo import demo_checkpoint_dir

    backend = GrammarBackend(demo_tokenizer, ModelConfig.from_dir(demo_checkpoint_dir()).vocab_size, [151645])
    parser = _forced_parser("<think>\n\n</think>\n\n")
    return json_grammar(
        None, parser.reasoning_grammar(optional=False), parser.tool_calls_grammar(FORCED_TOOLS)
    ), backend


def _accepts(xml_grammar, demo_tokenizer, text: str) -> bool:
    grammar, backend = xml_grammar
    matcher = backend.matcher(grammar)
    for token in demo_tokenizer.encode(text):
        if not matcher.matcher.consume_token(token):
            return False
    return matcher.is_accepting


@pytest.mark.filterwarnings("ignore::UserWarning")  # llguidance warns of each refused token
@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (WEATHER + _param("unit", "celsius") + _param("metric", "true") + CLOSE, True),
        (WEATHER + _param("city", "Pa</par\nris") + _param("unit", "fahrenheit") + _param("metric", "no") + CLOSE,
         False),  # not a boolean
        (WEATHER + _param("city", "Pa</par\nris") + _param("unit", "fahrenheit") + _param("metric", "false") + CLOSE,
         True),
        (WEATHER + _param("city", "") + _param("unit", "celsius") + _param("metric", "true") + _param("days", "3")
         + CLOSE, True),
        ("<tool_call>\n<function=list_files>\n" + _param("any name", "x\ny") + CLOSE + "\n<tool_call>\n"
         "<function=list_files>\n" + CLOSE, True),
        (WEATHER + _param("metric", "true") + CLOSE, False),  # a required parameter missing
        (WEATHER + _param("unit", "kelvin") + _param("metric", "true") + CLOSE, False),  # not in the enum
        (WEATHER + _param("unit", "celsius") + _param("metric", "yes") + CLOSE, False),  # not a boolean
        (WEATHER + _param("unit", "celsius") + _param("metric", "true") + _param("days", "3.5") + CLOSE, False),
        (WEATHER + _param("city", "a</parameter>b") + _param("unit", "celsius") + _param("metric", "true") + CLOSE,
         False),  # the parser would end the value at the first </parameter>
        (WEATHER + _param("unit", "celsius") + _param("metric", "true") + _param("wind", "1") + CLOSE, False),
        ("<tool_call>\n<function=other>\n" + CLOSE, False),
        ("Sure, " + WEATHER + _param("unit", "celsius") + _param("metric", "true") + CLOSE, False),
    ],
)  # fmt: skip
def test_forced_call_grammar_is_the_template_s_form(xml_grammar, demo_tokenizer, text, ok):
    assert _accepts(xml_grammar, demo_tokenizer, text) is ok


def test_forced_call_grammar_accepts_what_the_template_renders(xml_grammar, demo_tokenizer):
    """Calls rendered by Qwen3.5's chat template (the preset's) are in the grammar, and parse back to the call."""
    from freetoken.models.presets import preset_dir
    from freetoken.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(preset_dir("qwen3.5-35b-a3b"))
    arguments = {"city": "Rome", "unit": "celsius", "metric": False, "days": 12}
    block = _rendered_call(tokenizer, FORCED_TOOLS, arguments)
    assert _accepts(xml_grammar, demo_tokenizer, block)
    out = parse_text(_forced_parser(), block)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", arguments)]


@pytest.fixture(scope="module")
def qwen35_server(tmp_path_factory):
    """`ft serve` of the Qwen3.5 demo checkpoint (a hybrid) with Qwen3.5's own chat template (XML calls)."""
    from conftest import start_server
    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint
    from freetoken.models.presets import preset_dir

    model = build_qwen3_5_demo_checkpoint(tmp_path_factory.mktemp("qwen35-xml"))
    (model / "chat_template.jinja").write_text((preset_dir("qwen3.5-35b-a3b") / "chat_template.jinja").read_text())
    server = start_server(tmp_path_factory.mktemp("qwen35-xml-server"), model_dir=model)
    yield server
    server.stop()


# The server tests' tools take no free text: the random model would not end it (a real model does; the grammar
# tests above cover text values).
SERVER_TOOLS = [
    _tool("get_weather", properties=_WEATHER, required=["unit", "metric"]),
    _tool("list_files", additionalProperties=False),
]


def _valid_weather(arguments: dict) -> bool:
    return (
        arguments.get("unit") in ("celsius", "fahrenheit")
        and isinstance(arguments.get("metric"), bool)
        and set(arguments) <= {"unit", "metric", "days"}
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_qwen35_forced_call_is_constrained_openai(qwen35_server, parse_sse, tool_choice):
    """The random Qwen3.5 demo cannot write a call on its own; the grammar makes it write the XML form with the
    schema's required parameters and types, sent as OpenAI tool_calls, streamed and not, the same."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=qwen35_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": SERVER_TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None, choice
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert _valid_weather(arguments) if call.function.name == "get_weather" else isinstance(arguments, dict)
    body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs["extra_body"], "stream": True}
    with (
        httpx.Client(base_url=qwen35_server.base_url, timeout=60.0) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        events = [json.loads(data) for _, data in parse_sse(response.read()) if data != "[DONE]"]
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or []]
    assert [d["function"]["name"] for d in deltas if d["index"] == 0 and d["function"].get("name")] == [
        calls[0].function.name
    ]
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas if d["index"] == 0)
    assert arguments == calls[0].function.arguments
    assert not any(c["delta"].get("content") for e in events for c in e["choices"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_qwen35_forced_call_is_constrained_anthropic(qwen35_server, parse_sse, tool_choice):
    import anthropic
    import httpx

    client = anthropic.Anthropic(base_url=qwen35_server.base_url, api_key="unused", max_retries=0, timeout=60.0)
    kwargs = {
        "model": "claude-any",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in SERVER_TOOLS],
        "tool_choice": tool_choice,
        "max_tokens": 60,
        "thinking": {"type": "disabled"},
    }
    message = client.messages.create(**kwargs, extra_body={"temperature": 0})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(b.type != "text" for b in message.content), message.content
    if tool_choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    assert _valid_weather(uses[0].input) if uses[0].name == "get_weather" else isinstance(uses[0].input, dict)
    with (
        httpx.Client(base_url=qwen35_server.base_url, timeout=60.0) as http,
        http.stream("POST", "/v1/messages", json={**kwargs, "temperature": 0, "stream": True}) as response,
    ):
        assert response.status_code == 200
        events = [json.loads(data) for _, data in parse_sse(response.read())]
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0
    )
    assert json.loads(partial) == uses[0].input


@pytest.mark.filterwarnings("ignore::UserWarning")  # llguidance warns of each refused token
@pytest.mark.parametrize(("days", "ok"), [("[1,7]", True), ("[8]", False)])
def test_forced_call_grammar_resolves_the_parameters_own_references(demo_tokenizer, days, ok):
    """A parameter whose JSON schema refers to the tool's ``$defs`` (as pydantic writes them) compiles, and the
    referred schema is enforced: each value's grammar is compiled apart from the tool's schema."""
    from freetoken.config import ModelConfig
    from freetoken.engine.structured import GrammarBackend, json_grammar
    from freetoken.models.demo import demo_checkpoint_dir

    day = {"type": "integer", "minimum": 1, "maximum": 7}
    tool = _tool(
        "plan", properties={"days": {"type": "array", "items": {"$ref": "#/$defs/Day"}}}, **{"$defs": {"Day": day}}
    )
    backend = GrammarBackend(demo_tokenizer, ModelConfig.from_dir(demo_checkpoint_dir()).vocab_size, [151645])
    parser = _forced_parser("<think>\n\n</think>\n\n")
    grammar = json_grammar(None, parser.reasoning_grammar(optional=False), parser.tool_calls_grammar([tool]))
    text = "<tool_call>\n<function=plan>\n" + _param("days", days) + CLOSE
    assert _accepts((grammar, backend), demo_tokenizer, text) is ok
