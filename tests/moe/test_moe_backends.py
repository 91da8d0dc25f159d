"""Every expert-cache backend (offload, cpu, hybrid) gives the logits of `fused` on the same checkpoint.

CPU device, float32 compute over bf16-stored weights (the pool's format), at several cache sizes down to one slot,
smaller than a single token's working set (top-k experts in every MoE layer). Experts run on the slots match to
float32 rounding; the host kernels take their inputs in bf16 (AVX-512-BF16/AMX dot products), so a run that used
them matches to bf16 rounding of the hidden states.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken._core import ExpertPool
from freetoken.models.attention import AttentionMetadata
from freetoken.models.loader import load_checkpoint
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from gpu_marker import DEVICES

PROFILE = dict(pcie_bytes_per_s=50e9, cpu_bytes_per_s={1: 20e9, 4: 40e9, 16: 60e9})


def _logits(model, prompt: list[int]) -> torch.Tensor:
    from freetoken.engine.kv_cache import KVCache

    cfg = model.config
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8, 16, dtype, device)
    n = len(prompt)
    meta = AttentionMetadata.build([n], [n], [list(range(kv.blocks_for(n)))], kv.block_size, device)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(prompt, device=device), meta, kv.layers))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,num_slots",
    [("offload", 64), ("offload", 9), ("offload", 1), ("cpu", 0), ("hybrid", 64), ("hybrid", 3)],
)
def test_backend_logits_equal_fused(bf16_checkpoint, mode, num_slots, device):
    """float32 on the CPU; bfloat16 on CUDA, where slot runs use the same Triton kernel as fused (bit-equal) and
    host runs differ by bf16 rounding."""
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), device, dtype)
    prompts = [[3, 17, 100, 42, 7, 8, 9, 200, 13], list(range(1000, 1040))]
    expected = [_logits(model, p) for p in prompts]
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    backend = ExpertCacheBackend(mode, pool, device, num_slots, cpu_threads=2, **PROFILE)
    model.attach_experts(backend)
    got = [[_logits(model, p) for p in prompts] for _ in range(2)]  # the second pass starts from a warm cache
    stats = backend.stats()["layers"]
    hits, fills, cpu = sum(stats["hits"]), sum(stats["fills"]), sum(stats["cpu_runs"])
    # Relative to the largest logit: float32 rounding, or bf16 rounding of the host kernels' inputs.
    tol = (2e-3 if cpu else 1e-5) if device.type == "cpu" else (3e-2 if cpu else 0.0)
    for run in got:
        for logits, want in zip(run, expected, strict=True):
            assert (logits - want).abs().max().item() <= tol * want.abs().max().item()
    if mode == "cpu":
        assert fills == 0 and hits == 0 and cpu > 0
    if mode == "offload" and num_slots == 64:  # the whole pool fits: the second pass only hits
        assert cpu == 0 and hits > 0
    if mode == "offload" and num_slots == 1:  # fewer slots than one step's experts: the rest run on the CPU
        assert cpu > 0
    if mode == "hybrid":
        assert fills > 0 and cpu > 0


def test_bad_backend_arguments(bf16_checkpoint):
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="hybrid needs a bandwidth profile"):
        ExpertCacheBackend("hybrid", pool, cpu, 8)
    with pytest.raises(ValueError, match="at least one expert slot"):
        ExpertCacheBackend("offload", pool, cpu, 0)
    with pytest.raises(ValueError, match="expected one of"):
        ExpertCacheBackend("magic", pool, cpu, 8)


def test_cpu_backend_says_what_it_ignores_and_runs_with(bf16_checkpoint, caplog):
    """`--moe-backend cpu` keeps no slots: an `--expert-slots` is warned about, and the start-up log and the stats
    name the host kernels' threads and instruction set."""
    import logging

    from freetoken.config import EngineConfig, ModelConfig
    from freetoken.moe import make_expert_backend

    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend="cpu", expert_slots=4, cpu_threads=2)
    with caplog.at_level(logging.INFO, logger="freetoken"):
        backend = make_expert_backend(cfg, ModelConfig.from_dir(bf16_checkpoint), bf16_checkpoint, torch.float32)
    assert "--expert-slots 4: ignored" in caplog.text
    assert "host expert kernels: 2 threads" in caplog.text
    stats = backend.stats()
    assert stats["num_slots"] == 0 and stats["cpu_threads"] == 2 and stats["cpu_isa"] == backend.cpu.isa


def test_offload_decode_under_evictions_keeps_every_resident_in_its_slot(bf16_checkpoint):
    """CPU device, the engine's decode with 9 slots for the 64 experts: every step evicts (the same `LayerServer`
    and planner as the GPU's driven decode, with the memcpy copier). After each step every expert the planner counts
    resident is in its slot (`stale_slots`), and the greedy tokens and their log-probabilities follow fused's to
    float32 rounding. A slot overwritten behind the planner's back is reported."""
    from freetoken.config import EngineConfig
    from freetoken.engine.llm_engine import LLMEngine
    from greedy import greedy_logprobs

    prompts = [[3, 17, 100, 42, 7, 8, 9, 200, 13], list(range(1000, 1018))]

    def decode(backend: str, **args) -> tuple[LLMEngine, list[list[tuple[int, float]]]]:
        cfg = EngineConfig(device="cpu", dtype="float32", kv_cache_gb=0.05, moe_backend=backend, cpu_threads=2, **args)
        engine = LLMEngine.from_dir(bf16_checkpoint, cfg)

        def resident_in_slots(step: int) -> None:
            if backend == "offload":
                assert engine.experts.stale_slots() == [], f"step {step}"

        return engine, greedy_logprobs(engine, prompts, 10, resident_in_slots)

    _, want = decode("fused")
    # Streamed prefill: its layers come from the layer buffers, so no step runs experts on the CPU kernels (bf16).
    engine, got = decode("offload", expert_slots=9, prefill_strategy="stream")
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-4
    backend = engine.experts
    assert sum(backend.stats()["layers"]["evictions"]) > 0 and sum(backend.stats()["layers"]["cpu_runs"]) == 0
    layer_slots = backend.planner.layer_slots(0)
    expert = int(np.flatnonzero(layer_slots >= 0)[0])
    backend.slots[int(layer_slots[expert])].zero_()
    assert backend.stale_slots() == [(0, expert, int(layer_slots[expert]))]


def test_the_pool_must_agree_with_the_config_on_the_moe_layers(tmp_path):
    """The MoE-layer rule is `ModelConfig.is_moe_layer`; the Rust checkpoint reader applies its own (it also knows
    DeepSeek's `first_k_dense_replace`), and a pool whose layers differ from the config's is refused, naming both,
    instead of serving model layer L with pool layer L's neighbour."""
    import json

    from freetoken._core import CheckpointError
    from freetoken.config import EngineConfig, ModelConfig
    from freetoken.models.demo import build_demo_checkpoint
    from freetoken.moe import make_expert_backend

    path = build_demo_checkpoint(tmp_path / "demo", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1}))
    model_cfg = ModelConfig.from_dir(path)
    assert model_cfg.moe_layers == [0, 1, 2, 3]  # the config's rule ignores the key; the reader's does not
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend="offload", expert_slots=4)
    with pytest.raises(CheckpointError, match=r"found MoE layers \[1, 2, 3\], the model config \[0, 1, 2, 3\]"):
        make_expert_backend(cfg, model_cfg, path, torch.float32)
