"""Prefill through the expert cache (`freetoken.moe.prefill`): streamed layers and every on-demand strategy give the
logits of `fused` for prompts that span several chunks, with one or two layer buffers; streaming leaves the slot
cache as it was; the cost model picks streaming for long chunks only; the GPU budget makes room for the buffers or
says it cannot; and a long prompt's chunks never stall a running decode.

CPU device, float32 compute over bf16-stored weights (as tests/moe/test_moe_backends.py); the same tests run on CUDA
when there is one.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from test_moe_backends import PROFILE

from freetoken._core import ExpertPool
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.attention import AttentionMetadata
from freetoken.models.loader import load_checkpoint
from freetoken.moe.budget import plan_expert_slots
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from freetoken.moe.prefill import (
    EXPLORE_MARGIN,
    EXPLORE_MARGIN_NEAR,
    Calibration,
    PrefillCosts,
    candidate_strategies,
    choose_strategy,
)
from gpu_marker import DEVICES

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(37)]


def _chunked_logits(model, prompt: list[int], chunk: int, prefill: bool = True) -> torch.Tensor:
    """[len(prompt), vocab] logits of `prompt` prefilled `chunk` tokens per step into a paged KV cache (run as
    decode steps, which the expert cache serves by its own plan, with `prefill` False)."""
    cfg = model.config
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8, 16, dtype, device)
    blocks = list(range(kv.blocks_for(len(prompt))))
    out = []
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start : start + chunk]
            model.experts.begin_step(len(ids), len(ids) if prefill else 0, cfg.num_experts_per_tok)
            meta = AttentionMetadata.build([len(ids)], [start + len(ids)], [blocks], kv.block_size, device)
            out.append(model.compute_logits(model(torch.tensor(ids, device=device), meta, kv.layers)))
    return torch.cat(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,strategy,buffers,num_slots",
    [
        ("offload", "stream", 2, 9),
        ("offload", "stream", 1, 9),
        ("offload", "stream", 2, 1),
        ("hybrid", "stream", 2, 20),
        ("offload", "fill", 2, 9),
        ("offload", "cpu", 2, 9),
        ("hybrid", "hybrid", 2, 9),
        ("offload", "auto", 2, 9),
        ("cpu", "cpu", 0, 0),
    ],
)
def test_prefill_strategies_equal_fused(bf16_checkpoint, device, mode, strategy, buffers, num_slots):
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), device, dtype)
    want = _chunked_logits(model, PROMPT, len(PROMPT))
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    backend = ExpertCacheBackend(
        mode, pool, device, num_slots, cpu_threads=2, layer_buffers=buffers, prefill_strategy=strategy, **PROFILE
    )
    model.attach_experts(backend)
    # A warm-up decode-like pass fills some slots first, so streamed layers mix slot hits and buffer rows.
    _chunked_logits(model, PROMPT[:3], 1, prefill=False)
    for chunk in (8, 16):
        got = _chunked_logits(model, PROMPT, chunk)
        cpu_ran = sum(backend.stats()["layers"]["cpu_runs"]) > 0
        tol = (2e-3 if cpu_ran else 1e-5) if device.type == "cpu" else (3e-2 if cpu_ran else 2e-2)
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    steps = backend.stats()["prefill"]["steps_by_strategy"]
    if strategy != "auto":
        assert steps[strategy] > 0
    if strategy == "stream":
        assert backend.stats()["prefill"]["bytes_streamed"] > 0


def test_streaming_leaves_the_slot_cache_as_it_was(bf16_checkpoint):
    """Decode-hot experts survive a streamed prefill: same residents before and after, and only the experts that
    were not resident crossed into the buffers."""
    cpu = torch.device("cpu")
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), cpu, torch.float32)
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    backend = ExpertCacheBackend("offload", pool, cpu, 12, layer_buffers=2, prefill_strategy="auto")
    model.attach_experts(backend)
    _chunked_logits(model, PROMPT[:4], 1, prefill=False)  # decode steps: the cache learns
    before = [backend.planner.layer_slots(layer).tolist() for layer in range(pool.num_layers)]
    resident = sum(s >= 0 for layer in before for s in layer)
    assert resident == 12
    prompt = PROMPT * 3  # 111 tokens: past a decode batch, every expert routed
    _chunked_logits(model, prompt, len(prompt))
    assert backend.stats()["prefill"]["steps_by_strategy"]["stream"] == 1
    assert [backend.planner.layer_slots(layer).tolist() for layer in range(pool.num_layers)] == before
    absent = pool.num_layers * pool.num_experts - resident
    assert backend.stats()["prefill"]["bytes_streamed"] == absent * pool.expert_nbytes
    # The chunk was timed against its prediction (its first timing is a warm-up).
    assert ("stream", backend.calibration.size_class(len(prompt))) in backend.calibration.warm


def _costs(resident: float = 30.0, cpu: bool = True) -> PrefillCosts:
    """Qwen3-30B-A3B's expert shape and the lent H200 box's bandwidths (`ft bench bw`)."""
    return PrefillCosts(
        num_experts=128,
        top_k=8,
        expert_nbytes=3 * 768 * 2048 * 2,
        resident=resident,
        pcie_bytes_per_s=52.7e9,
        cpu_bytes_per_s={1: 83.6e9, 2: 76.8e9, 4: 77.3e9, 8: 73.4e9, 16: 60.8e9} if cpu else None,
        gpu_flops_per_s=300e12,
    )


def test_cost_model_streams_long_chunks_and_serves_short_extends_on_demand():
    costs = _costs()
    assert choose_strategy(costs, 8192, ["stream", "fill"]) == "stream"
    assert choose_strategy(costs, 8192, ["stream", "hybrid"]) == "stream"
    assert choose_strategy(costs, 8192, ["stream", "cpu"]) == "stream"
    # A short extend: the CPU and PCIe together beat one path moving the whole layer.
    assert choose_strategy(costs, 64, ["stream", "hybrid"]) == "hybrid"
    assert costs.seconds("hybrid", 64) * 2 < costs.seconds("stream", 64)
    # A few prompt tokens route to few experts: fill them rather than stream whole layers. Without a CPU profile
    # the CPU paths cost inf.
    assert choose_strategy(costs, 4, ["stream", "fill"]) == "fill"
    assert _costs(cpu=False).seconds("cpu", 64) == float("inf")
    # One buffer: the copy no longer hides the compute.
    serial = PrefillCosts(**{**costs.__dict__, "overlap": False})
    assert serial.seconds("stream", 8192) > costs.seconds("stream", 8192)
    # More of the layer resident: less to stream (the hits are read from their slots).
    assert _costs(resident=100).seconds("stream", 8192) < costs.seconds("stream", 8192)
    # The CPU slows past the profiled batches (compute-bound), so a long chunk on the CPU costs more per byte.
    assert costs.seconds("cpu", 8192) > costs.seconds("cpu", 64)


def _time(calibration: Calibration, strategy: str, num_tokens: int, predicted_s: float, seconds: float) -> None:
    calibration.start(strategy, num_tokens, predicted_s)
    time.sleep(seconds)
    calibration.end()


def test_measured_chunks_recalibrate_the_choice():
    """A strategy whose chunks run slower than predicted loses to the other at that chunk size: the scale is
    measured / predicted, per size class, from the second timing on (the first compiles kernels)."""
    costs = _costs()
    assert choose_strategy(costs, 128, ["stream", "hybrid"]) == "hybrid"
    calibration = Calibration(torch.device("cpu"))
    _time(calibration, "hybrid", 128, predicted_s=1e-6, seconds=0.01)  # warm-up: not a sample
    assert calibration.scale("hybrid", 128) == 1.0 and not calibration.samples
    _time(calibration, "hybrid", 128, predicted_s=1e-6, seconds=0.01)  # far slower than 1 us: the bound
    assert calibration.scale("hybrid", 128) == calibration.max_scale
    assert calibration.samples[("hybrid", Calibration.size_class(128))] == 1
    assert choose_strategy(costs, 128, ["stream", "hybrid"], calibration) == "stream"
    # Another size class, not measured yet: the nearest measured one's scale, until it has its own.
    assert calibration.scale("hybrid", 8192) == calibration.max_scale
    assert not calibration.measured("hybrid", 8192) and calibration.measured("hybrid", 128)
    assert calibration.scale("stream", 8192) == 1.0  # never measured at any size
    for _ in range(2):
        _time(calibration, "stream", 8192, predicted_s=1e3, seconds=0.0)
    assert calibration.scale("stream", 8192) == calibration.min_scale
    assert calibration.scale("stream", 128) == calibration.min_scale
    assert calibration.stats() == {"hybrid": {"tokens>=64": 8.0}, "stream": {"tokens>=4096": 0.25}}
    # A prediction of inf (the CPU path without a CPU profile) has no scale: no sample, not a ratio of 0.
    for _ in range(2):
        _time(calibration, "cpu", 128, predicted_s=float("inf"), seconds=0.0)
    assert ("cpu", Calibration.size_class(128)) not in calibration.samples and "cpu" not in calibration.stats()
    # A chunk whose step failed before its last MoE layer (no `end`) does not block the samples after it.
    _time(calibration, "fill", 128, predicted_s=1.0, seconds=0.0)  # warm-up
    calibration.start("fill", 128, predicted_s=1.0)
    _time(calibration, "fill", 128, predicted_s=1e-6, seconds=0.01)
    assert calibration.samples[("fill", Calibration.size_class(128))] == 1
    assert calibration.scale("fill", 128) == calibration.max_scale


class _FakeClock(Calibration):
    """A calibration whose clock is `now` (seconds), advanced by the test: constructed chunk timings."""

    now = 0.0

    def _now(self) -> float:
        return self.now


EXTENDS = (16, 64, 256, 1024, 4096)  # benches/prefill.py's extend lengths


@pytest.mark.parametrize(
    "truth",
    [
        # The device (Qwen3-30B-A3B, 24 GB, 8k prefix): hybrid runs 2.5x its prediction (a 64-token extend took
        # 1.00 s against streaming's 0.86 s), streaming about as predicted.
        {"stream": (0.95, 0.0), "hybrid": (2.5, 0.0)},
        # Fixed costs the model leaves out: 10 ms per layer on every on-demand chunk, whatever its size.
        {"stream": (1.0, 0.0), "hybrid": (1.0, 10e-3)},
        # The model overprices streaming (by less than EXPLORE_MARGIN) and underprices hybrid.
        {"stream": (0.75, 0.0), "hybrid": (1.3, 0.0)},
        # The model is right: hybrid wins the short extends, streaming the long ones.
        {"stream": (1.0, 0.0), "hybrid": (1.0, 0.0)},
    ],
)
def test_auto_ends_within_5_percent_of_the_best_fixed_strategy(truth):
    """benches/prefill.py's extends, in its order, under constructed timings (seconds per layer: scale x the model's
    prediction + a fixed cost): after a warm-up of 6 chunks per length, `auto`'s choices cost at most 5 % more than
    the best fixed strategy's at every length."""
    costs = _costs(resident=22)  # the 24 GB budget leaves ~22 of 128 experts per layer resident
    calibration = _FakeClock(torch.device("cpu"))

    def seconds(strategy: str, n: int) -> float:
        scale, fixed = truth[strategy]
        return scale * costs.seconds(strategy, n) + fixed

    def run(n: int) -> str:
        strategy = choose_strategy(costs, n, ["stream", "hybrid"], calibration)
        calibration.start(strategy, n, costs.seconds(strategy, n))
        calibration.now += seconds(strategy, n)
        calibration.end()
        return strategy

    for n in EXTENDS:
        for _ in range(6):
            run(n)
        best = min(seconds(s, n) for s in ("stream", "hybrid"))
        for _ in range(3):
            chosen = run(n)
            assert seconds(chosen, n) <= 1.05 * best, (n, chosen, calibration.stats())


