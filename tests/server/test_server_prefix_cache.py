"""The KV prefix cache through a real `ft serve`: reuse is reported where clients look, and every answer at
temperature 0 is the same text as on a server started with --no-prefix-cache.

The shared `server` fixture has the cache on (the default); `cold` has it off; `small` has it on over a KV budget
of 512 tokens (32 blocks), where sessions evict each other's blocks and concurrent requests are preempted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from conftest import ServerProcess, start_server

SYSTEM = (
    "You are a careful assistant working inside a code repository. Answer briefly, cite file names, and never "
    "invent tools. The repository holds a Rust core and a Python engine; tests run on the CPU."
)


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("cold"), "--no-prefix-cache")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("small"), "--kv-cache-tokens", "512", "--max-num-seqs", "4")
    yield proc
    proc.stop()


def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def chat(server: ServerProcess, messages: list[dict], max_tokens: int = 12, **kwargs):
    return oai(server).chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def complete(server: ServerProcess, prompt: list[int] | str, max_tokens: int = 10):
    return oai(server).completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)


def stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/stats", timeout=30).json()["prefix_cache"]


def reused(num_prompt_tokens: int) -> int:
    """Tokens a prompt reuses when all of it is cached: its full blocks of 16, but its last token."""
    return num_prompt_tokens - 1 if num_prompt_tokens % 16 == 0 else num_prompt_tokens // 16 * 16


def test_second_turn_reports_cached_tokens_and_equals_cold(server, cold):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do the tests live?"}]
    first = chat(server, history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or "tests/"},
        {"role": "user", "content": "And the benchmarks?"},
    ]
    second = chat(server, history)
    reference = chat(cold, history)
    assert second.choices[0].message.content == reference.choices[0].message.content
    assert second.usage.prompt_tokens == reference.usage.prompt_tokens
    # Everything up to the end of turn 1's prompt is reused, in whole blocks of 16 tokens.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    # Streamed, with include_usage: the same figures.
    stream = oai(server).chat.completions.create(
        model="m", messages=history, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused(second.usage.prompt_tokens)


def test_completions_and_responses_report_cached_tokens(server, cold):
    prompt = SYSTEM + " Completions and responses both report the prefix cache."
    complete(server, prompt)
    again = complete(server, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == reused(again.usage.prompt_tokens)
    assert again.choices[0].text == complete(cold, prompt).choices[0].text
    client = oai(server)
    client.responses.create(model="m", input=prompt, max_output_tokens=8, temperature=0)
    response = client.responses.create(model="m", input=prompt, max_output_tokens=8, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == reused(response.usage.input_tokens) > 0
    reference = oai(cold).responses.create(model="m", input=prompt, max_output_tokens=8, temperature=0)
    assert reference.usage.input_tokens_details.cached_tokens == 0
    assert response.output_text == reference.output_text


def test_anthropic_usage_splits_the_prompt(server, cold, http, parse_sse):
    messages = [{"role": "user", "content": SYSTEM + " Which usage fields does the Messages API report?"}]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)
    counted = client.messages.count_tokens(model="m", messages=messages).input_tokens
    first = client.messages.create(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0})
    again = client.messages.create(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0})
    for usage in (first.usage, again.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted
    assert again.usage.cache_read_input_tokens == reused(counted) > 0
    assert again.usage.cache_creation_input_tokens == 0
    if first.usage.cache_read_input_tokens == 0:  # the first time this server saw the prompt
        assert first.usage.cache_creation_input_tokens == counted // 16 * 16
    cold_client = anthropic.Anthropic(base_url=cold.base_url, api_key="unused", max_retries=0, timeout=120.0)
    reference = cold_client.messages.create(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0})
    assert reference.usage.input_tokens == counted
    assert reference.usage.cache_read_input_tokens == reference.usage.cache_creation_input_tokens == 0
    assert again.content[0].text == reference.content[0].text
    # Streamed: message_start says what is cached before the answer starts; message_delta has the split too.
    body = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as response:
        events = dict(parse_sse(response.read()))
    start = json.loads(events["message_start"])["message"]["usage"]
    delta = json.loads(events["message_delta"])["usage"]
    for usage in (start, delta):
        assert usage["cache_read_input_tokens"] == again.usage.cache_read_input_tokens
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == (
            counted
        )
    # The SDK's stream accumulates message_delta's usage.
    with client.messages.stream(model="m", messages=messages, max_tokens=6, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert final.content[0].text == reference.content[0].text


def test_strict_prefix_and_mid_edit_equal_cold(server, cold):
    # Token ids, so that cuts fall exactly where the test says.
    long_prompt = [1000 + 3 * i for i in range(60)] + [(7 * i) % 5000 + 200 for i in range(40)]
    complete(server, long_prompt, max_tokens=16)
    for cut in (32, 37, 48, len(long_prompt) - 5):
        prompt = long_prompt[:cut]
        got = complete(server, prompt)
        assert got.choices[0].text == complete(cold, prompt).choices[0].text, cut
        assert got.usage.prompt_tokens_details.cached_tokens == reused(cut), cut
    for at in (5, 20, 40):
        edited = list(long_prompt)
        edited[at] += 1
        got = complete(server, edited)
        assert got.usage.prompt_tokens_details.cached_tokens == at // 16 * 16, at
        assert got.choices[0].text == complete(cold, edited).choices[0].text, at


def test_many_sessions_under_a_small_kv_budget(small, cold):
    """Six three-turn sessions round-robin through 512 tokens of KV: blocks are evicted, answers stay cold's."""
    sessions = [
        [
            {"role": "system", "content": f"Session {s}. " + SYSTEM},
            {"role": "user", "content": f"Question {s}: what is in the repository?"},
        ]
        for s in range(6)
    ]
    evictions_before = stats(small)["num_evictions"]
    cached_seen = 0
    for turn in range(3):
        for s, history in enumerate(sessions):
            got = chat(small, history, max_tokens=8)
            assert got.choices[0].message.content == chat(cold, history, max_tokens=8).choices[0].message.content, (
                s,
                turn,
            )
            cached_seen += got.usage.prompt_tokens_details.cached_tokens
            history += [
                {"role": "assistant", "content": got.choices[0].message.content or "ok"},
                {"role": "user", "content": f"Turn {turn} of session {s}: go on."},
            ]
    after = stats(small)
    assert after["num_evictions"] > evictions_before
    assert after["capacity_tokens"] == 512
    assert cached_seen > 0


