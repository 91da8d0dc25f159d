"""Backpressure in `AsyncEngine`: a stream whose reader stops is paused after `stream_buffer_chunks` unread
chunks (out of the batch, KV blocks kept), resumes when read, and is aborted and freed after
`stream_pause_timeout_s` (issue 20: a client reading nothing had its whole output generated and buffered)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint
from freetoken.models.loader import load_checkpoint
from freetoken.moe import FusedExperts
from freetoken.tokenizer import Tokenizer

BUFFER = 8


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=0)
    cfg = ModelConfig.from_dir(path)
    model = load_checkpoint(path, FusedExperts(), torch.device("cpu"), torch.float32, cfg=cfg)
    tokenizer = Tokenizer.from_dir(path)

    def engine(**kwargs) -> LLMEngine:
        cfg_kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": 256, **kwargs}
        return LLMEngine(model, cfg, EngineConfig(**cfg_kwargs), tokenizer)

    return engine, tokenizer.encode("Once upon a time, in a land far away, there lived a")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _tokens(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for chunk in engine.generate(prompt, params) for t in chunk.token_ids]


def test_a_reader_that_stops_pauses_its_request_and_resumes_it(demo):
    make, prompt = demo

    async def main():
        llm = make(stream_buffer_chunks=BUFFER)
        engine = AsyncEngine(llm, "demo")
        try:
            alone = await _tokens(engine, prompt, greedy(60))
            slow = engine.generate(prompt, greedy(60), request_id="slow")
            tokens = list((await slow.__anext__()).token_ids)
            # The reader stops: the request is paused with at most BUFFER chunks unread, and the engine keeps
            # serving other requests meanwhile.
            await _wait_for(lambda: engine.stats().get("num_paused") == 1)
            other = await _tokens(engine, prompt, greedy(30))
            assert len(other) == 30
            generated = llm._seqs["slow"].num_output
            assert generated <= BUFFER + 1, generated
            assert llm._seqs["slow"].block_table, "a paused request keeps its KV blocks"
            async for chunk in slow:
                tokens.extend(chunk.token_ids)
            assert chunk.finish_reason == "length"
            assert tokens == alone
            await _wait_for(lambda: engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"])
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_paused_too_long_is_aborted_and_freed(demo):
    make, prompt = demo

    async def main():
        llm = make(stream_buffer_chunks=BUFFER, stream_pause_timeout_s=0.5)
        engine = AsyncEngine(llm, "demo")
        try:
            stalled = engine.generate(prompt, greedy(200), request_id="stalled")
            await stalled.__anext__()
            await _wait_for(lambda: "stalled" not in llm._seqs)
            await _wait_for(lambda: engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"])
            assert engine.stats()["num_paused"] == 0
            chunks = [chunk async for chunk in stalled]
            assert chunks[-1].finish_reason == "abort"
            assert sum(len(c.token_ids) for c in chunks) <= BUFFER + 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_small_request_does_not_wait_for_a_large_ones_choices(demo):
    """4 batch slots; a request of 4 choices (one group) of 120 tokens takes them all, then a 4-token request
    comes: it starts within a few steps (one of the large request's sequences is preempted for it), not after
    the large one; the large one's outputs are still whole."""
    make, prompt = demo

    async def main():
        llm = make(max_num_seqs=4)
        engine = AsyncEngine(llm, "demo")
        first_token_step: list[int] = []
        try:

            async def choice(i: int) -> int:
                tokens = await _tokens_of(engine.generate(prompt, greedy(120), request_id=f"big-{i}", group="big"))
                return llm.num_steps if tokens == 120 else -1

            async def small() -> None:
                async for _ in engine.generate(prompt, greedy(4), request_id="small"):
                    if not first_token_step:
                        first_token_step.append(llm.num_steps)

            big = [asyncio.create_task(choice(i)) for i in range(4)]
            await asyncio.sleep(0)  # the big request's choices are queued first
            await small()
            big_done = await asyncio.gather(*big)
        finally:
            await engine.shutdown()
        return first_token_step[0], min(big_done)

    small_first, big_first_done = asyncio.run(main())
    assert small_first <= 5 < big_first_done, (small_first, big_first_done)


async def _tokens_of(chunks) -> int:
    return sum([len(chunk.token_ids) async for chunk in chunks])


def test_idle_after_work_gives_memory_back(demo, monkeypatch):
    """Once idle for IDLE_TRIM_AFTER_S after work, the engine thread releases freed memory once (not while idle)."""
    from freetoken.engine import async_engine

    calls: list[float] = []
    monkeypatch.setattr(async_engine, "release_free_memory", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr(async_engine, "IDLE_TRIM_AFTER_S", 0.3)
    make, prompt = demo

    async def main():
        engine = AsyncEngine(make(), "demo")
        try:
            await _tokens(engine, prompt, greedy(4))
            done = time.monotonic()
            await _wait_for(lambda: calls)
            assert calls[0] - done >= 0.25
            await asyncio.sleep(1.0)
            assert len(calls) == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())