def test_exploration_measures_a_close_untried_strategy_once():
    """Once the cheapest is measured at a size class, an untried strategy priced within EXPLORE_MARGIN of it is run
    twice (a warm-up and a sample) and then left if it is dearer; one priced past the margin is never run."""
    costs = _costs(resident=22)
    for n, explored in ((1024, True), (16, False)):
        ratio = costs.seconds("stream", n) / costs.seconds("hybrid", n)
        assert (1 < ratio <= EXPLORE_MARGIN) == explored, ratio
        calibration = _FakeClock(torch.device("cpu"))
        picks = []
        for _ in range(6):  # each runs exactly as predicted: hybrid is the cheaper
            strategy = choose_strategy(costs, n, ["stream", "hybrid"], calibration)
            calibration.start(strategy, n, costs.seconds(strategy, n))
            calibration.now += costs.seconds(strategy, n)
            calibration.end()
            picks.append(strategy)
        tried = ["stream", "stream"] if explored else ["hybrid", "hybrid"]
        assert picks == ["hybrid", "hybrid", *tried, "hybrid", "hybrid"], (n, picks)


def test_no_exploration_where_streaming_is_the_measured_best():
    """A long chunk that streams as predicted is not spent on measuring an on-demand strategy priced within the
    margin: streaming's price is a layer's copy, and a wrong exploration costs two long chunks (a 32768-token Qwen3.5
    chunk under hybrid ran 6.1x its prediction on the H200, 10.5 s of TTFT twice)."""
    costs = _costs(resident=22)
    n = 8192
    assert 1 < costs.seconds("hybrid", n) / costs.seconds("stream", n) <= EXPLORE_MARGIN_NEAR
    calibration = _FakeClock(torch.device("cpu"))
    for strategy in ("hybrid", "hybrid"):  # measured at a short size, as predicted: the near margin applies
        calibration.start(strategy, 64, costs.seconds(strategy, 64))
        calibration.now += costs.seconds(strategy, 64)
        calibration.end()
    assert calibration.measured_anywhere("hybrid")
    picks = []
    for _ in range(6):
        strategy = choose_strategy(costs, n, ["stream", "hybrid"], calibration)
        calibration.start(strategy, n, costs.seconds(strategy, n))
        calibration.now += costs.seconds(strategy, n)
        calibration.end()
        picks.append(strategy)
    assert picks == ["stream"] * 6


