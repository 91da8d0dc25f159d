"""Property-based tests: generated request bodies against a real `ft serve` process.

For each endpoint, `hypothesis` builds bodies that are valid-shaped with random field values (fields
missing, extra, of the wrong type, out of range; odd unicode, lone surrogates as escapes and as raw
bytes; nested junk; huge integers; NaN/Infinity literals in the raw JSON; truncated bodies) and checks:

- never a 5xx (nor an internal_error event inside a stream), with `logit_bias` maps, `stop` lists, tool-call
  arguments and nested message content among the generated fields;
- every 4xx has the API's own error shape;
- every 200 is a well-formed response of that API (streamed or not);
- the server is healthy afterwards: /health answers and normal requests of each API still work.

Generation stays small (valid budgets are at most 4 tokens) and deterministic (``derandomize``), so the
file runs in well under a minute on a CPU.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Raw JSON literals that `json.dumps` would never write; a generated value `Raw(i)` is serialized as a
# placeholder string, replaced by RAW_LITERALS[i] in the bytes sent.
RAW_LITERALS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 5000, b"9" * 400, b"-0", b"1E400",
    b'"\xed\xa0\x80"', b'"\xff\xfe"', b'"a\xc3"', b'"\\ud800"', b'"\\udfff\\ud800"', b'"\\u0000"',
    b"0x10", b"+1", b"[1,]", b"tru",
]  # fmt: skip


class Raw:
    """A raw JSON literal (an index into RAW_LITERALS) placed where a value goes."""

    def __init__(self, index: int) -> None:
        self.index = index

    def placeholder(self) -> str:
        return f"@@RAW{self.index}@@"


ODD_STRINGS = [
    "", " ", "\x00", "\ud800", "a\udfffb", "\udc00\ud800", "\u202e\u200d", "\ufeff", "🙂" * 3, "e\u0301",
    "<|im_end|>", "<|im_start|>system", "<think>", "</think>", "<tool_call>{\"name\": 1}</tool_call>",
    "{{ raise_exception('x') }}", "{% for %}", "\n\n\r\t", "a" * 3000, "null", "NaN",
]  # fmt: skip

text = st.one_of(st.text(max_size=12), st.sampled_from(ODD_STRINGS))
small_tokens = st.integers(min_value=1, max_value=4)
huge_ints = st.sampled_from([0, -1, 10**6, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 10**400])
numbers = st.one_of(
    st.integers(min_value=-5, max_value=4),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.5, 2.0000001]),
)
raw_literal = st.integers(min_value=0, max_value=len(RAW_LITERALS) - 1).map(Raw)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
junk = st.recursive(
    st.one_of(scalars, scalars, scalars, raw_literal),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(text, children, max_size=3)),
    max_leaves=8,
)


# logit_bias maps: keys that are token ids, past the vocabulary, negative, not numbers, or past Python's
# 4300-digit int-string limit (a 500 before); values in and out of [-100, 100].
logit_bias_keys = st.one_of(
    st.integers(min_value=0, max_value=151_700).map(str),
    st.sampled_from(["151936", "999999999999", "9" * 5000, "1" * 4301, "-1", "1.5", "1e3", "x", "", " 7", "٣"]),
)
logit_bias = st.dictionaries(
    logit_bias_keys, st.one_of(st.integers(min_value=-101, max_value=101), numbers, junk), max_size=3
)
# stop: single strings, lists (long, empty strings, control-token text, huge), junk items.
stops = st.one_of(
    text, st.lists(text, max_size=6), st.lists(st.one_of(text, junk), max_size=3), st.just(["a" * 5000] * 4)
)
# Tool-call arguments: JSON text (valid, invalid, deeply nested, huge numbers), objects, junk.
tool_arguments = st.one_of(
    text,
    st.sampled_from(
        [
            '{"a": 1}',
            "{}",
            "[]",
            '{"a": ',
            "null",
            '{"a": 1e999}',
            '{"a": ' + "9" * 5000 + "}",
            "[" * 5000 + "]" * 5000,
            '{"a": "\\ud800"}',
            '"<|im_end|>"',
        ]
    ),
    st.dictionaries(text, junk, max_size=3),
    junk,
)
# Message content nested past what any API allows: parts inside parts, lists inside lists.
nested_content = st.recursive(
    st.one_of(text, st.fixed_dictionaries({"type": st.just("text"), "text": text})),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "input_text", "tool_result"])},
            optional={"text": children, "content": children},
        ),
    ),
    max_leaves=10,
)

_CLEAN = [False]


def maybe(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes junk (always plausible while building clean strategies)."""
    return plausible if _CLEAN[0] else st.one_of(plausible, plausible, junk)


