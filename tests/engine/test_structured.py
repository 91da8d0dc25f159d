"""Grammar-constrained sampling (`engine.structured` through `engine.sampler.sample_with_logprobs`), with the demo
model's real tokenizer and random logits: whatever the logits, the output parses and matches the schema."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from freetoken.engine.sampler import sample_with_logprobs
from freetoken.engine.structured import (
    GrammarBackend,
    GrammarError,
    apply_grammar_masks,
    json_grammar,
)
from freetoken.engine.types import SamplingParams
from schemas import CARD_SCHEMA as SCHEMA


@pytest.fixture(scope="module")
def grammars():
    from freetoken.config import ModelConfig
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.tokenizer import Tokenizer

    model_dir = demo_checkpoint_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = sorted(set(tokenizer.eos_token_ids) | set(ModelConfig.from_dir(model_dir).eos_token_ids))
    backend = GrammarBackend(tokenizer, ModelConfig.from_dir(model_dir).vocab_size, eos)
    backend.ll_tokenizer()  # built once for the module (seconds), not inside a timed test
    return backend, tokenizer


def _generate(backend, batch: list[SamplingParams], seed: int, max_steps: int = 200):
    """Sample every row from random logits until it draws EOS; return each row's tokens (EOS excluded)."""
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in batch]
    done = [False] * len(batch)
    generators = [None if p.greedy else torch.Generator().manual_seed(seed + i) for i, p in enumerate(batch)]
    for _ in range(max_steps):
        live = [i for i in range(len(batch)) if not done[i]]
        if not live:
            break
        logits = torch.randn(len(live), backend.vocab_size, generator=gen) * 4
        tokens, _ = sample_with_logprobs(logits, [batch[i] for i in live], [generators[i] for i in live])
        for i, token in zip(live, tokens, strict=True):
            if token in backend.eos_token_ids:
                done[i] = True
            else:
                outputs[i].append(token)
    assert all(done), "a constrained row never reached EOS"
    return outputs


def test_random_logits_give_schema_valid_json(grammars):
    backend, tokenizer = grammars
    grammar = json_grammar(SCHEMA)
    batch = [
        SamplingParams(temperature=1.0, grammar=backend.matcher(grammar)),
        SamplingParams(temperature=0.0, grammar=backend.matcher(grammar)),
        SamplingParams(temperature=1.0, grammar=backend.matcher(json_grammar({"type": "boolean"}))),
    ]
    outputs = _generate(backend, batch, seed=1)
    for params, tokens in zip(batch, outputs, strict=True):
        value = json.loads(tokenizer.decode(tokens))
        if params is batch[2]:
            assert isinstance(value, bool)
        else:
            jsonschema.validate(value, SCHEMA)


def test_mask_cost_per_token(grammars):
    """The grammar's cost on one row, per token of a whole generation: the mask (llguidance) plus applying it
    to the logits (on the CPU here). Printed; the bound only catches a pathological regression."""
    backend, _ = grammars
    matcher = backend.matcher(json_grammar(SCHEMA))
    gen = torch.Generator().manual_seed(3)
    times = []
    while True:
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        start = time.perf_counter()
        masked = apply_grammar_masks(logits, [matcher])
        times.append(time.perf_counter() - start)
        token = int(torch.argmax(masked[0]))
        if token in backend.eos_token_ids:
            break
        matcher.accept(token)
    mean_ms = sum(times) / len(times) * 1e3
    print(
        f"grammar mask + apply, 1 row, V={backend.vocab_size}: {mean_ms:.2f} ms/token mean, "
        f"{max(times) * 1e3:.2f} ms max, over {len(times)} tokens"
    )
    assert mean_ms < 1000  # a loose bound: tests share 2 cores with other work