def test_a_strategy_measured_at_another_size_explores_within_the_near_margin_only():
    """Measured at a neighbouring size class, a strategy's price carries that class's scale, so it is explored only
    within EXPLORE_MARGIN_NEAR of the best: 1.5x dearer after calibration is not run at the new size."""
    costs = _costs(resident=22)
    calibration = _FakeClock(torch.device("cpu"))
    n = 1024
    stream_scale = 1.5 * costs.seconds("hybrid", n) / costs.seconds("stream", n)  # stream 1.5x hybrid, measured
    for strategy, scale in (("stream", stream_scale), ("hybrid", 1.0)):
        for _ in range(2):  # at 4096 tokens (the next class up): a warm-up and a sample
            calibration.start(strategy, 4096, costs.seconds(strategy, 4096))
            calibration.now += scale * costs.seconds(strategy, 4096)
            calibration.end()
    assert calibration.measured_anywhere("stream") and not calibration.measured("stream", n)
    assert 1.5 < EXPLORE_MARGIN and 1.5 > EXPLORE_MARGIN_NEAR
    picks = []
    for _ in range(4):
        strategy = choose_strategy(costs, n, ["stream", "hybrid"], calibration)
        calibration.start(strategy, n, costs.seconds(strategy, n))
        calibration.now += costs.seconds(strategy, n) * (stream_scale if strategy == "stream" else 1.0)
        calibration.end()
        picks.append(strategy)
    assert picks == ["hybrid"] * 4


