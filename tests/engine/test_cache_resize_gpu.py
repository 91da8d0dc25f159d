"""On a CUDA device: the expert-slot cache resized while a streamed request decodes through the decode driver's CUDA
graphs (`freetoken.engine.resize`): the text equals the same request without resizes, resident experts survive
(the resize answers' counters), the decode runner is rebuilt on the new slots, and the speed follows the size.

Skipped without a GPU; on the GPU box: `python -m pytest tests/engine/test_cache_resize_gpu.py -q -s` (the demo
model, about a minute) and `FREETOKEN_TEST_REAL=1 ...` adds Qwen3-30B-A3B's real shapes on dummy weights
(16 -> 24 -> 12 GB).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine import AsyncEngine
from freetoken.engine.cuda_graph import DrivenGraphRunner
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.resize import resize
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint
from freetoken.moe.routing_replay import install_replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = [3, 17, 100, 42, 7, 8, 9, 200, 13, 5, 6, 400, 401, 402]


def _stream(engine: LLMEngine, max_tokens: int, resizes: dict[int, dict]) -> tuple[list[int], list, list[float]]:
    """Stream PROMPT greedily; after the chunk numbered by a key of `resizes`, resize with its sizes (the request
    keeps decoding meanwhile: the resize waits for the step in flight). Returns (tokens, the resizes' answers,
    decode tok/s of each phase between resizes)."""

    async def main():
        front = AsyncEngine(engine, "m")
        await front.start()
        tokens, answers, rates, pending = [], [], [], None
        # A phase's rate counts the tokens after its resize has answered (and after the first token, so neither the
        # prefill nor the drain, rebuild and graph capture of a resize is in it): decode at that cache size alone.
        phase_start, phase_tokens = None, 0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for chunk in front.generate(PROMPT, params):
            tokens += chunk.token_ids
            if pending is not None and pending.done():
                answers.append(pending.result())
                pending = None
            if phase_start is None:
                if pending is None:
                    phase_start, phase_tokens = time.perf_counter(), 0
            else:
                phase_tokens += len(chunk.token_ids)
            if len(tokens) in resizes:
                rates.append(phase_tokens / (time.perf_counter() - phase_start) if phase_start else 0.0)
                if pending is not None:
                    answers.append(await pending)
                pending = asyncio.ensure_future(front.resize_cache(**resizes[len(tokens)]))
                await asyncio.sleep(0)  # queued behind the step in flight
                phase_start = None
        rates.append(phase_tokens / (time.perf_counter() - phase_start) if phase_start else 0.0)
        if pending is not None:
            answers.append(await pending)
        await front.shutdown()
        return tokens, answers, rates

    return asyncio.run(main())


def _check_answers(answers: list, sizes: list[int]) -> None:
    """Each answer shows the new slot count, every resident kept on a grow, a full cache of survivors on a shrink."""
    for answer, slots in zip(answers, sizes, strict=True):
        before, after = answer["before"]["expert_cache"], answer["after"]["expert_cache"]
        assert after["num_slots"] == slots
        if slots >= before["num_slots"]:
            assert after["num_resident"] == before["num_resident"], answer
        else:
            assert after["num_resident"] == min(before["num_resident"], slots), answer


def test_resize_while_a_stream_decodes_on_cuda(tmp_path):
    path = build_demo_checkpoint(tmp_path / "demo", seed=6)
    cfg = {"device": "cuda", "dtype": "bfloat16", "kv_cache_gb": 0.5, "moe_backend": "offload", "expert_slots": 16}
    plain, _, _ = _stream(LLMEngine.from_dir(path, EngineConfig(**cfg)), 48, {})
    engine = LLMEngine.from_dir(path, EngineConfig(**cfg))
    tokens, answers, _ = _stream(engine, 48, {8: {"expert_slots": 24, "kv_gb": 0.6}, 24: {"expert_slots": 12}})
    assert tokens == plain
    _check_answers(answers, [24, 12])
    assert answers[0]["after"]["kv_cache"]["num_blocks"] > answers[0]["before"]["kv_cache"]["num_blocks"]
    decode = engine.runner.decode
    assert isinstance(decode, DrivenGraphRunner) and decode.captured  # graphs captured again
    # The handshake was built again on the 12 new slots (the caching allocator may hand back the old address).
    buffers = (
        0 if engine.experts.streamer is None else engine.experts.streamer.num_buffers * engine.experts.pool.num_experts
    )
    assert (
        engine.experts.num_slots == 12 and decode.handshake.slot_rows == engine.experts.slots.shape[0] == 12 + buffers
    )
    assert engine.experts.stats()["decode_driver"]["steps"] >= 40  # decoding went on through the driver


@pytest.mark.skipif(not os.environ.get("FREETOKEN_TEST_REAL"), reason="set FREETOKEN_TEST_REAL=1 (about 2 minutes)")
def test_resize_real_shapes_16_24_12_gb():
    """Qwen3-30B-A3B's real shapes, dummy weights: 16 -> 24 -> 12 GB of expert slots while one stream decodes;
    the text equals the run without resizes and decode tok/s orders as the cache sizes."""
    from freetoken.models.presets import preset_dir

    path = preset_dir("qwen3-30b-a3b")
    cfg = {
        "device": "cuda",
        "dtype": "bfloat16",
        "dummy_weights": True,
        "kv_cache_gb": 1.0,
        "max_model_len": 4096,
        "moe_backend": "offload",
        "prefill_strategy": "fill",
    }
    engine = LLMEngine.from_dir(path, EngineConfig(**cfg, expert_slots=1))
    slots = {gb: int(gb * 1e9) // engine.experts.pool.expert_stride for gb in (16, 24, 12)}
    resize(engine, expert_gb=16.0)
    plain, _, _ = _stream(engine, 144, {})
    resize(engine, expert_slots=1)  # the measured run starts from a cold cache of 16 GB again
    resize(engine, expert_gb=16.0)
    tokens, answers, _ = _stream(engine, 144, {48: {"expert_gb": 24.0}, 96: {"expert_gb": 12.0}})
    assert tokens == plain
    _check_answers(answers, [slots[24], slots[12]])
    # Random routers pick the same few experts at every size (all hits), so tok/s is measured again on the synthetic
    # trace's misses; its routing follows the order of the steps (graph captures included), so its text is not
    # compared. Going back to one slot and up again captures the graphs with the trace routers in them.
    install_replay(engine.runner.model, "synthetic")
    resize(engine, expert_slots=1)
    resize(engine, expert_gb=16.0)
    _, answers, rates = _stream(engine, 144, {48: {"expert_gb": 24.0}, 96: {"expert_gb": 12.0}})
    print(
        f"decode tok/s at 16, 24, 12 GB (synthetic trace): {', '.join(f'{r:.1f}' for r in rates)}; "
        f"resize seconds: {[a['seconds'] for a in answers]}"
    )
    _check_answers(answers, [slots[24], slots[12]])
    assert rates[1] > max(rates[0], rates[2]), rates  # 16 GB starts cold, so only 24 GB is ordered against both
