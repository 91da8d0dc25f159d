"""``logprobs`` / ``top_logprobs`` of OpenAI chat completions and ``logprobs`` of text completions, against a real
`ft serve` process through the official SDK: shapes, counts, ordering, streamed equal to non-streamed, errors."""

from __future__ import annotations

import math

HELLO = [{"role": "user", "content": "Say hello."}]
PROMPT = "The quick brown fox"


def _chat(openai_client, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return openai_client.chat.completions.create(model="m", messages=HELLO, temperature=0, **kwargs)


def _check_entry(entry, top_n: int) -> None:
    assert isinstance(entry.token, str)
    assert isinstance(entry.logprob, float) and entry.logprob <= 0.0 and math.isfinite(entry.logprob)
    assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
    assert len(entry.top_logprobs) == top_n
    values = [alt.logprob for alt in entry.top_logprobs]
    assert values == sorted(values, reverse=True)
    for alt in entry.top_logprobs:
        assert isinstance(alt.token, str) and isinstance(alt.bytes, list) and alt.logprob <= 0.0
    # Greedy: the sampled token is the most likely, so its logprob is >= every alternative's.
    assert all(entry.logprob >= v - 1e-6 for v in values)
    if top_n:
        assert entry.top_logprobs[0].bytes == entry.bytes and abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6


def test_chat_non_streamed(openai_client, demo_tokenizer):
    response = _chat(openai_client, logprobs=True, top_logprobs=3, n=2)
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) >= 1
        for entry in content:
            _check_entry(entry, 3)
        # The bytes of the tokens rebuild the output (byte-level BPE pieces carry their raw bytes).
        text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
        if choice.finish_reason == "length" and not choice.message.reasoning_content:
            assert text == choice.message.content
    assert sum(len(c.logprobs.content) for c in response.choices) == response.usage.completion_tokens
    # Without logprobs: null; logprobs without top_logprobs: no alternatives.
    assert _chat(openai_client, max_tokens=2).choices[0].logprobs is None
    bare = _chat(openai_client, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    # The same tokens and, to float32 rounding, the same log-probabilities: n=2 decodes a batch of two, whose CPU
    # matmuls may take other kernels than a batch of one (batch variance, about 1e-7 here), so not bit for bit.
    got = bare.choices[0].logprobs.content
    want = response.choices[0].logprobs.content[:3]
    assert [e.token for e in got] == [e.token for e in want]
    assert all(abs(g.logprob - w.logprob) < 1e-5 for g, w in zip(got, want, strict=True))


def test_chat_streamed_matches_non_streamed(openai_client):
    full = _chat(openai_client, logprobs=True, top_logprobs=2)
    stream = list(
        _chat(openai_client, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == stream[-1].usage.completion_tokens == full.usage.completion_tokens
    for got, expected in zip(entries, full.choices[0].logprobs.content, strict=True):
        _check_entry(got, 2)
        assert got.token == expected.token and got.bytes == expected.bytes
        assert abs(got.logprob - expected.logprob) < 1e-5
        assert [a.token for a in got.top_logprobs] == [a.token for a in expected.top_logprobs]
    # Not asked: every chunk's logprobs is null.
    plain = list(_chat(openai_client, max_tokens=3, stream=True))
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)


def test_chat_bad_logprobs_are_400(http):
    for extra, param in [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ]:
        body = {"model": "m", "messages": HELLO, "max_tokens": 1, **extra}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param
    ok = http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": HELLO, "max_tokens": 1, "logprobs": True, "top_logprobs": 20},
    )
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_completions_legacy_shape(openai_client, http):
    full = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    n = full.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    if full.choices[0].finish_reason == "length":
        assert "".join(lp.tokens) == full.choices[0].text
    offset = 0
    for token, value, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True):
        assert start == offset
        offset += len(token)
        assert len(top) <= 2 and all(v <= value + 1e-6 or k == token for k, v in top.items())
        assert max(top.values()) == value  # greedy: the sampled token is the most likely
    stream = list(
        openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True)
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert all(
        abs(a - b) < 1e-5
        for a, b in zip([v for s in streamed for v in s.token_logprobs], lp.token_logprobs, strict=True)
    )
    # echo: the prompt's tokens first (the first with null values, as OpenAI's), then the generated tokens, whose
    # offsets start after the echoed prompt.
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    for _ in range(2):  # the second time the prompt is in the prefix cache: it is prefilled again for its logprobs
        echoed = http.post("/v1/completions", json=body).json()
        echo_lp = echoed["choices"][0]["logprobs"]
        num_prompt = echoed["usage"]["prompt_tokens"]
        assert len(echo_lp["tokens"]) == num_prompt + echoed["usage"]["completion_tokens"]
        assert "".join(echo_lp["tokens"][:num_prompt]) == PROMPT
        assert echo_lp["token_logprobs"][0] is None and echo_lp["top_logprobs"][0] is None
        assert all(v <= 0 for v in echo_lp["token_logprobs"][1:]) and all(
            len(t) == 1 for t in echo_lp["top_logprobs"][1:]
        )
        assert echo_lp["text_offset"][:num_prompt] == [len("".join(echo_lp["tokens"][:i])) for i in range(num_prompt)]
        assert echo_lp["text_offset"][num_prompt] == len(PROMPT)
        assert echo_lp["token_logprobs"][num_prompt:] == lp.token_logprobs[:2]
        assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    chunks = [c.choices[0] for c in openai_client.completions.create(**{**body, "stream": True}) if c.choices]
    assert chunks[0].text == PROMPT
    assert chunks[0].logprobs.tokens == echo_lp["tokens"][:num_prompt]
    assert chunks[0].logprobs.token_logprobs == echo_lp["token_logprobs"][:num_prompt]
    assert openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices[0].logprobs is None