def test_auto_chooses_among_every_strategy_the_backend_can_run():
    """Streaming with layer buffers, the backend's own plan, the CPU with a profile, hybrid with slots and a profile,
    and fill only where hybrid cannot run."""
    assert candidate_strategies("hybrid", True, True, True) == ["stream", "hybrid", "cpu"]
    assert candidate_strategies("fill", True, True, True) == ["stream", "fill", "cpu", "hybrid"]
    assert candidate_strategies("fill", True, True, False) == ["stream", "fill"]
    assert candidate_strategies("fill", False, True, False) == ["fill"]
    assert candidate_strategies("cpu", False, False, True) == ["cpu"]


# benches/prefill.py --parts extend on the lent H200 box (Qwen3-30B-A3B real config, 24 GB, an 8192-token prefix,
# synthetic routing replay; session 24): median seconds per extend of each fixed strategy, and the inputs the
# backends had (planner figures of `ft bench bw`, 27.8 of 128 experts per layer resident: 45.4 GB streamed).
DEVICE_EXTENDS = {
    "stream": {16: 0.825, 64: 0.825, 256: 0.825, 1024: 0.827, 4096: 0.828, 8192: 0.86},
    "fill": {16: 0.594, 64: 0.998, 256: 1.116, 1024: 1.130, 4096: 1.273, 8192: 1.4},
    "cpu": {16: 0.294, 64: 0.812, 256: 1.043, 1024: 2.081, 4096: 6.368, 8192: 12.7},
    "hybrid": {16: 0.275, 64: 0.752, 256: 0.827, 1024: 1.025, 4096: 1.358, 8192: 1.5},
}
# The same run's `auto` met hybrid after other extends had churned the slots: 0.436 s at 16 tokens (0 % hits against
# 9 % fixed, 40 % more fills) and 2.55x its prediction at 64 (0.544 s with these figures).
HYBRID_AFTER_CHURN = {**DEVICE_EXTENDS["hybrid"], 16: 0.436, 64: 2.55 * 0.544}
DEVICE_COSTS = PrefillCosts(
    num_experts=128,
    top_k=8,
    expert_nbytes=3 * 768 * 2048 * 2,
    resident=27.8,
    pcie_bytes_per_s=52.8e9,
    cpu_bytes_per_s={1: 35.0e9, 2: 33.5e9, 4: 33.9e9, 8: 32.2e9, 16: 31.4e9},
    gpu_flops_per_s=600e12,
)