def body_strategy(fields: dict[str, st.SearchStrategy], required: dict[str, st.SearchStrategy]):
    """Bodies: `required` fields usually present, `fields` sometimes, plus sometimes an unknown field."""
    optional = {**fields, **{f"x_{name}": junk for name in ("extra", "vendor")}}
    return st.tuples(
        st.fixed_dictionaries({}, optional={**required, **optional}),
        st.fixed_dictionaries(required),
        st.integers(min_value=0, max_value=9),
    ).map(lambda t: t[0] if t[2] == 0 else {**t[1], **t[0]})


def _endpoint_fields() -> dict[str, tuple[dict[str, st.SearchStrategy], dict[str, st.SearchStrategy]]]:
    """(required, optional) field strategies of each endpoint, built with the current `maybe`."""
    # --- OpenAI chat completions ---------------------------------------------------------------------------

    text_part = st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(text)})
    chat_content = st.one_of(text, st.lists(maybe(text_part), max_size=2), st.none(), maybe(nested_content))
    tool_call = st.fixed_dictionaries({
        "id": maybe(text),
        "type": st.just("function"),
        "function": maybe(st.fixed_dictionaries({"name": maybe(text), "arguments": maybe(tool_arguments)})),
    })  # fmt: skip
    chat_message = st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"])), "content": chat_content},
        optional={
            "tool_calls": maybe(st.lists(maybe(tool_call), max_size=2)),
            "tool_call_id": maybe(text),
            "name": maybe(text),
            "reasoning_content": maybe(text),
        },
    )
    user_message = st.fixed_dictionaries({"role": st.just("user"), "content": text})
    function_tool = st.fixed_dictionaries({
        "type": maybe(st.just("function")),
        "function": maybe(st.fixed_dictionaries(
            {"name": maybe(st.sampled_from(["get_weather", "f"]))},
            optional={"description": maybe(text), "parameters": maybe(st.just({"type": "object", "properties": {}}))},
        )),
    })  # fmt: skip

    CHAT_REQUIRED = {
        "model": maybe(text),
        "messages": maybe(
            st.one_of(st.lists(user_message, min_size=1, max_size=2), st.lists(maybe(chat_message), max_size=3))
        ),
        "max_tokens": maybe(small_tokens),
    }
    CHAT_FIELDS = {
        "max_completion_tokens": maybe(small_tokens),
        "temperature": maybe(st.floats(min_value=0, max_value=2)),
        "top_p": maybe(st.floats(min_value=0.01, max_value=1)),
        "top_k": maybe(st.integers(min_value=-1, max_value=50)),
        "seed": maybe(st.integers(min_value=-(2**63), max_value=2**64 - 1)),
        "n": maybe(st.integers(min_value=1, max_value=3)),
        "stop": maybe(stops),
        "logit_bias": maybe(logit_bias),
        "stream": maybe(st.booleans()),
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
        "tools": maybe(st.lists(maybe(function_tool), max_size=2)),
        "tool_choice": maybe(st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}),
        )),
        "response_format": maybe(st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
            st.fixed_dictionaries({"type": st.just("json_schema"),
                                   "json_schema": maybe(st.fixed_dictionaries({"name": text},
                                                                              optional={"schema": junk}))}),
        )),
        "chat_template_kwargs": maybe(st.fixed_dictionaries({}, optional={"enable_thinking": maybe(st.booleans())})),
        "logprobs": maybe(st.booleans()),
        "frequency_penalty": maybe(st.floats(min_value=-2, max_value=2)),
        "presence_penalty": maybe(st.floats(min_value=-2, max_value=2)),
        "ignore_eos": maybe(st.booleans()),
        "parallel_tool_calls": maybe(st.booleans()),
        "user": maybe(text),
        "metadata": junk,
    }  # fmt: skip

    # --- OpenAI text completions ---------------------------------------------------------------------------

    COMPLETIONS_REQUIRED = {
        "model": maybe(text),
        "prompt": maybe(
            st.one_of(
                text,
                st.lists(text, min_size=1, max_size=2),
                st.lists(st.integers(min_value=-2, max_value=200_000), max_size=4),
            )
        ),
        "max_tokens": maybe(small_tokens),
    }
    COMPLETIONS_FIELDS = {
        name: CHAT_FIELDS[name]
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "n",
            "stop",
            "stream",
            "stream_options",
            "ignore_eos",
            "logit_bias",
        )
    } | {
        "echo": maybe(st.booleans()),
        "logprobs": maybe(st.one_of(st.none(), st.integers(min_value=0, max_value=5))),
        "suffix": maybe(st.one_of(st.none(), text)),
        "best_of": maybe(st.integers(min_value=1, max_value=2)),
    }

    # --- OpenAI Responses ----------------------------------------------------------------------------------

    input_part = st.fixed_dictionaries({
        "type": maybe(st.sampled_from(["input_text", "output_text", "text", "input_image", "weird"])),
        "text": maybe(text),
    })  # fmt: skip
    input_item = st.one_of(
        st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["user", "assistant", "system", "developer"]))},
            optional={
                "type": maybe(st.just("message")),
                "content": maybe(st.one_of(text, st.lists(input_part, max_size=2), nested_content)),
            },
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": maybe(text),
                "name": maybe(text),
                "arguments": maybe(tool_arguments),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call_output"),
                "call_id": maybe(text),
                "output": maybe(st.one_of(text, st.lists(input_part, max_size=2), nested_content)),
            }
        ),
        st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"summary": junk, "content": junk}),
        st.fixed_dictionaries({"type": text}),
    )
    RESPONSES_REQUIRED = {
        "model": maybe(text),
        "input": maybe(st.one_of(text, st.lists(maybe(input_item), max_size=3))),
        "max_output_tokens": maybe(small_tokens),
    }
    RESPONSES_FIELDS = {
        "instructions": maybe(text),
        "temperature": maybe(st.floats(min_value=0, max_value=2)),
        "top_p": maybe(st.floats(min_value=0.01, max_value=1)),
        "stream": maybe(st.booleans()),
        "tools": maybe(st.lists(maybe(st.fixed_dictionaries(
            {"type": maybe(st.sampled_from(["function", "web_search"])), "name": maybe(st.just("f"))},
            optional={"parameters": junk, "description": maybe(text)},
        )), max_size=2)),
        "tool_choice": maybe(st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": maybe(st.just("f"))}),
        )),
        "reasoning": maybe(st.fixed_dictionaries({}, optional={
            "effort": maybe(st.sampled_from(["none", "low", "high"]))})),
        "previous_response_id": maybe(st.one_of(st.none(), text)),
        "parallel_tool_calls": junk,
        "metadata": junk,
        "store": junk,
        "text": junk,
    }  # fmt: skip

    # --- Anthropic Messages --------------------------------------------------------------------------------

    anthropic_block = st.one_of(
        st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(text)},
                              optional={"cache_control": maybe(st.just({"type": "ephemeral"}))}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": maybe(text), "name": maybe(text),
                               "input": st.one_of(junk, tool_arguments)}),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(text)},
                              optional={"content": maybe(st.one_of(text, st.lists(junk, max_size=2), nested_content))}),
        st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking"])},
                              optional={"thinking": maybe(text), "signature": junk, "data": junk}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "server_tool_use", "x"])},
                              optional={"source": junk}),
    )  # fmt: skip
    anthropic_message = st.fixed_dictionaries({
        "role": maybe(st.sampled_from(["user", "assistant", "system"])),
        "content": maybe(st.one_of(text, st.lists(maybe(anthropic_block), max_size=3))),
    })  # fmt: skip
    MESSAGES_REQUIRED = {
        "model": maybe(text),
        "messages": maybe(
            st.one_of(st.lists(user_message, min_size=1, max_size=2), st.lists(maybe(anthropic_message), max_size=3))
        ),
        "max_tokens": maybe(small_tokens),
    }
    MESSAGES_FIELDS = {
        "system": maybe(st.one_of(text, st.lists(maybe(anthropic_block), max_size=2))),
        "temperature": maybe(st.floats(min_value=0, max_value=1)),
        "top_p": maybe(st.floats(min_value=0.01, max_value=1)),
        "top_k": maybe(st.integers(min_value=0, max_value=50)),
        "stop_sequences": maybe(stops),
        "stream": maybe(st.booleans()),
        "tools": maybe(st.lists(maybe(st.fixed_dictionaries(
            {"name": maybe(st.sampled_from(["get_weather", "f"]))},
            optional={"description": maybe(text), "input_schema": maybe(st.just({"type": "object"}))},
        )), max_size=2)),
        "tool_choice": maybe(st.fixed_dictionaries(
            {"type": maybe(st.sampled_from(["auto", "any", "tool", "none"]))},
            optional={"name": maybe(st.just("f")), "disable_parallel_tool_use": maybe(st.booleans())},
        )),
        "thinking": maybe(st.fixed_dictionaries(
            {"type": maybe(st.sampled_from(["enabled", "disabled"]))}, optional={"budget_tokens": junk},
        )),
        "metadata": junk,
        "service_tier": junk,
    }  # fmt: skip

    return {
        CHAT: (CHAT_REQUIRED, CHAT_FIELDS),
        COMPLETIONS: (COMPLETIONS_REQUIRED, COMPLETIONS_FIELDS),
        RESPONSES: (RESPONSES_REQUIRED, RESPONSES_FIELDS),
        MESSAGES: (MESSAGES_REQUIRED, MESSAGES_FIELDS),
    }


