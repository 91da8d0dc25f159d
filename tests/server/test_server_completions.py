"""OpenAI text completions (``POST /v1/completions``) against a real `ft serve` process, through the SDK."""

from __future__ import annotations

from conftest import SERVED_MODEL_NAME

PROMPT = "def fibonacci(n):"


def test_shape_and_usage(openai_client, demo_tokenizer):
    response = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == SERVED_MODEL_NAME
    [choice] = response.choices
    assert choice.index == 0 and isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens == len(demo_tokenizer.encode(PROMPT))
    assert 1 <= response.usage.completion_tokens <= 5
    default = openai_client.completions.create(model="m", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the API's default max_tokens

    ids = demo_tokenizer.encode(PROMPT)
    by_ids = openai_client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == choice.text
    echoed = openai_client.completions.create(model="m", prompt=[PROMPT], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + choice.text


def test_streaming_matches(openai_client):
    full = openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        openai_client.completions.create(
            model="m", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_bad_bodies_are_400(http):
    for body, param in [
        ({"model": "m", "max_tokens": 1}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"], "max_tokens": 1}, "prompt"),
        ({"model": "m", "prompt": [1, 10**9], "max_tokens": 1}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ]:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param
