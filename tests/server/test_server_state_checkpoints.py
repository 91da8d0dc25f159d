"""Recurrent-state checkpoints through a real `ft serve` on the Qwen3.5 demo checkpoint (CPU): reuse is reported
in every API's usage and in /v1/stats, and every answer at temperature 0 is the text of a server started with
`--state-checkpoints off` (which prefills every hybrid prompt in full).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from conftest import ServerProcess, start_server
from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

SYSTEM = (
    "You are a coding agent inside a repository. Use the tools, answer briefly, cite file names. The repository "
    "holds a Rust core and a Python engine; its tests run on the CPU."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_qwen3_5_demo_checkpoint(tmp_path_factory.mktemp("qwen35-serve"), seed=0)


@pytest.fixture(scope="module")
def marks(tmp_path_factory, model_dir) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("marks"), "--max-model-len", "2048", model_dir=model_dir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cold(tmp_path_factory, model_dir) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("cold"), "--max-model-len", "2048", "--state-checkpoints", "off", model_dir=model_dir
    )
    yield proc
    proc.stop()


def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300.0)


def chat(server: ServerProcess, messages: list[dict], max_tokens: int = 8, **kwargs):
    return oai(server).chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, tools=TOOLS, **kwargs
    )


def stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/stats", timeout=30).json()["state_checkpoints"]


def history(turn: int, tag: str = "") -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM + tag}, {"role": "user", "content": "What does engine.py do?"}]
    for t in range(turn):
        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": '{"path": "e.py"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": f"c{t}", "content": f"def step_{t}(self):\n    return self.run()\n"},
        ]
    return messages


def test_follow_up_turns_report_cached_tokens_and_equal_cold(marks, cold):
    before = stats(marks)
    for turn in range(3):
        messages = history(turn)
        got = chat(marks, messages)
        assert got.choices[0].message.content == chat(cold, messages).choices[0].message.content, turn
        cached = got.usage.prompt_tokens_details.cached_tokens
        if turn:  # the previous turn's prompt end (at least) is a snapshot of this prompt's prefix
            assert 0 < cached < got.usage.prompt_tokens
    after = stats(marks)
    assert after["num_restores"] >= before["num_restores"] + 2
    assert after["num_restored_tokens"] > before["num_restored_tokens"]
    assert after["mode"] == "marks" and after["num_live"] > 0 and after["bytes_live"] > 0
    assert {"num_evicted", "num_invalidated", "bytes_budget", "num_snapshots"} <= set(after)
    assert "state_checkpoints" not in httpx.get(cold.base_url + "/v1/stats", timeout=30).json()
    # The same counters for Prometheus.
    samples = dict(
        line.rsplit(" ", 1)
        for line in httpx.get(marks.base_url + "/metrics", timeout=30).text.splitlines()
        if line.startswith("freetoken_state_checkpoint")
    )
    assert float(samples["freetoken_state_checkpoint_restores_total"]) >= after["num_restores"]
    assert float(samples["freetoken_state_checkpoint_live"]) > 0


def test_responses_and_anthropic_report_cached_tokens(marks, cold):
    # Two inputs under one system prompt (instructions): the second resumes at the system message's end mark.
    client = oai(marks)
    kwargs = {"model": "m", "instructions": SYSTEM, "max_output_tokens": 6, "temperature": 0}
    client.responses.create(input="Which usage fields does each API report?", **kwargs)
    again = client.responses.create(input="And which does Responses report?", **kwargs)
    assert again.usage.input_tokens_details.cached_tokens > 0
    reference = oai(cold).responses.create(input="And which does Responses report?", **kwargs)
    assert reference.usage.input_tokens_details.cached_tokens == 0
    assert again.output_text == reference.output_text
    messages = [{"role": "user", "content": SYSTEM + " And the Messages API?"}]
    ant = anthropic.Anthropic(base_url=marks.base_url, api_key="unused", max_retries=0, timeout=300.0)
    ant.messages.create(model="m", messages=messages, max_tokens=4, extra_body={"temperature": 0})
    follow = messages + [{"role": "assistant", "content": "Usage."}, {"role": "user", "content": "More?"}]
    got = ant.messages.create(model="m", messages=follow, max_tokens=6, extra_body={"temperature": 0})
    assert got.usage.cache_read_input_tokens > 0
    ref = anthropic.Anthropic(base_url=cold.base_url, api_key="unused", max_retries=0, timeout=300.0).messages.create(
        model="m", messages=follow, max_tokens=6, extra_body={"temperature": 0}
    )
    assert ref.usage.cache_read_input_tokens == 0
    assert got.content[0].text == ref.content[0].text


def test_concurrent_and_n_choices_equal_cold(marks, cold):
    messages = [history(1, tag=f" Session {i}.") for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda m: chat(marks, m), messages))
    for m, g in zip(messages, got, strict=True):
        assert g.choices[0].message.content == chat(cold, m).choices[0].message.content
    choices = chat(marks, messages[0], n=2)
    assert {c.message.content for c in choices.choices} == {got[0].choices[0].message.content}


def test_aborted_stream_leaves_answers_exact(marks, cold):
    messages = history(2, tag=" Aborted.")
    with httpx.stream(
        "POST",
        marks.base_url + "/v1/chat/completions",
        timeout=300,
        json={
            "model": "m",
            "messages": messages,
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "tools": TOOLS,
        },
    ) as response:
        for _ in response.iter_lines():
            break  # the client goes away after the first event
    follow = messages + [{"role": "user", "content": "Go on."}]
    assert chat(marks, follow).choices[0].message.content == chat(cold, follow).choices[0].message.content
    assert chat(marks, messages).choices[0].message.content == chat(cold, messages).choices[0].message.content
