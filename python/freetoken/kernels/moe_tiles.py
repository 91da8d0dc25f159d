"""What the grouped SwiGLU kernels share (`fused_moe`, `fused_moe_quant`): the M tile a program owns in the sorted,
expert-aligned pairs (`fused_moe.align_pairs`), and the SwiGLU rounded as the reference rounds it.

Both are `triton.jit` functions inlined into the kernels that call them, so the compiled kernels are the same as with
the lines written in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the FORMAT constexpr of the quantized kernels (`fused_moe_quant`'s and `fused_moe_gemv`'s), by format name
FORMAT_IDS = {"fp8_block": 0, "nvfp4": 1, "mxfp4": 2}


@triton.jit
def tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M: tl.constexpr):
    """M tile `pid_m`: (its rows in the sorted pairs [BLOCK_SIZE_M], the pair id in each row (token * k + j), which
    rows hold a pair and not padding). Call it once the tile's expert is known to be >= 0 (a -1 tile has no rows)."""
    rows = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_pair_ptr + rows)
    return rows, pair, pair < num_pairs


@triton.jit
def swiglu_rounded(acc_gate, acc_up, h_ptr):
    """silu(gate) * up from the float32 GEMM accumulators, rounded to `h_ptr`'s dtype where the reference
    (transformers' Qwen3MoeExperts in the model dtype) rounds: the GEMM outputs, SiLU, then the product; so
    low-precision results follow it, not only float32 ones. Returns float32 (the product not yet rounded)."""
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return act * acc_up.to(dtype).to(tl.float32)


@triton.jit
def e4m3_f16(code):
    """FP8 e4m3 codes (int32, 0..255) -> float16 holding the value * 2^-8, exactly, by moving bit fields only.

    e4m3 (s eeee mmm, bias 7) shifted left by 7 is a float16 (bias 15) of the same sign, exponent field and
    mantissa: the value scaled by 2^(7 - 15), subnormals included (e4m3's m/8 * 2^-6 lands on float16's m/8 * 2^-14),
    so no select and no exp2 per element; the caller multiplies its tile scale by 2^8. The NaN code (S.1111.111)
    decodes as 480 (as the previous decoder did): `reference.nonfinite_experts` refuses such experts at load."""
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)
