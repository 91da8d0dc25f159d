"""Token log-probabilities (`SamplingParams.logprobs`): the engine's against transformers' own on the CPU in
float32, sorted and consistent top-N, the same batched as alone, through the eager and the decode-runner paths,
and the parameter's validation."""

from __future__ import annotations

import os

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.cuda_graph import WholeStepRunner
from freetoken.engine.llm_engine import LLMEngine, RequestError
from freetoken.engine.sampler import token_logprobs
from freetoken.engine.types import GenerationChunk, SamplingParams
from reference import make_reference_checkpoint

PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8]]
NUM_TOKENS = 6
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs")
    model = make_reference_checkpoint(path, seed=3)
    return path, model


def _engine(path, **kwargs) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend="fused", **kwargs)
    return LLMEngine.from_dir(path, cfg)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationChunk]]:
    """Every prompt in one batch; each request's chunks in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[GenerationChunk]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append(o.chunk)
    return [out[str(i)] for i in range(len(prompts))]


def _reference_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: transformers' log_softmax of its own logits at each generated position."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def _flat(chunks: list[GenerationChunk]):
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    return tokens, logprobs


def _check_against_reference(model, prompt, tokens, logprobs, n: int) -> None:
    expected = _reference_logprobs(model, prompt, tokens)
    for i, lp in enumerate(logprobs):
        assert abs(lp.logprob - expected[i, lp.token_id].item()) <= TOL
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        ref_top = torch.topk(expected[i], n)
        assert all(abs(v - r) <= TOL for v, r in zip(values, ref_top.values.tolist(), strict=True))
        for token_id, value in lp.top:
            assert abs(value - expected[i, token_id].item()) <= TOL
        # The sampled token's entry agrees with its own logprob; no alternative beats the top one.
        assert all(abs(v - lp.logprob) <= TOL for t, v in lp.top if t == lp.token_id)
        if n:
            assert lp.logprob <= values[0] + TOL


def test_greedy_logprobs_match_transformers(checkpoint):
    path, model = checkpoint
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt in PROMPTS:
        [chunks] = _run(_engine(path), [prompt], params)
        tokens, logprobs = _flat(chunks)
        assert len(tokens) == NUM_TOKENS
        _check_against_reference(model, prompt, tokens, logprobs, 5)
        for lp in logprobs:  # greedy: the sampled token is the most likely one
            assert lp.top[0][0] == lp.token_id and lp.top[0][1] == lp.logprob


def test_sampled_logprobs_are_the_models_not_the_samplers(checkpoint):
    """Temperature and top-k change which token is drawn, not the reported (raw) distribution."""
    path, model = checkpoint
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.7, top_k=3, seed=5, ignore_eos=True, logprobs=3)
    [chunks] = _run(_engine(path), [PROMPTS[0]], params)
    tokens, logprobs = _flat(chunks)
    _check_against_reference(model, PROMPTS[0], tokens, logprobs, 3)


def test_batched_equals_alone_and_only_askers_pay(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=4)
    alone = [_flat(_run(_engine(path), [p], params)[0]) for p in PROMPTS]
    batched = [_flat(c) for c in _run(_engine(path, max_prefill_tokens=4, kv_block_size=4), PROMPTS, params)]
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(alone, batched, strict=True):
        assert tokens_a == tokens_b
        for a, b in zip(lps_a, lps_b, strict=True):
            assert abs(a.logprob - b.logprob) <= TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= TOL for (_, x), (_, y) in zip(a.top, b.top, strict=True))
    # A request without logprobs beside one with them: None for it, top-0 gives the token's logprob alone.
    engine = _engine(path)
    engine.add_request("off", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request("zero", PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))
    seen = {"off": 0, "zero": 0}
    while engine.has_work():
        for o in engine.step():
            seen[o.request_id] += 1
            if o.request_id == "off":
                assert o.chunk.logprobs is None
            else:
                [lp] = o.chunk.logprobs
                assert lp.top == [] and lp.logprob <= 0.0
    assert seen == {"off": 2, "zero": 2}


def test_token_logprobs_rows():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 1.0], [1.0, 1.0, 5.0]])
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=1)]
    got = token_logprobs(logits, params, [0, 0, 2])
    expected = torch.log_softmax(logits, dim=-1)
    assert got[1] is None
    assert got[0].token_id == 0 and abs(got[0].logprob - expected[0, 0].item()) < 1e-6
    assert [t for t, _ in got[0].top] == [2, 1]
    assert [t for t, _ in got[2].top] == [2] and got[2].top[0][1] == got[2].logprob
    assert token_logprobs(logits, [SamplingParams()] * 3, [0, 0, 0]) == [None, None, None]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter (conftest sets it without a GPU)",
)
def test_decode_runner_path_reports_the_same_logprobs(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = _flat(_run(_engine(path), [PROMPTS[0]], params)[0])
    engine = _engine(path, max_num_seqs=2, kv_block_size=4)
    runner = engine.runner
    runner.decode = WholeStepRunner(runner.model, engine.kv, 2, engine.max_model_len, use_graphs=False)
    got = _flat(_run(engine, [PROMPTS[0]], params)[0])
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1], strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("value", [-1, 21, True, "3", 2.0])
def test_bad_logprobs_is_a_request_error(checkpoint, value):
    path, _ = checkpoint
    engine = _engine(path)
    with pytest.raises(RequestError, match=r"^logprobs"):
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=1, logprobs=value))


def test_token_text_and_bytes(demo_tokenizer):
    ids = demo_tokenizer.encode("héllo 世界 😀")
    assert b"".join(map(demo_tokenizer.token_bytes, ids)) == "héllo 世界 😀".encode()
    # A byte-level piece that is part of a multi-byte character: its raw byte, its text U+FFFD.
    piece = demo_tokenizer.token_to_id("Ã")
    assert demo_tokenizer.token_bytes(piece) == b"\xc3" and demo_tokenizer.token_text(piece) == "\ufffd"
    end = demo_tokenizer.token_to_id("<|im_end|>")
    assert demo_tokenizer.token_text(end) == "<|im_end|>" and demo_tokenizer.token_bytes(end) == b"<|im_end|>"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_logprobs_equal_cpu(checkpoint):
    """On CUDA the decode steps replay CUDA graphs; their logits (a static buffer) give the CPU's logprobs."""
    path, _ = checkpoint
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    engine = LLMEngine.from_dir(
        path, EngineConfig(device="cuda", dtype="float32", kv_cache_gb=0.5, moe_backend="fused")
    )
    assert isinstance(engine.runner.decode, WholeStepRunner) and engine.runner.decode.captured
    got = [_flat(c) for c in _run(engine, PROMPTS, params)]
    expected = [_flat(c) for c in _run(_engine(path), PROMPTS, params)]
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(got, expected, strict=True):
        assert tokens_a == tokens_b
        for a, b in zip(lps_a, lps_b, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-3
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: transformers' log_softmax at each prompt position but the last (it predicts the next)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check_prompt_logprobs(model, prompt: list[int], entries, n: int) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    expected = _prompt_reference(model, prompt)
    for p, lp in enumerate(entries[1:]):
        assert lp.token_id == prompt[p + 1]
        assert abs(lp.logprob - expected[p, lp.token_id].item()) <= TOL
        ref = torch.topk(expected[p], n)
        assert [t for t, _ in lp.top] == ref.indices.tolist() or n == 0
        assert all(abs(v - r) <= TOL for (_, v), r in zip(lp.top, ref.values.tolist(), strict=True))


@pytest.mark.parametrize("max_prefill_tokens", [8192, 3])
def test_prompt_logprobs_match_transformers(checkpoint, max_prefill_tokens):
    """`prompt_logprobs`: one entry per prompt token (None first), on the first chunk only, equal to transformers'
    log_softmax at the position before each token; with the prompt in one step and in chunks of 3 tokens (chunk
    boundaries inside and at the prompt's end, batched with another sequence)."""
    path, model = checkpoint
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    engine = _engine(path, max_prefill_tokens=max_prefill_tokens, kv_block_size=4)
    for prompt, chunks in zip(PROMPTS, _run(engine, PROMPTS, params), strict=True):
        _check_prompt_logprobs(model, prompt, chunks[0].prompt_logprobs, 2)
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        _check_against_reference(model, prompt, *_flat(chunks), 2)
    [one] = _run(_engine(path), [[PROMPTS[0][0]]], params)  # a one-token prompt: only the None entry
    assert one[0].prompt_logprobs == [None]
    [plain] = _run(_engine(path), [PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, logprobs=1))
    assert all(c.prompt_logprobs is None for c in plain)


def test_prompt_logprobs_prefill_past_the_prefix_cache(checkpoint):
    """A cached prompt is prefilled again for a request that asks for its prompt's log-probabilities (the cached
    K/V has no logits), which come out the same; a request that does not ask still reuses the cache."""
    path, model = checkpoint
    engine = _engine(path, kv_block_size=4)
    prompt = PROMPTS[1]
    greedy = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    [first] = _run(engine, [prompt], SamplingParams(**greedy))
    [asks] = _run(engine, [prompt], SamplingParams(**greedy, prompt_logprobs=1))
    assert asks[0].num_cached_tokens == 0
    _check_prompt_logprobs(model, prompt, asks[0].prompt_logprobs, 1)
    [again] = _run(engine, [prompt], SamplingParams(**greedy))
    assert again[0].num_cached_tokens > 0
    assert [c.token_ids for c in first] == [c.token_ids for c in asks] == [c.token_ids for c in again]


def test_prompt_logprobs_validation():
    for bad in (21, -1, True, 1.0):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()
    SamplingParams(prompt_logprobs=0).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prompt_logprobs_in_one_token_chunks(checkpoint):
    """On CUDA, prompt chunks of one token batched with decoding sequences would fit the decode runner, which keeps
    only each sequence's last logits: a sequence that needs its prompt's log-probabilities runs eagerly instead, and
    gets transformers' values (float32)."""
    path, model = checkpoint
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    engine = LLMEngine.from_dir(
        path, EngineConfig(device="cuda", dtype="float32", kv_cache_gb=0.5, moe_backend="fused", max_prefill_tokens=2)
    )
    assert engine.runner.decode is not None
    for prompt, chunks in zip(PROMPTS, _run(engine, PROMPTS, params), strict=True):
        entries = chunks[0].prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        expected = _prompt_reference(model, prompt)
        for p, lp in enumerate(entries[1:]):
            assert lp.token_id == prompt[p + 1] and abs(lp.logprob - expected[p, lp.token_id].item()) <= 1e-3
