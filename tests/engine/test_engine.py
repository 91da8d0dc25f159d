"""The engine core as a client sees it: `LLMEngine` and `AsyncEngine` on the tiny demo checkpoint (CPU, float32).

Every batching, preemption and chunking test compares against the same request run alone: continuous batching
must never change a greedy output. One model is loaded per module and shared by engines of different settings
(the model holds no per-request state; each engine has its own KV cache).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from conftest import PROMPTS, Model
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.llm_engine import LLMEngine, RequestError
from freetoken.engine.types import GenerationChunk, SamplingParams
from freetoken.models.demo import build_demo_checkpoint


@dataclass
class Result:
    """One request's stream, put together."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: list[GenerationChunk] = field(default_factory=list)

    @property
    def last(self) -> GenerationChunk:
        return self.chunks[-1]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kwargs.pop("ignore_eos", True), **kwargs)


def collect(engine: LLMEngine, results: dict[str, Result], on_step=None) -> dict[str, Result]:
    """Step `engine` until idle, appending every chunk to its request's result; `on_step(n)` runs after step n."""
    n = 0
    while engine.has_work():
        for o in engine.step():
            r = results.setdefault(o.request_id, Result())
            assert not r.chunks or r.last.finish_reason is None, f"{o.request_id}: output after its last chunk"
            r.chunks.append(o.chunk)
            r.token_ids.extend(o.chunk.token_ids)
            r.text += o.chunk.text
        n += 1
        if on_step is not None:
            on_step(n)
        assert n < 10_000, "engine does not make progress"
    return results


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return collect(engine, {})


def alone(demo: Model, prompt: list[int], params: SamplingParams) -> Result:
    return run(demo.engine(), {"x": (prompt, params)})["x"]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    """No block is held; each is either free or cached (and evictable), exactly once."""
    assert not engine.has_work()
    cache = engine.scheduler.prefix_cache
    assert cache.num_free == engine.kv.num_blocks
    assert all(cache.ref_count(b) == 0 for b in range(engine.kv.num_blocks))
    free, evictable = engine.kv.allocator._free, list(cache._evictable)
    assert len(set(free)) == len(free), "a block was freed twice"
    assert sorted(free + evictable) == list(range(engine.kv.num_blocks))


@pytest.fixture(scope="module")
def solo(demo) -> list[Result]:
    """Each prompt run alone, greedy, 12 tokens."""
    return [alone(demo, p, greedy()) for p in demo.prompts]


# --- continuous batching -----------------------------------------------------------------------------------------


def test_outputs_are_not_degenerate(solo):
    for r in solo:
        assert len(r.token_ids) == 12 and len(set(r.token_ids)) > 3
    assert len({tuple(r.token_ids) for r in solo}) == len(solo)


def test_batch_equals_alone(demo, solo):
    engine = demo.engine()
    batch_sizes = []
    engine_step = engine.step

    def step():
        out = engine_step()
        batch_sizes.append(len(out))
        return out

    engine.step = step
    results = run(engine, {str(i): (p, greedy()) for i, p in enumerate(demo.prompts)})
    assert max(batch_sizes) == len(demo.prompts), "requests did not decode in one batch"
    for i, r in enumerate(solo):
        assert results[str(i)].token_ids == r.token_ids
        assert results[str(i)].text == r.text
    assert_all_blocks_free(engine)


def test_request_joins_mid_decode(demo, solo):
    engine = demo.engine(kv_block_size=4)
    engine.add_request("0", demo.prompts[0], greedy())
    engine.add_request("1", demo.prompts[1], greedy())

    def on_step(n):
        if n == 5:
            assert engine.scheduler.running and not engine.scheduler.waiting
            engine.add_request("2", demo.prompts[2], greedy())
        if n == 8:
            engine.add_request("3", demo.prompts[3], greedy())

    results = collect(engine, {}, on_step)
    for i in range(4):
        assert results[str(i)].token_ids == solo[i].token_ids, i
    assert_all_blocks_free(engine)


