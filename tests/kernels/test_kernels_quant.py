"""The quantized grouped MoE kernels (`freetoken.kernels.fused_moe_quant`) against their torch reference.

Without a GPU, Triton's interpreter (TRITON_INTERPRET=1, set in conftest) runs them on the CPU in float32 at small
shapes, so CI checks the decoding, scale indexing and masking; the `gpu` tests run the real Qwen3-30B-A3B shapes in
bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.fused_moe_quant import fused_moe_quant, fused_moe_quant_reference
from freetoken.quant import MXFP4, NVFP4, fp8_block
from freetoken.quant import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [fp8_block(32, 32), fp8_block(), NVFP4, MXFP4]
IDS = ["fp8_32", "fp8_128", "nvfp4", "mxfp4"]


def quantized_slots(fmt, num_slots: int, hidden: int, inter: int, seed: int = 0, pad: int = 192) -> torch.Tensor:
    """[S, expert_nbytes + pad] uint8 slots (a padded stride, as the slot cache has) of reference-quantized
    N(0, 0.05) experts."""
    gen = torch.Generator().manual_seed(seed)
    layout = fmt.layout(hidden, inter)
    slots = torch.zeros(num_slots, layout.expert_nbytes + pad, dtype=torch.uint8)
    for s in range(num_slots):
        gate, up, down = (
            torch.randn(r, c, generator=gen) * 0.05 for r, c in ((inter, hidden),) * 2 + ((hidden, inter),)
        )
        ref.pack_expert(
            layout, *(ref.quantize_matrix(fmt, w) for w in (gate, up, down)), out=slots[s, : layout.expert_nbytes]
        )
    return slots


def _case(fmt, num_tokens: int, top_k: int, hidden: int, inter: int, num_slots: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    slots = quantized_slots(fmt, num_slots, hidden, inter).to(DEVICE)
    ids = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[0, -1] = -1  # a pair computed elsewhere
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    hidden_states = torch.randn(num_tokens, hidden, generator=gen)
    layout = fmt.layout(hidden, inter)
    got = fused_moe_quant(hidden_states.to(DEVICE, dtype), slots, layout, ids.to(DEVICE), weights.to(DEVICE, dtype))
    want = fused_moe_quant_reference(hidden_states.to(DEVICE), slots, layout, ids.to(DEVICE), weights.to(DEVICE))
    return got.float(), want


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 4), (5, 2)])
def test_quant_kernel_matches_reference_small(fmt, num_tokens, top_k):
    """float32 (the interpreter on the CPU): dots in float32 in another order than torch's: 1e-4 of the largest."""
    hidden, inter = (256, 128) if fmt.block_rows == 128 else (128, 64)
    got, want = _case(fmt, num_tokens, top_k, hidden, inter, 6, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [fp8_block(), NVFP4, MXFP4], ids=["fp8_128", "nvfp4", "mxfp4"])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 8), (4, 8), (64, 8), (512, 8)])
def test_quant_kernel_matches_reference_qwen3_30b_shapes(fmt, num_tokens, top_k):
    """bf16 activations at Qwen3-30B-A3B's shapes (H 2048, I 768), decode batch 1-64 and a 512-token prefill
    chunk; bf16 rounding of the GEMM outputs as the bf16 kernel: 2e-2 of the largest output."""
    got, want = _case(fmt, num_tokens, top_k, 2048, 768, 32, torch.bfloat16)
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
