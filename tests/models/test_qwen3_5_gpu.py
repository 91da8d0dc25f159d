"""Qwen3.5-MoE on a CUDA device: the Triton Gated DeltaNet kernels at the real head sizes, the hybrid engine on CUDA
(Triton prefill, CUDA-graph decode over the state pool) against the CPU path, bfloat16 against transformers, and the
expert cache's driven decode with the hybrid.

Skipped without a GPU; on the GPU box: python -m pytest tests/models/test_qwen3_5_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.kernels.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_torch,
)
from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint
from greedy import greedy_tokens
from reference_qwen3_5 import check_bfloat16_against_transformers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 5]


def _greedy(path, device: str, dtype: str, prompts, max_tokens: int, **engine_args) -> list[list[int]]:
    engine_args.setdefault("moe_backend", "fused")
    engine = LLMEngine.from_dir(path, EngineConfig(device=device, dtype=dtype, kv_cache_gb=0.5, **engine_args))
    return greedy_tokens(engine, prompts, max_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_at_real_head_sizes(dtype):
    """Qwen3.5-35B-A3B's heads (16 key heads, 32 value heads, 128 dims): prefill spans of 1..1000 tokens and a decode
    batch with padding rows, against the torch forms (float32 states)."""
    torch.manual_seed(0)
    heads_k, heads_v, dim = 16, 32, 128
    for length in (1, 63, 64, 200, 1000):
        q, k = (torch.randn(length, heads_k, dim, device="cuda", dtype=dtype) for _ in range(2))
        v = torch.randn(length, heads_v, dim, device="cuda", dtype=dtype)
        g = -torch.rand(length, heads_v, device="cuda") * 2
        beta = torch.rand(length, heads_v, device="cuda").to(dtype)
        state = torch.randn(heads_v, dim, dim, device="cuda")
        want, want_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
        got = chunk_gated_delta_rule(q, k, v, g, beta, state)
        tol = 2e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(state, want_state, atol=2e-4, rtol=2e-4)
    batch = 5
    q, k = (torch.randn(batch, heads_k, dim, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(batch, heads_v, dim, device="cuda", dtype=dtype)
    g, beta = -torch.rand(batch, heads_v, device="cuda"), torch.rand(batch, heads_v, device="cuda").to(dtype)
    states = torch.randn(8, heads_v, dim, dim, device="cuda")
    slots = torch.tensor([3, 1, 0, 7, 7], device="cuda")  # two padding rows on the scratch slot 7
    want_states = states.clone()
    want = recurrent_gated_delta_rule_torch(q, k, v, g, beta, want_states, slots)
    got = recurrent_gated_delta_rule(q, k, v, g, beta, states, slots)
    torch.testing.assert_close(
        got[:3].float(),
        want[:3].float(),
        atol=1e-2 if dtype != torch.float32 else 1e-5,
        rtol=1e-2 if dtype != torch.float32 else 1e-5,
    )
    torch.testing.assert_close(states[:7], want_states[:7], atol=1e-5, rtol=1e-5)


def test_hybrid_greedy_on_cuda_equals_cpu(tmp_path):
    """float32: CUDA (Triton prefill kernels, CUDA-graph decode over the state pool) gives the CPU's tokens, alone
    and batched with prefill chunks of 7 tokens."""
    path = build_qwen3_5_demo_checkpoint(tmp_path / "demo", seed=3)
    cpu = _greedy(path, "cpu", "float32", PROMPTS, 32)
    assert _greedy(path, "cuda", "float32", PROMPTS, 32) == cpu
    assert _greedy(path, "cuda", "float32", PROMPTS, 32, max_prefill_tokens=7) == cpu


def test_hybrid_cuda_graph_decode_equals_eager(tmp_path):
    """float32: the captured decode step (padding rows on the state pool's scratch slot) equals --enforce-eager."""
    path = build_qwen3_5_demo_checkpoint(tmp_path / "demo", seed=4)
    prompts = [[(7 * i + j) % 5000 + 1 for j in range(5 + i % 7)] for i in range(6)]
    assert _greedy(path, "cuda", "float32", prompts, 24) == _greedy(
        path, "cuda", "float32", prompts, 24, enforce_eager=True
    )


def test_expert_cache_decode_with_the_hybrid(tmp_path):
    """bfloat16: offload (slots hold half the pool, so misses are filled and the driven CUDA-graph decode serves the
    routed experts of every layer) gives fused's tokens; the slot kernel is fused's."""
    path = build_qwen3_5_demo_checkpoint(tmp_path / "demo", seed=6, num_experts=16, num_experts_per_tok=4)
    fused = _greedy(path, "cuda", "bfloat16", PROMPTS, 16)
    assert _greedy(path, "cuda", "bfloat16", PROMPTS, 16, moe_backend="offload", expert_slots=32) == fused
    assert (
        _greedy(path, "cuda", "bfloat16", PROMPTS, 16, moe_backend="offload", expert_slots=32, enforce_eager=True)
        == fused
    )


def test_bfloat16_follows_transformers(tmp_path):
    """bfloat16 on the GPU: logits as close to float32 as transformers' own bfloat16, and 16 greedy tokens equal to
    transformers' on the same GPU except from a near-tie within its own bfloat16 error
    (`reference_qwen3_5.check_bfloat16_against_transformers`)."""
    print(check_bfloat16_against_transformers(tmp_path, "cuda"))