def test_abort_mid_stream(demo, solo):
    engine = demo.engine(kv_block_size=4)
    for i in range(3):
        engine.add_request(str(i), demo.prompts[i], greedy())
    free_before = []

    def on_step(n):
        if n == 4:
            free_before.append(engine.scheduler.prefix_cache.num_free)
            owned = len(engine._seqs["1"].block_table)
            assert owned > 0
            engine.abort("1")
            assert engine.scheduler.prefix_cache.num_free == free_before[0] + owned
            engine.abort("1")  # twice: a no-op
            engine.abort("never-added")

    results = collect(engine, {}, on_step)
    assert results["0"].token_ids == solo[0].token_ids
    assert results["2"].token_ids == solo[2].token_ids
    assert len(results["1"].token_ids) < 12 and results["1"].last.finish_reason is None
    assert_all_blocks_free(engine)


def test_abort_waiting_request(demo, solo):
    engine = demo.engine(max_num_seqs=1)
    engine.add_request("0", demo.prompts[0], greedy())
    engine.add_request("1", demo.prompts[1], greedy())
    results: dict[str, Result] = {}

    def on_step(n):
        if n == 1:
            assert [s.request_id for s in engine.scheduler.waiting] == ["1"]
            engine.abort("1")

    collect(engine, results, on_step)
    assert list(results) == ["0"] and results["0"].token_ids == solo[0].token_ids
    assert_all_blocks_free(engine)


def test_preemption_keeps_outputs(demo):
    # 16 blocks of 4 tokens: each request needs up to 5 blocks (prompt + 12 tokens), six of them cannot fit.
    params = greedy(12)
    expected = [alone(demo, p, params).token_ids for p in demo.prompts]
    engine = demo.engine(kv_block_size=4, kv_cache_tokens=64)
    assert engine.kv.num_blocks == 16
    preempted = []
    preempt = engine.scheduler._preempt_last

    def counting_preempt():
        victim = preempt()
        preempted.append(victim)
        return victim

    engine.scheduler._preempt_last = counting_preempt
    results = run(engine, {str(i): (p, params) for i, p in enumerate(demo.prompts)})
    assert any(v is not None for v in preempted), "the cache was big enough; the test proves nothing"
    for i, tokens in enumerate(expected):
        assert results[str(i)].token_ids == tokens, i
        assert results[str(i)].last.finish_reason == "length"
    assert_all_blocks_free(engine)


def test_preemption_keeps_seeded_samples(demo):
    # Recomputing a preempted request must not redraw its RNG: seeded samples equal the request run alone.
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=i, ignore_eos=True) for i in range(6)]
    expected = [alone(demo, p, q).token_ids for p, q in zip(demo.prompts, params, strict=True)]
    engine = demo.engine(kv_block_size=4, kv_cache_tokens=64)
    results = run(engine, {str(i): (p, q) for i, (p, q) in enumerate(zip(demo.prompts, params, strict=True))})
    for i, tokens in enumerate(expected):
        assert results[str(i)].token_ids == tokens, i
    assert_all_blocks_free(engine)


def test_preemption_with_tiny_cache_and_long_outputs(demo):
    # The cache holds one full context (max_model_len is lowered to it); all requests still finish.
    params = greedy(30)
    expected = [run(demo.engine(max_model_len=48), {"x": (p, params)})["x"].token_ids for p in demo.prompts[:4]]
    engine = demo.engine(kv_block_size=4, kv_cache_tokens=48, max_prefill_tokens=5)
    assert engine.max_model_len == 48
    results = run(engine, {str(i): (p, params) for i, p in enumerate(demo.prompts[:4])})
    for i, tokens in enumerate(expected):
        assert results[str(i)].token_ids == tokens, i
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("max_prefill_tokens", [3, 4, 5])
def test_chunked_prefill(demo, solo, max_prefill_tokens):
    engine = demo.engine(max_prefill_tokens=max_prefill_tokens, kv_block_size=4)
    results = run(engine, {str(i): (p, greedy()) for i, p in enumerate(demo.prompts)})
    for i, r in enumerate(solo):
        assert results[str(i)].token_ids == r.token_ids, i
    assert_all_blocks_free(engine)


