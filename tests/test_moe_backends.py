"""Every expert-cache backend (offload, cpu, hybrid) gives the logits of `fused` on the same checkpoint.

CPU device, float32 compute over bf16-stored weights (the pool's format), at several cache sizes down to one slot,
smaller than a single token's working set (top-k experts in every MoE layer). Experts run on the slots match to
float32 rounding; the host kernels take their inputs in bf16 (AVX-512-BF16/AMX dot products), so a run that used
them matches to bf16 rounding of the hidden states.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken._core import ExpertPool
from freetoken.models.attention import AttentionMetadata
from freetoken.models.demo import build_demo_checkpoint
from freetoken.models.loader import load_checkpoint
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts

DEVICE = torch.device("cpu")
PROFILE = dict(pcie_bytes_per_s=50e9, cpu_bytes_per_s={1: 20e9, 4: 40e9, 16: 60e9})


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The demo model with its weights stored in bfloat16 (so the pool holds exactly the fused weights)."""
    path = build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=5, num_experts=16, num_experts_per_tok=4)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


def _logits(model, prompt: list[int]) -> torch.Tensor:
    from freetoken.engine.kv_cache import KVCache

    cfg = model.config
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8, 16, torch.float32, DEVICE)
    n = len(prompt)
    meta = AttentionMetadata.build([n], [n], [list(range(kv.blocks_for(n)))], kv.block_size, DEVICE)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(prompt), meta, kv.layers))


@pytest.mark.parametrize(
    "mode,num_slots",
    [("offload", 64), ("offload", 9), ("offload", 1), ("cpu", 0), ("hybrid", 64), ("hybrid", 3)],
)
def test_backend_logits_equal_fused(bf16_checkpoint, mode, num_slots):
    model = load_checkpoint(bf16_checkpoint, FusedExperts(), DEVICE, torch.float32)
    prompts = [[3, 17, 100, 42, 7, 8, 9, 200, 13], list(range(1000, 1040))]
    expected = [_logits(model, p) for p in prompts]
    pool = ExpertPool.from_checkpoint(bf16_checkpoint)
    backend = ExpertCacheBackend(mode, pool, DEVICE, num_slots, cpu_threads=2, **PROFILE)
    model.attach_experts(backend)
    got = [[_logits(model, p) for p in prompts] for _ in range(2)]  # the second pass starts from a warm cache
    stats = backend.stats()["layers"]
    hits, fills, cpu = sum(stats["hits"]), sum(stats["fills"]), sum(stats["cpu_runs"])
    tol = 2e-3 if cpu else 1e-5
    for run in got:
        for logits, want in zip(run, expected):
            torch.testing.assert_close(logits, want, atol=tol, rtol=tol)
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
    with pytest.raises(ValueError, match="hybrid needs a bandwidth profile"):
        ExpertCacheBackend("hybrid", pool, DEVICE, 8)
    with pytest.raises(ValueError, match="at least one expert slot"):
        ExpertCacheBackend("offload", pool, DEVICE, 0)
    with pytest.raises(ValueError, match="expected one of"):
        ExpertCacheBackend("magic", pool, DEVICE, 8)