@pytest.mark.parametrize("hybrid", [DEVICE_EXTENDS["hybrid"], HYBRID_AFTER_CHURN], ids=["fixed", "after-churn"])
def test_auto_is_within_5_percent_of_the_best_on_the_device_figures(hybrid):
    """benches/prefill.py's extend part replayed on its device figures: the 8192-token prefix under `auto`, then per
    length 6 warm-up extends and 3 timed ones, each costing what that strategy measured at that length; the
    calibration sees predictions of the bench's own cost inputs. `auto` must be within 5 % of the best fixed strategy
    at every length. With hybrid as `auto` met it (slots churned), the CPU wins the 16-token extends (it fills
    nothing): a hybrid backend's `auto` that could only stream or run hybrid took 1.48x the best there."""
    truth = {**DEVICE_EXTENDS, "hybrid": hybrid}
    candidates = candidate_strategies("hybrid", True, True, True)
    calibration = _FakeClock(torch.device("cpu"))
    layers = 48

    def run(n: int) -> str:
        strategy = choose_strategy(DEVICE_COSTS, n, candidates, calibration)
        calibration.start(strategy, n, DEVICE_COSTS.seconds(strategy, n) * layers)
        calibration.now += truth[strategy][n]
        calibration.end()
        return strategy

    run(8192)
    for n in EXTENDS:
        for _ in range(6):
            run(n)
        best = min(times[n] for times in truth.values())
        for _ in range(3):
            chosen = run(n)
            assert truth[chosen][n] <= 1.05 * best, (n, chosen, truth[chosen][n], best, calibration.stats())


@pytest.mark.cuda_mocked
def test_budget_makes_room_for_layer_buffers_or_says_why_not(monkeypatch, caplog):
    from freetoken.models.presets import preset_config_path

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="preset")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200e9, 200e9))
    stride = 3 * 768 * 2048 * 2
    layer_gb = cfg.num_experts * stride / 1e9
    base = dict(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, max_model_len=1024)
    slots, buffers = plan_expert_slots(EngineConfig(gpu_memory_gb=24, **base), cfg, torch.bfloat16, stride, "offload")
    assert buffers == 2 and slots * stride / 1e9 > 2 * layer_gb
    one = plan_expert_slots(
        EngineConfig(gpu_memory_gb=24, no_prefill_overlap=True, **base), cfg, torch.bfloat16, stride, "offload"
    )
    assert one[1] == 1 and one[0] == slots + cfg.num_experts
    assert (
        plan_expert_slots(
            EngineConfig(gpu_memory_gb=24, prefill_strategy="fill", **base), cfg, torch.bfloat16, stride, "offload"
        )[1]
        == 0
    )
    # Tighter budgets: one buffer (no overlap), then none (on-demand fills), and the log says which.
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.budget"):
        slots, buffers = plan_expert_slots(
            EngineConfig(gpu_memory_gb=8, **base), cfg, torch.bfloat16, stride, "offload"
        )
    assert buffers == 1 and slots * stride / 1e9 >= layer_gb
    assert "no room for 2 prefill layer buffers" in caplog.text
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.budget"):
        slots, buffers = plan_expert_slots(
            EngineConfig(gpu_memory_gb=7, **base), cfg, torch.bfloat16, stride, "offload"
        )
    assert buffers == 0 and slots > 0
    assert "no room for a prefill layer buffer" in caplog.text
    with pytest.raises(ValueError, match="--prefill-strategy stream"):
        plan_expert_slots(
            EngineConfig(gpu_memory_gb=7, prefill_strategy="stream", **base), cfg, torch.bfloat16, stride, "offload"
        )
    # --expert-slots and the CPU device: buffers only when something can stream (or when asked for).
    assert plan_expert_slots(
        EngineConfig(gpu_memory_gb=24, expert_slots=6144, **base), cfg, torch.bfloat16, stride, "offload"
    ) == (6144, 0)
    assert plan_expert_slots(
        EngineConfig(gpu_memory_gb=24, expert_slots=100, **base), cfg, torch.bfloat16, stride, "offload"
    ) == (100, 2)
    cpu = {**base, "device": "cpu"}
    assert plan_expert_slots(EngineConfig(**cpu), cfg, torch.bfloat16, stride, "offload") == (6144, 0)
    assert plan_expert_slots(
        EngineConfig(prefill_strategy="stream", **cpu), cfg, torch.bfloat16, stride, "offload"
    ) == (6144, 2)