def endpoint_bodies(path: str) -> st.SearchStrategy:
    """Bodies for one endpoint: some built from plausible values only (mostly valid: they reach the model),
    the rest with junk mixed in."""
    _CLEAN[0] = True
    try:
        clean_required, clean_fields = _endpoint_fields()[path]
    finally:
        _CLEAN[0] = False
    required, fields = _endpoint_fields()[path]
    clean = st.fixed_dictionaries(clean_required, optional=clean_fields)
    return st.one_of(clean, body_strategy(fields, required))


# --- encoding ------------------------------------------------------------------------------------------


def _replace_raw(value: Any) -> Any:
    if isinstance(value, Raw):
        return value.placeholder()
    if isinstance(value, dict):
        return {k: _replace_raw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_raw(v) for v in value]
    return value


def encode(body: dict[str, Any], ascii_only: bool, cut: int | None) -> bytes:
    """`body` as bytes: lone surrogates as escapes (`ascii_only`) or as raw (invalid UTF-8) bytes, Raw
    placeholders replaced by their literals, NaN/Infinity written as Python's json does; cut short at
    `cut` bytes when given."""
    raw = json.dumps(_replace_raw(body), ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    for index, literal in enumerate(RAW_LITERALS):
        raw = raw.replace(json.dumps(f"@@RAW{index}@@").encode(), literal)
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    return raw


def sent_bodies(path: str) -> st.SearchStrategy:
    """(body, ascii_only, cut) for `path`: `cut` (a truncated body) is rare."""
    return st.tuples(
        endpoint_bodies(path),
        st.booleans(),
        st.one_of(st.none(), st.none(), st.none(), st.none(), st.none(), st.integers(min_value=0, max_value=400)),
    )


def _cap_budget(body: dict[str, Any], *keys: str) -> None:
    """Keep generation short: with every budget field absent (the request would run to the end of the
    context), set the first to 2. Generated budgets are at most 4 or out of range."""
    if all(body.get(key) is None for key in keys):
        body[keys[0]] = 2


# --- checks --------------------------------------------------------------------------------------------


def assert_openai_error_shape(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["code"], str)


def assert_anthropic_error_shape(response: httpx.Response) -> None:
    body = response.json()
    assert body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["type"], str) and error["type"] not in ("api_error", "overloaded_error"), error
    assert isinstance(error["message"], str) and error["message"]


