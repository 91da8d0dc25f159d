"""Prefill through the expert cache (`freetoken.moe.prefill`): streamed layers and every on-demand strategy give the
logits of `fused` for prompts that span several chunks, with one or two layer buffers; streaming leaves the slot
cache as it was; the cost model picks streaming for long chunks only; the GPU budget makes room for the buffers or
says it cannot; and a long prompt's chunks never stall a running decode.

CPU device, float32 compute over bf16-stored weights (as tests/test_moe_backends.py); the same tests run on CUDA
when there is one.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
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
    MIN_STREAM_TOKENS,
    Calibration,
    PrefillCosts,
    choose_strategy,
)
from test_moe_backends import DEVICES, PROFILE, bf16_checkpoint  # noqa: F401 (a fixture)

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(37)]


def _chunked_logits(model, prompt: list[int], chunk: int) -> torch.Tensor:
    """[len(prompt), vocab] logits of `prompt` prefilled `chunk` tokens per step into a paged KV cache."""
    cfg = model.config
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8, 16, dtype, device)
    blocks = list(range(kv.blocks_for(len(prompt))))
    out = []
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start : start + chunk]
            model.experts.begin_step(len(ids), len(ids), cfg.num_experts_per_tok)
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
def test_prefill_strategies_equal_fused(bf16_checkpoint, device, mode, strategy, buffers, num_slots):  # noqa: F811
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
    _chunked_logits(model, PROMPT[:3], 1)
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


def test_streaming_leaves_the_slot_cache_as_it_was(bf16_checkpoint):  # noqa: F811
    """Decode-hot experts survive a streamed prefill: same residents before and after, and only the experts that
    were not resident crossed into the buffers."""
    cpu = torch.device("cpu")
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), cpu, torch.float32)
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    backend = ExpertCacheBackend("offload", pool, cpu, 12, layer_buffers=2, prefill_strategy="auto")
    model.attach_experts(backend)
    _chunked_logits(model, PROMPT[:4], 1)  # decode steps: the cache learns
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
    # Decode batches never stream, whatever the prices; without a CPU profile the CPU paths cost inf.
    assert choose_strategy(costs, MIN_STREAM_TOKENS - 1, ["stream", "fill"]) == "fill"
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
    assert calibration.scale("hybrid", 8192) == 1.0  # another size class: not measured yet
    for _ in range(2):
        _time(calibration, "stream", 8192, predicted_s=1e3, seconds=0.0)
    assert calibration.scale("stream", 8192) == calibration.min_scale
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


def test_budget_makes_room_for_layer_buffers_or_says_why_not(monkeypatch, caplog):
    from freetoken.models.presets import preset_config_path

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="preset")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200e9, 200e9))
    stride = 3 * 768 * 2048 * 2
    layer_gb = cfg.num_experts * stride / 1e9
    base = dict(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, max_model_len=1024)
    slots, buffers = plan_expert_slots(EngineConfig(gpu_memory_gb=24, **base), cfg, torch.bfloat16, stride, "offload")
    assert buffers == 2 and slots * stride / 1e9 > 2 * layer_gb
    one = plan_expert_slots(EngineConfig(gpu_memory_gb=24, no_prefill_overlap=True, **base), cfg, torch.bfloat16,
                            stride, "offload")
    assert one[1] == 1 and one[0] == slots + cfg.num_experts
    assert plan_expert_slots(EngineConfig(gpu_memory_gb=24, prefill_strategy="fill", **base), cfg, torch.bfloat16,
                             stride, "offload")[1] == 0
    # Tighter budgets: one buffer (no overlap), then none (on-demand fills), and the log says which.
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.budget"):
        slots, buffers = plan_expert_slots(EngineConfig(gpu_memory_gb=9, **base), cfg, torch.bfloat16, stride,
                                           "offload")
    assert buffers == 1 and slots * stride / 1e9 >= layer_gb
    assert "no room for 2 prefill layer buffers" in caplog.text
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.budget"):
        slots, buffers = plan_expert_slots(EngineConfig(gpu_memory_gb=8, **base), cfg, torch.bfloat16, stride,
                                           "offload")
    assert buffers == 0 and slots > 0
    assert "no room for a prefill layer buffer" in caplog.text
    with pytest.raises(ValueError, match="--prefill-strategy stream"):
        plan_expert_slots(EngineConfig(gpu_memory_gb=8, prefill_strategy="stream", **base), cfg, torch.bfloat16,
                          stride, "offload")
    # --expert-slots and the CPU device: buffers only when something can stream (or when asked for).
    assert plan_expert_slots(EngineConfig(gpu_memory_gb=24, expert_slots=6144, **base), cfg, torch.bfloat16,
                             stride, "offload") == (6144, 0)
    assert plan_expert_slots(EngineConfig(gpu_memory_gb=24, expert_slots=100, **base), cfg, torch.bfloat16,
                             stride, "offload") == (100, 2)
    cpu = {**base, "device": "cpu"}
    assert plan_expert_slots(EngineConfig(**cpu), cfg, torch.bfloat16, stride, "offload") == (6144, 0)
    assert plan_expert_slots(EngineConfig(prefill_strategy="stream", **cpu), cfg, torch.bfloat16, stride,
                             "offload") == (6144, 2)


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
    slots, buffers = plan_expert_slots(EngineConfig(prefill_strategy="stream", **base), cfg, torch.bfloat16, stride,
                                       "offload")
    assert buffers == 2 and slots < num_experts


def test_bad_prefill_settings_are_refused(bf16_checkpoint):  # noqa: F811
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


def test_long_prompt_chunks_never_stall_a_running_decode(bf16_checkpoint):  # noqa: F811
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