@pytest.mark.cuda_mocked
def test_budget_that_holds_the_whole_pool_takes_no_layer_buffers(monkeypatch):
    """Under auto, a budget whose slots can hold every expert keeps them all resident rather than evicting some
    for layer buffers that would have nothing to stream; a forced `stream` still gets its buffers."""
    from freetoken.models.presets import preset_config_path

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="preset")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200e9, 200e9))
    stride = 3 * 768 * 2048 * 2
    num_experts = len(cfg.moe_layers) * cfg.num_experts
    base = dict(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, max_model_len=1024, gpu_memory_gb=65)
    # 65 GB leaves room for the 58 GB pool, but not for it and two 1.2 GB layer buffers.
    assert plan_expert_slots(EngineConfig(**base), cfg, torch.bfloat16, stride, "offload") == (num_experts, 0)
    slots, buffers = plan_expert_slots(
        EngineConfig(prefill_strategy="stream", **base), cfg, torch.bfloat16, stride, "offload"
    )
    assert buffers == 2 and slots < num_experts


def test_bad_prefill_settings_are_refused(bf16_checkpoint):
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--prefill-strategy stream needs layer buffers"):
        ExpertCacheBackend("offload", pool, cpu, 8, prefill_strategy="stream")
    with pytest.raises(ValueError, match="--prefill-strategy hybrid needs a bandwidth profile"):
        ExpertCacheBackend("offload", pool, cpu, 8, prefill_strategy="hybrid")
    with pytest.raises(ValueError, match="needs the offload or hybrid backend: --moe-backend cpu"):
        ExpertCacheBackend("cpu", pool, cpu, 0, prefill_strategy="stream")
    with pytest.raises(ValueError, match="--prefill-strategy fill needs expert slots"):
        ExpertCacheBackend("cpu", pool, cpu, 0, prefill_strategy="fill")
    with pytest.raises(ValueError, match="expected auto, stream"):
        ExpertCacheBackend("offload", pool, cpu, 8, prefill_strategy="magic")
    with pytest.raises(ValueError, match="--prefill-strategy"):
        EngineConfig(prefill_strategy="magic").validate()


def test_long_prompt_chunks_never_stall_a_running_decode(bf16_checkpoint):
    """A decode that is running gets a token on every step while a long prompt is prefilled chunk by chunk with
    streamed layers, and both outputs equal those of the same requests run alone."""
    cpu = torch.device("cpu")
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), cpu, torch.float32)
    cfg = ModelConfig.from_dir(bf16_checkpoint)
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    model.attach_experts(ExpertCacheBackend("offload", pool, cpu, 9, layer_buffers=2, prefill_strategy="stream"))
    engine_cfg = EngineConfig(device="cpu", dtype="float32", max_prefill_tokens=8, max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long_prompt = PROMPT * 2  # 74 tokens: 10 chunks of at most 8 (the budget the decoder leaves is 7)

    def run(requests) -> dict[str, list[tuple[int, int]]]:
        engine = LLMEngine(model, cfg, engine_cfg, tokenizer=None)
        got: dict[str, list[tuple[int, int]]] = {}
        step = 0
        for i, (rid, prompt) in enumerate(requests):
            engine.add_request(rid, prompt, params)
            if i == 0:
                for _ in range(2):  # the first request is decoding before the long prompt arrives
                    step += 1
                    for o in engine.step():
                        got.setdefault(o.request_id, []).extend((step, t) for t in o.chunk.token_ids)
        while engine.has_work():
            step += 1
            for o in engine.step():
                got.setdefault(o.request_id, []).extend((step, t) for t in o.chunk.token_ids)
        return got

    together = run([("decode", PROMPT[:5]), ("long", long_prompt)])
    steps = [s for s, _ in together["decode"]]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # a token on every step, no gap
    first_long = together["long"][0][0]
    assert first_long - 2 >= 9  # the long prompt took many steps, and the decode ran through them
    alone = {rid: [t for _, t in run([(rid, p)])[rid]] for rid, p in [("decode", PROMPT[:5]), ("long", long_prompt)]}
    assert {rid: [t for _, t in v] for rid, v in together.items()} == alone