def test_max_num_seqs_one(demo, solo):
    engine = demo.engine(max_num_seqs=1)
    results = run(engine, {str(i): (p, greedy()) for i, p in enumerate(demo.prompts[:3])})
    for i in range(3):
        assert results[str(i)].token_ids == solo[i].token_ids


# --- finishing -----------------------------------------------------------------------------------------------------


def test_max_tokens_gives_length(demo):
    for n in (1, 2, 7):
        r = alone(demo, demo.prompts[0], greedy(n))
        assert len(r.token_ids) == n
        assert r.last.finish_reason == "length" and r.last.stop_reason is None
        assert r.last.num_output_tokens == n and r.last.num_prompt_tokens == len(demo.prompts[0])
        assert all(c.finish_reason is None for c in r.chunks[:-1])
    engine = demo.engine(kv_block_size=4)
    r = run(engine, {str(i): (p, greedy(1)) for i, p in enumerate(demo.prompts)})
    assert all(len(x.token_ids) == 1 and x.last.finish_reason == "length" for x in r.values())
    assert_all_blocks_free(engine)


def test_max_model_len_gives_length(demo, solo):
    prompt = demo.prompts[0]
    engine = demo.engine(max_model_len=len(prompt) + 5)
    r = run(engine, {"x": (prompt, greedy(100))})["x"]
    assert len(prompt) + len(r.token_ids) == len(prompt) + 5
    assert r.token_ids == solo[0].token_ids[:5]
    assert r.last.finish_reason == "length"
    # A prompt of max_model_len - 1 tokens gets exactly one token.
    r = run(engine, {"y": (prompt + [11] * 4, greedy(100))})["y"]
    assert len(r.token_ids) == 1 and r.last.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_demo(demo, solo, tmp_path_factory) -> tuple[Model, int]:
    """The same weights, with config.json's eos_token_id set to the 4th greedy token of prompt 0."""
    eos = solo[0].token_ids[3]
    assert eos not in solo[0].token_ids[:3]
    path = build_demo_checkpoint(tmp_path_factory.mktemp("eos"), seed=0, eos_token_id=eos)
    cfg = ModelConfig.from_dir(path)
    return Model(path, demo.model, cfg, demo.tokenizer, demo.prompts), eos


def test_eos_stops(eos_demo, solo):
    demo, eos = eos_demo
    r = run(demo.engine(), {"x": (demo.prompts[0], greedy(12, ignore_eos=False))})["x"]
    assert r.token_ids == solo[0].token_ids[:4]
    assert r.last.finish_reason == "stop" and r.last.stop_reason == eos
    assert r.text == demo.tokenizer.decode(solo[0].token_ids[:3], skip_special_tokens=True)
    assert demo.tokenizer.decode([eos]) not in r.text


def test_ignore_eos_runs_past_eos(eos_demo, solo):
    demo, _ = eos_demo
    r = run(demo.engine(), {"x": (demo.prompts[0], greedy(12, ignore_eos=True))})["x"]
    assert r.token_ids == solo[0].token_ids and r.last.finish_reason == "length"
    assert r.text == solo[0].text


def test_eos_from_config_via_from_dir(eos_demo, solo):
    demo, eos = eos_demo
    engine = LLMEngine.from_dir(demo.path, EngineConfig(device="cpu", dtype="float32", max_model_len=64))
    assert eos in engine.eos_ids
    r = run(engine, {"x": (demo.prompts[0], greedy(12, ignore_eos=False))})["x"]
    assert r.token_ids == solo[0].token_ids[:4] and r.last.stop_reason == eos


