"""Resizing the expert-slot cache and the KV cache of a running engine (`freetoken.engine.resize`), on the CPU device
through the real engine: the demo checkpoint with the `offload` expert cache (its slots are host tensors here).

Every output is compared with the same greedy request on an engine that was never resized; the caches' state is
checked through the planner and the prefix cache (resident experts, slot bytes against the pool, cached blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine import resize as resize_module
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.resize import ResizeRefused, ResizeRolledBack, resize
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import demo_checkpoint_dir

BS = 4
MAX_MODEL_LEN = 64
PROMPT = list(range(5, 30))  # 25 tokens: 6 full blocks
OTHER = list(range(200, 222))


def make_engine(**kwargs) -> LLMEngine:
    cfg = {
        "device": "cpu",
        "dtype": "float32",
        "moe_backend": "offload",
        "expert_slots": 12,
        "max_model_len": MAX_MODEL_LEN,
        "kv_block_size": BS,
        "kv_cache_tokens": 256,
        "max_num_seqs": 4,
    }
    return LLMEngine.from_dir(demo_checkpoint_dir(), EngineConfig(**{**cfg, **kwargs}))


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, prompt: list[int], n: int = 8, on_step=None, rid: str = "x") -> tuple[list[int], int]:
    """(output tokens, cached prompt tokens) of `prompt` run alone; `on_step(i)` after step i."""
    engine.add_request(rid, prompt, greedy(n))
    tokens, cached, i = [], None, 0
    while engine.has_work():
        for out in engine.step():
            tokens += out.chunk.token_ids
            cached = out.chunk.num_cached_tokens
        i += 1
        if on_step is not None:
            on_step(i)
    return tokens, cached


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    """Each prompt's output on an engine that is never resized."""
    engine = make_engine()
    return {"prompt": run(engine, PROMPT, 10)[0], "other": run(make_engine(), OTHER, 10)[0]}


def residents(engine: LLMEngine) -> dict[tuple[int, int], int]:
    """(pool layer, expert) -> slot of every resident expert."""
    planner = engine.experts.planner
    out = {}
    for layer in range(planner.num_layers):
        slots = planner.layer_slots(layer)
        out.update({(layer, int(e)): int(slots[e]) for e in np.flatnonzero(slots >= 0)})
    return out


def assert_slots_hold_their_experts(engine: LLMEngine) -> None:
    experts = engine.experts
    e = experts.pool.num_experts
    for (layer, expert), slot in residents(engine).items():
        assert torch.equal(experts.slots[slot], experts.pool_experts[layer * e + expert]), (layer, expert, slot)


def test_resize_during_decode_keeps_output_and_residents(baseline):
    engine = make_engine()
    seen = {}

    def on_step(i: int) -> None:
        if i == 3:  # decoding: grow both caches
            before = residents(engine)
            answer = resize(engine, expert_slots=24, kv_blocks=40)
            assert residents(engine) == before and len(before) == 12  # every resident kept, in its slot
            assert answer["after"]["expert_cache"]["num_slots"] == 24 and engine.kv.num_blocks == 40
            seen["grown"] = engine.experts.planner.stats()["hits"].sum()
        if i == 6:  # shrink both below what they held
            before = residents(engine)
            assert len(before) > 6
            resize(engine, expert_slots=6, kv_blocks=20)
            after = residents(engine)
            assert len(after) == 6 and set(after) <= set(before)
            assert engine.experts.num_slots == 6 and engine.kv.num_blocks == 20
        assert_slots_hold_their_experts(engine)

    tokens, _ = run(engine, PROMPT, 10, on_step)
    assert tokens == baseline["prompt"]
    assert engine.experts.planner.stats()["hits"].sum() > seen["grown"]  # the kept experts went on hitting
    stats = engine.stats()
    assert stats["kv_blocks_total"] == 20 and stats["moe_backend"]["num_slots"] == 6
    assert stats["cache"]["num_resizes"] == 2


