"""What the grouped SwiGLU kernels share (`fused_moe`, `fused_moe_quant`): the M tile a program owns in the sorted,
expert-aligned pairs (`fused_moe.align_pairs`), the SwiGLU rounded as the reference rounds it, and the sum of a
token's k expert outputs (`sum_pairs`).

The `triton.jit` helpers are inlined into the kernels that call them, so the compiled kernels are the same as with
the lines written in place.
"""

from __future__ import annotations

import torch
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


SUM_PAIRS_SMALL_TOKENS = 64  # up to this many tokens, `sum_pairs` runs programs of one warp over 128 columns


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, cols] = sum over j < TOP_K of pairs[t * TOP_K + j, cols], in float32 in j order, rounded once; program
    (t, c) takes BLOCK_H columns."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j).to(tl.int64) * hidden_size + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * hidden_size + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_pairs(
    pairs: torch.Tensor, top_k: int, out: torch.Tensor | None = None, kernel: bool | None = None
) -> torch.Tensor:
    """The sum of each token's k expert outputs (or k * split shares of them: `fused_moe_fp4_mma`'s split down
    kernel), summed in float32 in j order and rounded once (as `torch.sum(pairs.view(T, k, H), dim=1)`, which sums
    in float32 in an order of its own). One small Triton launch in place of torch's reduction over the middle
    dimension: 1.5 against 4.5 us a layer call at batch 1 on the H200, and the `fused` backend's GPU time per decode
    step of Qwen3-30B-A3B 3.83 -> 3.68 ms (`benches/decode_fused.py --profile`, 5 steps, one run each).

    Args:
        pairs: [T * k, H] (row t * k + j: token t's j-th expert), contiguous, any float dtype and device (Triton's
            interpreter off CUDA).
        top_k: k.
        out: [T, H] buffer for the result, pairs' dtype and device, contiguous (e.g. a CUDA graph's static input),
            written in place; None allocates.
        kernel: True: the Triton launch (Triton's interpreter off CUDA), False: `torch.sum`, None: the launch on
            CUDA, else `torch.sum` (which also runs on the meta device, `tests/activation_peak.py`).

    Returns:
        [T, H] in pairs' dtype: `out` where given.

    Raises:
        ValueError: pairs not contiguous or not whole tokens of k rows; `out` of another shape, dtype or device, or
            not contiguous."""
    num_pairs, hidden_size = pairs.shape
    if not pairs.is_contiguous() or top_k < 1 or num_pairs % top_k:
        shape, strides = tuple(pairs.shape), pairs.stride()
        raise ValueError(f"sum_pairs takes contiguous [T * {top_k}, H] pairs, not {shape} with strides {strides}")
    num_tokens = num_pairs // top_k
    if out is None:
        out = torch.empty(num_tokens, hidden_size, dtype=pairs.dtype, device=pairs.device)
    elif (
        out.shape != (num_tokens, hidden_size)
        or out.dtype != pairs.dtype
        or out.device != pairs.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"sum_pairs writes a contiguous [{num_tokens}, {hidden_size}] {pairs.dtype} out on {pairs.device}, not "
            f"{tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    if not (kernel or (kernel is None and pairs.is_cuda)):
        return torch.sum(pairs.view(num_tokens, top_k, hidden_size), dim=1, out=out)
    if num_tokens:
        # decode batches: programs of one warp over 128 columns, so that a token's rows are read by many SMs at once
        # (H200, 2048 columns, 1 token: 8 rows 1.54 against 1.63 us with (1024, 4), 24 rows 1.61 against 3.16;
        # 8 tokens of 24 rows 1.82 against 3.28)
        block_h, num_warps = (128, 1) if num_tokens <= SUM_PAIRS_SMALL_TOKENS else (1024, 4)
        block_h = min(block_h, triton.next_power_of_2(hidden_size))
        _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
            pairs, out, hidden_size, TOP_K=top_k, BLOCK_H=block_h, num_warps=num_warps
        )
    return out