def test_stop_token_ids(demo, solo):
    stop_id = solo[1].token_ids[5]
    first = solo[1].token_ids.index(stop_id)
    r = alone(demo, demo.prompts[1], greedy(12, stop_token_ids=[stop_id, 7]))
    assert r.token_ids == solo[1].token_ids[: first + 1]
    assert r.last.finish_reason == "stop" and r.last.stop_reason == stop_id
    assert r.text == demo.tokenizer.decode(solo[1].token_ids[:first], skip_special_tokens=True)
    # ignore_eos does not ignore stop_token_ids
    r = alone(demo, demo.prompts[1], greedy(12, stop_token_ids=[stop_id], ignore_eos=True))
    assert r.last.stop_reason == stop_id


def _stop_cases(full: str) -> list[str]:
    """Stop strings cut from the middle of `full`: several characters long, spanning token boundaries."""
    cases = []
    for start in (len(full) // 3, len(full) // 2):
        for length in (2, 5, 9):
            s = full[start : start + length]
            if len(s) == length and s.strip():
                cases.append(s)
    return cases


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_stop_strings(demo, solo, index):
    full = solo[index].text
    assert len(full) > 20
    for stop in _stop_cases(full):
        r = alone(demo, demo.prompts[index], greedy(12, stop=["never-appears-xyz", stop]))
        cut = full.index(stop)
        assert r.text == full[:cut], stop
        assert r.last.finish_reason == "stop" and r.last.stop_reason == stop
        # The tokens stop at the one that completed the stop string.
        assert r.token_ids == solo[index].token_ids[: len(r.token_ids)]
        assert stop in demo.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert stop not in demo.tokenizer.decode(r.token_ids[:-1], skip_special_tokens=True)


def test_stop_string_prefix_that_never_completes_is_released(demo, solo):
    full = solo[0].text
    # Each stop string starts like the output's tail but never completes: the text held back for it comes out.
    for stop in (full[-3:] + "\x00never", full[-1:] + "\x00", full[len(full) // 2 :] + "!!zz"):
        r = alone(demo, demo.prompts[0], greedy(12, stop=[stop]))
        assert r.text == full and r.last.finish_reason == "length", stop


def test_stop_string_across_chunks_never_leaks(demo, solo):
    full = solo[4].text
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    r = alone(demo, demo.prompts[4], greedy(12, stop=[stop]))
    released = ""
    for chunk in r.chunks:
        released += chunk.text
        assert full.startswith(released)
        assert len(released) <= full.index(stop)
    assert released == full[: full.index(stop)]


def test_earliest_stop_string_wins(demo, solo):
    full = solo[3].text
    a, b = full[4:7], full[10:14]
    r = alone(demo, demo.prompts[3], greedy(12, stop=[b, a]))
    assert r.text == full[: full.index(a)] and r.last.stop_reason == a


def test_text_without_stop_equals_decode(demo, solo):
    for _prompt, r in zip(demo.prompts, solo, strict=True):
        assert r.text == demo.tokenizer.decode(r.token_ids, skip_special_tokens=True)


# --- sampling -------------------------------------------------------------------------------------------------------


def _sampled(demo: Model, seed: int | None, **kwargs) -> list[int]:
    params = SamplingParams(
        max_tokens=8, temperature=kwargs.pop("temperature", 1.0), seed=seed, ignore_eos=True, **kwargs
    )
    return alone(demo, demo.prompts[0], params).token_ids


def test_seed_is_deterministic(demo):
    a = _sampled(demo, 1234)
    assert _sampled(demo, 1234) == a
    assert _sampled(demo, 99) != a
    assert _sampled(demo, 1234, top_p=0.9, top_k=50) == _sampled(demo, 1234, top_p=0.9, top_k=50)


def test_seeded_sampling_is_independent_of_the_batch(demo):
    params = {
        str(s): (demo.prompts[s % 3], SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True))
        for s in range(5)
    }
    batched = run(demo.engine(), params)
    for rid, (prompt, p) in params.items():
        assert batched[rid].token_ids == alone(demo, prompt, p).token_ids


def test_top_k_1_is_greedy(demo, solo):
    assert _sampled(demo, 5, top_k=1) == solo[0].token_ids[:8]
    assert _sampled(demo, 5, temperature=0.0) == solo[0].token_ids[:8]
    assert _sampled(demo, 5, temperature=2.0, top_k=1) == solo[0].token_ids[:8]


def test_tiny_top_p_is_greedy(demo, solo):
    assert _sampled(demo, 5, top_p=1e-6) == solo[0].token_ids[:8]


def test_unseeded_requests_differ(demo):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    results = run(demo.engine(), {"a": (demo.prompts[0], params), "b": (demo.prompts[0], params)})
    assert results["a"].token_ids != results["b"].token_ids
    # The engine's seed fixes the RNG of requests without one, so a restarted engine repeats itself.
    assert _sampled(demo, None) == _sampled(demo, None)


# --- bad requests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field_name"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=2.5), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(seed=-(2**63) - 1), "seed"),
        (SamplingParams(max_tokens=None), "max_tokens"),  # type: ignore[arg-type]
        (SamplingParams(temperature="hot"), "temperature"),  # type: ignore[arg-type]
        (SamplingParams(stop="END"), "stop"),  # type: ignore[arg-type]
    ],
)
def test_bad_params_raise_request_error(demo, params, field_name):
    engine = demo.engine()
    with pytest.raises(RequestError, match=field_name):
        engine.add_request("x", demo.prompts[0], params)
    assert not engine.has_work() and engine.scheduler.prefix_cache.num_free == engine.kv.num_blocks