def test_unconstrained_rows_are_untouched_and_logprobs_raw(grammars):
    backend, _ = grammars
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, backend.vocab_size, generator=gen)
    before = logits.clone()
    free = SamplingParams(temperature=0.0, logprobs=0)
    constrained = SamplingParams(temperature=0.0, logprobs=0, grammar=backend.matcher(json_grammar(SCHEMA)))
    assert apply_grammar_masks(logits, [None, None]) is logits  # no grammar in the batch: no copy, no work
    tokens, logprobs = sample_with_logprobs(logits, [free, constrained], [None, None])
    assert torch.equal(logits, before)  # not written
    assert tokens[0] == int(torch.argmax(logits[0]))
    assert tokens[1] != int(torch.argmax(logits[1])) or logits[1].argmax() == tokens[1]
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        assert logprobs[row].logprob == pytest.approx(float(raw[row, tokens[row]]), abs=1e-5)


def test_forks_are_independent(grammars):
    backend, tokenizer = grammars
    first = backend.matcher(json_grammar({"type": "string", "maxLength": 4}))
    second = first.fork()
    for token in tokenizer.encode('"ab"'):
        first.accept(token)
    assert first.is_accepting and not second.is_accepting  # the fork stayed at the start
    ids = tokenizer.encode('"cd"')
    assert second.matcher.try_consume_tokens(ids) == len(ids)


def test_invalid_schema_is_a_grammar_error(grammars):
    backend, _ = grammars
    with pytest.raises(GrammarError, match="strin"):
        backend.matcher(json_grammar({"type": "strin"}))
    with pytest.raises(GrammarError):
        backend.matcher(json_grammar({"properties": {"a": {"$ref": "#/nowhere"}}}))


def test_error_state_allows_only_eos(grammars):
    backend, tokenizer = grammars
    matcher = backend.matcher(json_grammar({"type": "boolean"}))
    matcher.accept(tokenizer.encode("x")[0])  # refused: the matcher is now in its error state
    assert matcher.matcher.is_error()
    masked = apply_grammar_masks(torch.zeros(1, backend.vocab_size), [matcher])
    assert set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist()) == set(backend.eos_token_ids)


SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "shell",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "maxLength": 8}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calls_or_answer(grammars):
    """With tools offered, the output is the JSON answer or Qwen3 tool calls whose arguments match the tool's
    schema; the first token is pushed towards ``<tool_call>`` in one run and away in the other, so both branches
    are taken."""
    from freetoken.server.parsers import ParserOptions, parse_text
    from freetoken.server.parsers.qwen3 import TOOL_OPEN, Qwen3Parser

    backend, tokenizer = grammars
    options = ParserOptions(prompt_text="<think>\n\n</think>\n\n", parse_tools=True)
    grammar = json_grammar(
        SCHEMA, Qwen3Parser(options).reasoning_grammar(), Qwen3Parser(options).tool_calls_grammar([SHELL_TOOL])
    )
    tool_open = tokenizer.token_to_id(TOOL_OPEN)
    for push_call in (False, True):
        matcher = backend.matcher(grammar)
        gen = torch.Generator().manual_seed(4)
        tokens: list[int] = []
        for _ in range(300):
            logits = torch.randn(1, backend.vocab_size, generator=gen) * 4
            if not tokens:
                logits[0, tool_open] += 100 if push_call else -100
            (token,), _ = sample_with_logprobs(
                logits, [SamplingParams(seed=1, grammar=matcher)], [torch.Generator().manual_seed(len(tokens))]
            )
            if token in backend.eos_token_ids:
                break
            tokens.append(token)
        else:
            pytest.fail("no EOS within 300 tokens")
        output = parse_text(Qwen3Parser(options), tokenizer.decode(tokens))
        if push_call:
            assert output.tool_calls and not output.content.strip(), output
            for call in output.tool_calls:
                assert call.name == "shell"
                jsonschema.validate(json.loads(call.arguments), SHELL_TOOL["function"]["parameters"])
        else:
            assert not output.tool_calls
            jsonschema.validate(json.loads(output.content), SCHEMA)