def _data_events(raw: bytes, parse_sse) -> list[tuple[str | None, Any]]:
    out = []
    for name, data in parse_sse(raw):
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def check_chat(body: dict[str, Any], streamed: bool, parse_sse) -> None:
    if not streamed:
        assert body["object"] == "chat.completion"
        assert body["choices"]
        for i, choice in enumerate(body["choices"]):
            assert choice["index"] == i
            assert choice["message"]["role"] == "assistant"
            assert choice["finish_reason"] in ("stop", "length", "tool_calls")
            content = choice["message"]["content"]
            assert content is None or isinstance(content, str)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        return
    events = _data_events(body, parse_sse)
    assert events[-1][1] == "[DONE]"
    finished = set()
    for _, data in events[:-1]:
        assert "error" not in data, data
        assert data["object"] == "chat.completion.chunk"
        for choice in data["choices"]:
            if choice["finish_reason"] is not None:
                assert choice["finish_reason"] in ("stop", "length", "tool_calls")
                finished.add(choice["index"])
    assert finished


def check_completions(body: Any, streamed: bool, parse_sse) -> None:
    if not streamed:
        assert body["object"] == "text_completion"
        [choice] = body["choices"]
        assert isinstance(choice["text"], str)
        assert choice["finish_reason"] in ("stop", "length")
        return
    events = _data_events(body, parse_sse)
    assert events[-1][1] == "[DONE]"
    reasons = []
    for _, data in events[:-1]:
        assert "error" not in data, data
        assert data["object"] == "text_completion"
        reasons += [c["finish_reason"] for c in data["choices"] if c["finish_reason"] is not None]
    assert reasons and set(reasons) <= {"stop", "length"}