def test_held_and_cached_blocks_survive_with_new_ids(baseline):
    engine = make_engine()
    run(engine, PROMPT, 10)  # leaves PROMPT's blocks cached (low ids), evictable
    cached_before = engine.scheduler.prefix_cache.num_cached_blocks
    assert cached_before >= 6

    def on_step(i: int) -> None:
        if i == 2:  # OTHER holds blocks with higher ids: kept first, so renumbered from 0
            held = [b for b in range(engine.kv.num_blocks) if engine.scheduler.prefix_cache.ref_count(b)]
            assert min(held) >= cached_before
            resize(engine, kv_blocks=30)
            seq = engine.scheduler.running[0]
            assert seq.block_table == list(range(len(held)))
            assert engine.scheduler.prefix_cache.num_cached_blocks >= cached_before

    tokens, _ = run(engine, OTHER, 10, on_step, rid="y")
    assert tokens == baseline["other"]
    again, cached = run(engine, PROMPT, 10, rid="z")  # the first prompt's prefix is still reused
    assert again == baseline["prompt"] and cached == 24


def test_shrink_keeps_the_most_recent_prefix_blocks():
    engine = make_engine()
    run(engine, PROMPT, 10)
    run(engine, list(range(300, 330)), 4, rid="w")
    run(engine, OTHER, 10, rid="y")  # released last: the most recent
    prefix = engine.scheduler.prefix_cache
    assert len(prefix._evictable) > 16
    recent = list(reversed(prefix._evictable))[:16]
    keys = [prefix._key_of[b] for b in recent]
    answer = resize(engine, kv_blocks=16)
    assert answer["after"]["kv_cache"]["num_cached_blocks"] == 16
    assert [prefix._key_of[b] for b in reversed(prefix._evictable)] == keys
    assert sorted(prefix._evictable) == list(range(16)) and engine.kv.allocator.num_free == 0


def test_refused_before_anything_changes():
    engine = make_engine()
    layers, slots, runner = engine.kv.layers, engine.experts.slots, engine.runner.decode
    with pytest.raises(ResizeRefused, match="max_model_len"):
        resize(engine, kv_blocks=MAX_MODEL_LEN // BS - 1)
    with pytest.raises(ResizeRefused, match="host memory"):
        resize(engine, kv_gb=1e6)
    with pytest.raises(ResizeRefused, match="no expert slot"):
        resize(engine, expert_gb=1e-9)
    with pytest.raises(ResizeRefused, match="nothing to resize"):
        resize(engine)
    engine.add_request("held", PROMPT, greedy(30))
    engine.step()
    with pytest.raises(ResizeRefused, match="hold"):  # below what the running request holds (and one context)
        resize(engine, kv_blocks=5)
    assert engine.kv.layers is layers and engine.experts.slots is slots and engine.runner.decode is runner
    assert engine.num_resizes == 0


def test_backend_without_slots_is_refused():
    engine = make_engine(moe_backend="cpu", expert_slots=0)
    with pytest.raises(ResizeRefused, match="cpu expert backend keeps no expert slots"):
        resize(engine, expert_slots=8)
    assert resize(engine, kv_blocks=32)["after"]["expert_cache"] is None


def _failing(real, fail_rows: int):
    """`real` (an allocator), but raising the device allocator's out-of-memory error for tensors of `fail_rows`."""

    def allocate(shape, *args, **kwargs):
        if shape[0] == fail_rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return real(shape, *args, **kwargs)

    return allocate


@pytest.mark.parametrize("fail", ["slots", "kv"])
def test_allocation_failure_rolls_back(baseline, monkeypatch, fail):
    engine = make_engine()
    buffers = engine.experts.streamer.num_buffers * engine.experts.pool.num_experts
    if fail == "slots":
        monkeypatch.setattr(resize_module, "allocate_slots", _failing(torch.empty, 30 + buffers))
    else:
        monkeypatch.setattr(resize_module, "allocate_kv", _failing(torch.zeros, (40 + 1) * BS))
    state = {}

    def on_step(i: int) -> None:
        if i == 3:
            state["residents"] = residents(engine)
            state["tables"] = [list(s.block_table) for s in engine.scheduler.running]
            with pytest.raises(ResizeRolledBack, match="back at their old sizes"):
                resize(engine, expert_slots=30, kv_blocks=40)
            assert engine.experts.num_slots == 12 and engine.kv.num_blocks == 64
            assert engine.experts.slots.shape[0] == 12 + buffers
            assert residents(engine) == state["residents"]
            assert [s.block_table for s in engine.scheduler.running] == state["tables"]
            assert_slots_hold_their_experts(engine)

    tokens, _ = run(engine, PROMPT, 10, on_step)
    assert tokens == baseline["prompt"]
    assert engine.num_resizes == 0