def test_concurrent_shared_prefix_and_preemption(small, cold):
    """Eight concurrent requests on one system prompt through the small server (4 running, 512 tokens of KV, so
    long answers preempt each other): each answer equals cold's, and the shared prompt was reused."""
    messages = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Item {i}, briefly."}] for i in range(8)
    ]
    hits_before = stats(small)["num_hit_tokens"]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: chat(small, m, max_tokens=40), messages))
    for m, g in zip(messages, got, strict=True):
        assert g.choices[0].message.content == chat(cold, m, max_tokens=40).choices[0].message.content
    assert stats(small)["num_hit_tokens"] > hits_before


def test_n_choices_share_the_prompt(server, cold):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Three identical answers."}]
    before = stats(server)
    got = chat(server, messages, max_tokens=8, n=3)
    after = stats(server)
    prompt_blocks = got.usage.prompt_tokens // 16 * 16
    # The two later choices (at least) reuse the first one's full prompt blocks.
    assert after["num_hit_tokens"] - before["num_hit_tokens"] >= 2 * prompt_blocks
    texts = {c.message.content for c in got.choices}
    assert texts == {chat(cold, messages, max_tokens=8).choices[0].message.content}


def test_stats_counters(server):
    s = stats(server)
    assert s["enabled"] is True
    for key in (
        "num_lookups",
        "num_lookup_tokens",
        "num_hit_tokens",
        "num_evictions",
        "num_cached_blocks",
        "num_evictable_blocks",
        "capacity_tokens",
    ):
        assert isinstance(s[key], int) and s[key] >= 0, key
    assert s["num_lookups"] > 0 and s["capacity_tokens"] > 0