def check_responses(body: Any, streamed: bool, parse_sse) -> None:
    if streamed:
        events = _data_events(body, parse_sse)
        assert events[0][0] == "response.created"
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert events[-1][0] in ("response.completed", "response.incomplete"), events[-1]
        body = events[-1][1]["response"]
    assert body["object"] == "response"
    assert body["status"] in ("completed", "incomplete")
    assert body["output"] and all(item["type"] in ("message", "reasoning", "function_call") for item in body["output"])
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + body["usage"]["output_tokens"]


def check_messages(body: Any, streamed: bool, parse_sse) -> None:
    stop_reasons = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    if not streamed:
        assert body["type"] == "message" and body["role"] == "assistant"
        assert body["content"] and all(b["type"] in ("text", "thinking", "tool_use") for b in body["content"])
        assert body["stop_reason"] in stop_reasons
        assert body["usage"]["output_tokens"] >= 1
        return
    events = _data_events(body, parse_sse)
    names = [name for name, _ in events]
    assert "error" not in names, events
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert events[-2][1]["delta"]["stop_reason"] in stop_reasons
    assert names.count("content_block_start") == names.count("content_block_stop") >= 1


def check_count_tokens(body: Any, streamed: bool, parse_sse) -> None:
    assert set(body) == {"input_tokens"}
    assert isinstance(body["input_tokens"], int) and body["input_tokens"] >= 1


def send(http: httpx.Client, path: str, raw: bytes, check, *, anthropic_shape: bool, parse_sse) -> None:
    headers = {"content-type": "application/json"}
    if anthropic_shape:
        headers["anthropic-version"] = "2023-06-01"
    with http.stream("POST", path, content=raw, headers=headers) as response:
        content = response.read()
    assert response.status_code < 500, content[:2000]
    if response.status_code >= 400:
        assert anthropic_shape or response.status_code in (400, 413), content[:2000]
        (assert_anthropic_error_shape if anthropic_shape else assert_openai_error_shape)(response)
        return
    assert response.status_code == 200
    streamed = response.headers["content-type"].startswith("text/event-stream")
    check(content if streamed else response.json(), streamed, parse_sse)


@FUZZ
@given(sent=sent_bodies(CHAT))
def test_fuzz_chat_completions(http, parse_sse, sent):
    body, ascii_only, cut = sent
    _cap_budget(body, "max_tokens", "max_completion_tokens")
    send(http, CHAT, encode(body, ascii_only, cut), check_chat, anthropic_shape=False, parse_sse=parse_sse)