def test_bad_prompts_raise_request_error(demo):
    engine = demo.engine(max_model_len=32)
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request("x", [], greedy())
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("x", [5] * 32, greedy())
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("x", [5] * 1000, greedy())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("x", [5, demo.cfg.vocab_size], greedy())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("x", [-1, 5], greedy())
    engine.add_request("x", [5] * 31, greedy())  # the longest that fits
    with pytest.raises(RequestError, match="already"):
        engine.add_request("x", [5], greedy())
    assert len(collect(engine, {})["x"].token_ids) == 1


def test_stop_strings_without_tokenizer_raise(demo):
    engine = LLMEngine(demo.model, demo.cfg, EngineConfig(device="cpu", dtype="float32", max_model_len=64), None)
    with pytest.raises(RequestError, match="stop"):
        engine.add_request("x", [1, 2, 3], greedy(stop=["a"]))
    r = run(engine, {"y": ([1, 2, 3], greedy(3))})["y"]
    assert len(r.token_ids) == 3 and r.text == ""


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"kv_block_size": 0}, "--kv-block-size"),
        ({"max_prefill_tokens": 0}, "--max-prefill-tokens"),
        ({"max_model_len": -1}, "--max-model-len"),
        ({"kv_cache_gb": 0.0}, "--kv-cache-gb"),
        ({"kv_cache_tokens": 2, "kv_block_size": 4}, "--kv-cache-tokens"),
    ],
)
def test_bad_engine_config_is_refused(demo, kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        demo.engine(**kwargs)


# --- AsyncEngine ----------------------------------------------------------------------------------------------------


async def _agenerate(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id=None) -> Result:
    r = Result()
    async for chunk in engine.generate(prompt, params, request_id=request_id):
        r.chunks.append(chunk)
        r.token_ids.extend(chunk.token_ids)
        r.text += chunk.text
    return r


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_async_concurrent_equals_sequential(demo, solo):
    async def main():
        engine = AsyncEngine(demo.engine(), "demo")
        prompts = (demo.prompts * 2)[:8]
        try:
            concurrent = await asyncio.gather(*(_agenerate(engine, p, greedy()) for p in prompts))
            sequential = [await _agenerate(engine, p, greedy()) for p in prompts]
        finally:
            await engine.shutdown()
        return prompts, concurrent, sequential

    _, concurrent, sequential = asyncio.run(main())
    for i, (c, s) in enumerate(zip(concurrent, sequential, strict=True)):
        assert c.token_ids == s.token_ids == solo[i % len(solo)].token_ids
        assert c.text == s.text and c.last.finish_reason == "length"


def test_async_aclose_aborts_and_frees(demo):
    async def main():
        llm = demo.engine(kv_block_size=4)
        engine = AsyncEngine(llm, "demo")
        try:
            other = asyncio.create_task(_agenerate(engine, demo.prompts[1], greedy(40)))
            gen = engine.generate(demo.prompts[0], greedy(200), request_id="doomed")
            n = 0
            async for _ in gen:
                n += 1
                if n == 3:
                    break
            await gen.aclose()
            r = await other
            await _wait_for(lambda: engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"])
            assert "doomed" not in llm._seqs
            return r
        finally:
            await engine.shutdown()

    r = asyncio.run(main())
    assert len(r.token_ids) == 40 and r.last.finish_reason == "length"


def test_async_cancelled_task_aborts(demo):
    async def main():
        llm = demo.engine()
        engine = AsyncEngine(llm, "demo")
        try:
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate(demo.prompts[0], greedy(10_000), request_id="c"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_for(lambda: not llm.has_work())
            assert llm.scheduler.prefix_cache.num_free == llm.kv.num_blocks
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_async_request_error_surfaces(demo, solo):
    async def main():
        engine = AsyncEngine(demo.engine(max_model_len=32), "demo")
        try:
            with pytest.raises(RequestError, match="max_tokens"):
                await _agenerate(engine, demo.prompts[0], SamplingParams(max_tokens=0))
            with pytest.raises(RequestError, match="max_model_len"):
                await _agenerate(engine, [5] * 40, greedy())
            with pytest.raises(RequestError, match="seed"):
                await _agenerate(engine, demo.prompts[0], SamplingParams(seed=2**70))
            with pytest.raises(RequestError, match="max_tokens"):
                await _agenerate(engine, demo.prompts[0], SamplingParams(max_tokens=None))  # type: ignore[arg-type]
            # The engine still serves after refusing requests.
            return await _agenerate(engine, demo.prompts[0], greedy())
        finally:
            await engine.shutdown()

    assert asyncio.run(main()).token_ids == solo[0].token_ids


def test_async_duplicate_request_id_is_refused(demo, solo):
    async def main():
        engine = AsyncEngine(demo.engine(), "demo")
        try:
            first = asyncio.create_task(_agenerate(engine, demo.prompts[0], greedy(30), request_id="same"))
            await _wait_for(lambda: "same" in engine.engine._seqs)
            with pytest.raises(RequestError, match="already"):
                await _agenerate(engine, demo.prompts[1], greedy(), request_id="same")
            return await first
        finally:
            await engine.shutdown()

    r = asyncio.run(main())
    assert len(r.token_ids) == 30 and r.token_ids[:12] == solo[0].token_ids


def test_async_shutdown_aborts_running(demo):
    async def main():
        llm = demo.engine()
        engine = AsyncEngine(llm, "demo")
        results = [Result(), Result()]

        async def consume(i):
            async for chunk in engine.generate(demo.prompts[i], greedy(10_000)):
                results[i].chunks.append(chunk)
                results[i].token_ids.extend(chunk.token_ids)

        tasks = [asyncio.create_task(consume(i)) for i in range(2)]
        await _wait_for(lambda: all(r.chunks for r in results))
        await engine.shutdown()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert not llm.has_work() and llm.scheduler.prefix_cache.num_free == llm.kv.num_blocks
        return results

    for r in asyncio.run(main()):
        assert r.last.finish_reason == "abort"
        assert 0 < len(r.token_ids) < 10_000


def test_no_decoder_starves_under_a_small_token_budget(demo):
    """More requests than the per-step token budget: once a request decodes, it gets a token on every step until
    it ends (no gaps), and all finish. (Admissions only use the budget the decoders leave, so decoders never
    outnumber the budget.)"""
    engine = demo.engine(max_prefill_tokens=2, max_num_seqs=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), [5 + i, 6, 7], params)
    steps_with_token: dict[str, list[int]] = {}
    step = 0
    while engine.has_work():
        step += 1
        for o in engine.step():
            steps_with_token.setdefault(o.request_id, []).append(step)
    assert sorted(steps_with_token) == [str(i) for i in range(6)]
    for steps in steps_with_token.values():
        assert steps == list(range(steps[0], steps[0] + 4)), steps


@pytest.mark.parametrize("reasoning_tags", [("<think>", "</think>"), ("", "</think>")])
def test_stop_strings_skip_the_reasoning_block(demo, reasoning_tags):
    """With reasoning tags, a stop string inside the reasoning does not end the output, and one that overlaps the
    closing tag leaves no piece of it behind; after the block, stop strings apply as usual."""
    from freetoken.engine.stop import OutputText

    tokenizer = demo.tokenizer
    opening = reasoning_tags[0] + "\n" if reasoning_tags[0] else ""
    text = opening + "I could say STOP or </ here.\n</think>\n\nThe answer STOP is cut."
    stop = ["STOP", "</", "k>\n\nThe"]
    ids = tokenizer.encode(text)
    for tags, expected in [
        (reasoning_tags, opening + "I could say STOP or </ here.\n</think>\n\nThe answer "),
        (None, opening + "I could say "),
    ]:
        released, matched = "", None
        output = OutputText(tokenizer, tokenizer.encode("hi"), stop, tags)
        for token in ids:
            piece, matched = output.push([token])
            released += piece
            if matched is not None:
                break
        assert (released, matched) == (expected, "STOP")


def step_to_the_end(engine: LLMEngine, step: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Step `engine` until idle, counting steps on from `step`: (request id -> the step of its first token, request
    id -> its tokens)."""
    first_token: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        step += 1
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.chunk.token_ids)
            if o.chunk.token_ids:
                first_token.setdefault(o.request_id, step)
    return first_token, tokens


def test_a_short_request_is_not_queued_behind_a_long_prompt(demo):
    """A request that arrives while a long prompt is prefilled in budget-sized chunks joins the next step, its prompt
    in the room the long one leaves, instead of waiting for all of it (`Scheduler._short_arrivals`); a waiting prompt
    as long as the running one gets no room. Both answers equal each one alone."""
    budget = 16
    engine = demo.engine(max_prefill_tokens=budget, max_num_seqs=4)
    long_prompt = [(7 * i) % 50 + 3 for i in range(8 * budget)]
    short_prompt, params = [5, 6, 7], greedy(max_tokens=3)
    engine.add_request("long", long_prompt, params)
    engine.step()  # the long prompt's first chunk
    engine.add_request("short", short_prompt, params)
    engine.add_request("other-long", long_prompt[::-1], params)
    first_token, tokens = step_to_the_end(engine, 1)
    assert first_token["short"] == 2, first_token  # the step right after it arrived
    assert first_token["long"] == 8 + 1, first_token  # one more step than alone: the short prompt's room
    assert first_token["other-long"] > first_token["long"], first_token  # no room for a prompt as long
    for rid, prompt in (("long", long_prompt), ("short", short_prompt), ("other-long", long_prompt[::-1])):
        assert tokens[rid] == alone(demo, prompt, params).token_ids, rid


def test_a_mostly_cached_prompt_gets_room_beside_a_long_prefill(demo):
    """A long prompt whose prefix is cached (an agent's next turn) needs only its new tokens: it joins the step after
    it arrives, beside a long prompt being prefilled, and answers as alone."""
    budget = 16
    engine = demo.engine(max_prefill_tokens=budget, max_num_seqs=4)
    history = [(5 * i) % 40 + 3 for i in range(6 * budget)]
    params = greedy(max_tokens=3)
    run(engine, {"turn-1": (history, params)})  # its blocks are now cached
    engine.add_request("other", [(11 * i) % 60 + 2 for i in range(8 * budget)], params)
    engine.step()
    next_turn = history + [7, 8, 9]
    engine.add_request("turn-2", next_turn, params)
    first_token, tokens = step_to_the_end(engine, 1)
    assert first_token["turn-2"] == 2, first_token
    assert tokens["turn-2"] == alone(demo, next_turn, params).token_ids
