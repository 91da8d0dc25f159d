"""The activation formula (`freetoken.models.activations`) against the bytes a step really allocates, measured live
through the models' CUDA code path on the CPU (`tests/activation_peak.py`): at the real Qwen3-30B-A3B and
Qwen3.5-35B-A3B shapes on the "meta" device, and on the small demo configs. The formula must never be below the
measured peak of any part, and for one sequence it is within the step's metadata of it (no more than needed). (Real
tensors through Triton's interpreter are not measured: the interpreter keeps kernel arguments alive past their
launch, which CUDA does not.) The budget at the setting of issue 21 then leaves the expert slots stated in
`test_slots_at_24_gb`."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from activation_peak import measure_prefill_peak
from freetoken.config import EngineConfig, ModelConfig
from freetoken.models.activations import step_activation_nbytes
from freetoken.models.demo import demo_config
from freetoken.models.demo_qwen3_5 import qwen3_5_demo_config
from freetoken.models.presets import preset_config_path
from freetoken.moe.budget import RESERVE_BYTES, activation_reserve_nbytes, plan_expert_slots

# The measured phases of `measure_prefill_peak` by the formula's part they are checked against.
PART_OF_PHASE = {"layer": ("norms", "embeddings"), "attention": ("attention",), "moe": ("moe",)}
PART_OF_PHASE |= {"linear_attention": ("linear_attention",), "shared_expert": ("shared_expert",), "logits": ("logits",)}


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(preset_config_path(name).read_text()), source="preset")


def check(cfg: ModelConfig, query_lens: list[int], context_lens: list[int], device: str, dtype: torch.dtype) -> None:
    """Every measured part within the formula's; for one sequence, the formula's peak within the metadata (not
    measured: made before the forward pass) and 0.5 % of the measured peak."""
    tokens, context, seqs = sum(query_lens), max(context_lens), len(query_lens)
    parts = step_activation_nbytes(cfg, tokens, context, seqs, dtype)
    measured = measure_prefill_peak(cfg, query_lens, context_lens, device, dtype)
    for phase, nbytes in measured.phases.items():
        bound = max(parts[part] for part in PART_OF_PHASE[phase])
        assert nbytes <= bound, (phase, nbytes, bound, measured.phase_live[phase])
    assert measured.nbytes <= max(parts.values())
    if seqs == 1:
        metadata = 2 * tokens * 8 + context * 12
        forward = max(v for k, v in parts.items() if k != "logits")  # logits: an allowance for the sampler
        assert forward - measured.nbytes <= metadata + measured.nbytes // 200, (forward, measured.nbytes, parts)


@pytest.mark.parametrize(
    "model,query_lens,context_lens",
    [
        ("qwen3-30b-a3b", [32768], [32768]),  # the chunk, a cold prompt
        ("qwen3-30b-a3b", [8192], [40960]),  # the last chunk of a max_model_len prompt
        ("qwen3-30b-a3b", [32753] + [1] * 15, [32768] + [40960] * 15),  # beside 15 decodes at the longest context
        ("qwen3.5-35b-a3b", [32768], [32768]),
        ("qwen3.5-35b-a3b", [4096], [16384]),
        ("qwen3.5-35b-a3b", [8177] + [1] * 15, [8192] + [30000] * 15),
    ],
)
def test_formula_covers_the_measured_peak_at_real_shapes(model, query_lens, context_lens):
    check(preset(model), query_lens, context_lens, "meta", torch.bfloat16)


@pytest.mark.parametrize("qwen3_5", [False, True])
@pytest.mark.parametrize("query_lens,context_lens", [([37], [37]), ([21], [53]), ([19, 1, 1], [40, 61, 33])])
def test_formula_covers_the_measured_peak_of_small_configs(qwen3_5, query_lens, context_lens):
    """The demo configs (hidden 64, odd lengths): the terms that real shapes dwarf (RoPE tables, metadata, router)."""
    raw = qwen3_5_demo_config() if qwen3_5 else demo_config()
    check(ModelConfig.from_dict(raw), query_lens, context_lens, "meta", torch.float32)


@pytest.mark.cuda_mocked
def test_slots_at_24_gb(monkeypatch, caplog):
    """Issue 21's setting (Qwen3-30B-A3B, --gpu-memory-gb 24 --max-prefill-tokens 32768 --kv-cache-gb 8): the
    reserve is the step's peak (2.19 GB at 32768 tokens, in the routed experts' kernel; decodes beside the chunk add
    their rows only) plus `RESERVE_BYTES`, not the 7.5 GB of 24 [tokens, hidden] float32 tensors, which left 316
    slots: now 766."""
    cfg = preset("qwen3-30b-a3b")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200e9, 200e9))
    stride = 3 * 768 * 2048 * 2
    engine = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_gb=24, max_prefill_tokens=32768, kv_cache_gb=8)
    reserve = activation_reserve_nbytes(engine, cfg, torch.bfloat16)
    assert reserve == RESERVE_BYTES + 2_192_149_984
    with caplog.at_level(logging.INFO, logger="freetoken.moe.budget"):
        slots, buffers = plan_expert_slots(engine, cfg, torch.bfloat16, stride, "offload")
    assert (slots, buffers) == (766, 2)
    assert "activation reserve 3.27 GB (a 32768-token step's peak, in moe, 2.19 GB" in caplog.text
    assert "(766 slots of 6144 experts)" in caplog.text


@pytest.mark.cuda_mocked
def test_activation_reserve_flag_overrides_the_formula(monkeypatch, caplog):
    """`--activation-reserve-gb` replaces the formula's reserve (a safety valve should a device need more), the log
    says so beside the formula's figure; a negative size is refused naming the flag."""
    cfg = preset("qwen3-30b-a3b")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200e9, 200e9))
    stride = 3 * 768 * 2048 * 2
    base = dict(device="cuda", dtype="bfloat16", gpu_memory_gb=24, max_prefill_tokens=32768, kv_cache_gb=8)
    engine = EngineConfig(activation_reserve_gb=5.0, **base)
    assert activation_reserve_nbytes(engine, cfg, torch.bfloat16) == 5_000_000_000
    with caplog.at_level(logging.INFO, logger="freetoken.moe.budget"):
        assert plan_expert_slots(engine, cfg, torch.bfloat16, stride, "offload") == (582, 2)
    # The reserve before the formula, 1 GiB + 24 x 32768 x 2048 x 4 bytes: the 316 slots of issue 21's run.
    old = EngineConfig(activation_reserve_gb=(2**30 + 24 * 32768 * 2048 * 4) / 1e9, **base)
    assert plan_expert_slots(old, cfg, torch.bfloat16, stride, "offload") == (316, 2)
    assert "activation reserve 5.00 GB as --activation-reserve-gb says" in caplog.text
    with pytest.raises(ValueError, match="--activation-reserve-gb must be >= 0"):
        EngineConfig(device="cpu", activation_reserve_gb=-1).validate()