@FUZZ
@given(sent=sent_bodies(COMPLETIONS))
def test_fuzz_completions(http, parse_sse, sent):
    body, ascii_only, cut = sent
    _cap_budget(body, "max_tokens")
    send(
        http, COMPLETIONS, encode(body, ascii_only, cut), check_completions, anthropic_shape=False, parse_sse=parse_sse
    )


@FUZZ
@given(sent=sent_bodies(RESPONSES))
def test_fuzz_responses(http, parse_sse, sent):
    body, ascii_only, cut = sent
    _cap_budget(body, "max_output_tokens")
    send(http, RESPONSES, encode(body, ascii_only, cut), check_responses, anthropic_shape=False, parse_sse=parse_sse)


@FUZZ
@given(sent=sent_bodies(MESSAGES))
def test_fuzz_messages(http, parse_sse, sent):
    body, ascii_only, cut = sent
    send(http, MESSAGES, encode(body, ascii_only, cut), check_messages, anthropic_shape=True, parse_sse=parse_sse)


@FUZZ
@given(sent=sent_bodies(MESSAGES))
def test_fuzz_count_tokens(http, parse_sse, sent):
    body, ascii_only, cut = sent
    send(
        http, COUNT_TOKENS, encode(body, ascii_only, cut), check_count_tokens, anthropic_shape=True, parse_sse=parse_sse
    )


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": ' + b"9" * 400 + b"}", "top_p"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (b'{"model": "m", "input": "hi", "metadata": {"a": Infinity}}', "metadata.a"),
        (b'{"model": "m", "input": "hi", "metadata": {"a": "\\udc00"}}', "metadata.a"),
        (b'{"model": "m", "prompt": "x\\ud800"}', "prompt"),
        (b'{"model": "m", "prompt": "x", "seed": ' + b"1" * 5000 + b"}", None),
    ],
    ids=[
        "nan",
        "huge-number",
        "lone-surrogate",
        "responses-echo-infinity",
        "responses-echo-surrogate",
        "completions-surrogate",
        "int-past-digit-limit",
    ],
)
def test_found_by_fuzzing(http, raw, param):
    """Bodies the fuzzer found answered with 500 before: now a 400 naming the field."""
    path = RESPONSES if b'"input"' in raw else COMPLETIONS if b'"prompt"' in raw else CHAT
    response = http.post(path, content=raw)
    assert response.status_code == 400, response.text
    assert_openai_error_shape(response)
    assert response.json()["error"]["param"] == param


def test_tiny_temperature_samples_greedily(http):
    """A temperature just above 0 (found by fuzzing: 4.7e-52) overflowed the logits and failed the engine's step,
    a 500; below MIN_TEMPERATURE it now samples greedily."""
    outputs = []
    for temperature in (0, 4.7278972267409074e-52, 1e-6):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": temperature,
        }
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        outputs.append(response.json()["choices"][0]["message"]["content"])
    assert outputs[1] == outputs[2] == outputs[0]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_empty_completions_prompt_is_400(http, stream):
    """An empty prompt string (found by fuzzing) was refused by the engine mid-stream, after a 200."""
    for prompt in ("", [""]):
        response = http.post(COMPLETIONS, json={"model": "m", "prompt": prompt, "max_tokens": 2, "stream": stream})
        assert response.status_code == 400, response.text
        assert_openai_error_shape(response)
        assert response.json()["error"]["param"] == "prompt"


def test_healthy_after_fuzzing(http, openai_client, anthropic_client):
    """Runs after the fuzz tests (file order): the server answers and serves each API normally."""
    health = http.get("/health")
    assert health.status_code == 200
    engine = health.json()["engine"]
    assert engine["num_running"] == 0 and engine["kv_blocks_free"] == engine["kv_blocks_total"]
    user = [{"role": "user", "content": "hi"}]
    chat = openai_client.chat.completions.create(model="m", messages=user, max_tokens=2)
    assert chat.choices[0].finish_reason in ("stop", "length")
    message = anthropic_client.messages.create(model="m", messages=user, max_tokens=2)
    assert message.stop_reason in ("end_turn", "max_tokens")
    response = openai_client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert response.status in ("completed", "incomplete")
    assert openai_client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].text is not None
    assert anthropic_client.messages.count_tokens(model="m", messages=user).input_tokens >= 1
