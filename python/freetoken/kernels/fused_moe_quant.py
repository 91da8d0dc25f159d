"""Grouped SwiGLU over quantized experts (FP8 block, NVFP4, MXFP4) in Triton, dequantizing in the inner loop.

Variants:
  - `fused_moe_quant`: `freetoken.kernels.fused_moe`'s two grouped kernels (gate/up + SiLU*up, then down + routing
    weight, over (token, expert) pairs sorted by expert and padded to BLOCK_SIZE_M, `align_pairs`), reading each
    expert's bytes from a uint8 table of experts or cache slots in the pool layout (`freetoken.quant.formats`):
    every weight tile is loaded as bytes, decoded with integer and float ops (e4m3 and e2m1 by their bit fields,
    e8m0 as an exponent) and scaled by its block's scale before the dot. One launch shape for decode (16-row M
    tiles, batch 1-64) and prefill chunks (64-row tiles), as the bf16 kernel.
  - `fused_moe_quant_reference`: the whole layer dequantized by `freetoken.quant.reference`, then
    `freetoken.kernels.fused_moe.fused_moe_reference` (float32), the correctness reference.

Decoding by bit fields (not a float8 cast) runs the same under TRITON_INTERPRET=1 on the CPU as on any GPU; on Hopper
the native e4m3 conversion (and FP8 tensor-core dots) is the next step where it measures faster.

Shapes (project letters): M tokens, K hidden, N expert intermediate, S slots (or E experts), k top-k.
Test: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_kernels_quant.py   (GPU sizes: -m gpu on a CUDA machine)
Bench: python benches/quant_moe.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from freetoken.kernels.fused_moe import align_pairs, block_m_for, fused_moe_reference
from freetoken.kernels.moe_tiles import swiglu_rounded, tile_rows
from freetoken.quant.formats import ExpertLayout
from freetoken.quant.reference import dequantize_experts

FORMAT_IDS = {"fp8_block": 0, "nvfp4": 1, "mxfp4": 2}


@triton.jit
def _e4m3(code):
    """e4m3 codes (int32, 0..255) -> float32 (OCP OFP8: bias 7, exponent 0 subnormal m/8 * 2^-6)."""
    mag = code & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag < 8, mag.to(tl.float32) * (1.0 / 512.0), normal)
    return tl.where((code & 0x80) != 0, -value, value)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32 (OCP MX: bias 1; 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    value = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _weight_tile(
    base,
    rows,
    cols,
    num_cols,
    weight_off,
    scale_off,
    tensor_scale,
    ok,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """The float32 weights W[rows, cols] of one matrix stored at `base + weight_off` (row-major, `num_cols` columns)
    with its block scales at `base + scale_off`; `rows` and `cols` broadcast to the tile's shape."""
    num_scale_cols = (num_cols + BLOCK_COLS - 1) // BLOCK_COLS
    scale_idx = (rows // BLOCK_ROWS) * num_scale_cols + cols // BLOCK_COLS
    if FORMAT == 0:
        code = tl.load(base + weight_off + rows * num_cols + cols, mask=ok, other=0).to(tl.int32)
        scale = tl.load((base + scale_off).to(tl.pointer_type(tl.float32)) + scale_idx, mask=ok, other=0.0)
        return _e4m3(code) * scale
    byte = tl.load(base + weight_off + (rows * num_cols + cols) // 2, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)) & 0xF
    scale_code = tl.load(base + scale_off + scale_idx, mask=ok, other=0).to(tl.int32)
    if FORMAT == 1:
        return _e2m1(code) * (_e4m3(scale_code) * tensor_scale)
    return _e2m1(code) * (scale_code << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gate_up_quant_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    top_k,
    stride_xm,
    stride_we,
    stride_hm,
    up_off,
    gate_up_scale_off,
    up_scale_off,
    tensor_scale_off,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_TENSOR_SCALE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """h[row, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n]) for the rows of one expert's M tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ts = 1.0
    up_ts = 1.0
    if HAS_TENSOR_SCALE:
        ts_ptr = (base + tensor_scale_off).to(tl.pointer_type(tl.float32))
        gate_ts = tl.load(ts_ptr)
        up_ts = tl.load(ts_ptr + 1)
    acc_gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    n_ok = offs_n[None, :] < N
    for k0 in range(0, K, BLOCK_SIZE_K):
        k = offs_k[:, None] + k0
        ok = (k < K) & n_ok
        a = tl.load(
            x_ptr + token[:, None] * stride_xm + k0 + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k[None, :] + k0 < K),
            other=0.0,
        )
        g = _weight_tile(base, offs_n[None, :], k, K, 0, gate_up_scale_off, gate_ts, ok, FORMAT, BLOCK_ROWS, BLOCK_COLS)
        u = _weight_tile(base, offs_n[None, :], k, K, up_off, up_scale_off, up_ts, ok, FORMAT, BLOCK_ROWS, BLOCK_COLS)
        acc_gate = tl.dot(a.to(tl.float32), g, acc_gate, input_precision="ieee")
        acc_up = tl.dot(a.to(tl.float32), u, acc_up, input_precision="ieee")
    h = swiglu_rounded(acc_gate, acc_up, h_ptr)
    tl.store(
        h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok
    )


@triton.jit
def _down_quant_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weight_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    num_pairs,
    K,
    N,
    stride_hm,
    stride_we,
    stride_om,
    down_off,
    down_scale_off,
    tensor_scale_off,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_TENSOR_SCALE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """out[pair, kk] = weight[pair] * (h[row] . down[e, kk]) for the rows of one expert's M tile (kk over K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    offs_out = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_in = tl.arange(0, BLOCK_SIZE_K)
    base = w_ptr + expert.to(tl.int64) * stride_we
    ts = 1.0
    if HAS_TENSOR_SCALE:
        ts = tl.load((base + tensor_scale_off).to(tl.pointer_type(tl.float32)) + 2)
    out_ok = offs_out[None, :] < K
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_SIZE_K):
        n = offs_in[:, None] + n0
        a = tl.load(
            h_ptr + rows[:, None] * stride_hm + n0 + offs_in[None, :],
            mask=row_ok[:, None] & (offs_in[None, :] + n0 < N),
            other=0.0,
        )
        b = _weight_tile(
            base,
            offs_out[None, :],
            n,
            N,
            down_off,
            down_scale_off,
            ts,
            (n < N) & out_ok,
            FORMAT,
            BLOCK_ROWS,
            BLOCK_COLS,
        )
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision="ieee")
    routing = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_out[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok)


def fused_moe_quant(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed SwiGLU experts of each token, the experts quantized.

    Args:
        hidden: [M, K] activations (bf16/fp16/fp32, contiguous), CUDA (or CPU under TRITON_INTERPRET=1).
        experts: [S, stride] uint8, one expert (or cache slot) per row in `layout`'s pool layout, stride >=
            expert_nbytes; the same device.
        layout: the experts' `ExpertLayout` (fp8_block, nvfp4 or mxfp4; K = layout.hidden, N = layout.inter).
        topk_ids: [M, k] int64 rows of `experts`; negative: skip that pair (computed elsewhere).
        topk_weights: [M, k] routing weights.
        alignment: `align_pairs(topk_ids, S, block_m_for(M * k))`, when the caller has it.
        out: [M, K] buffer for the result (hidden's dtype); None allocates.

    Returns:
        [M, K] in hidden's dtype, as `freetoken.kernels.fused_moe.fused_moe` computes it from the dequantized
        weights (dots in float32 with the activations widened; rounded to hidden's dtype where it rounds).
    """
    if alignment is None:
        alignment = align_pairs(topk_ids, experts.shape[0], block_m_for(topk_ids.numel()))
    sorted_pairs, block_expert = alignment
    return fused_moe_quant_tiles(hidden, experts, layout, topk_weights, sorted_pairs, block_expert[None], out=out)


def fused_moe_quant_tiles(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    topk_weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    tile_stages: torch.Tensor,
    out: torch.Tensor | None = None,
    before_stage: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """`fused_moe_quant` over an alignment whose tiles are split in stages run one after the other, as
    `freetoken.kernels.fused_moe.fused_moe_tiles` does for bf16 (the decode driver's hits, then its fills).

    Args:
        hidden, experts, layout, topk_weights, out: as `fused_moe_quant`.
        sorted_pairs: [R] int64 of `align_pairs` (block_m_for(M * k) rows per tile).
        tile_stages: [S, R / block_m] int64: the slot of each tile in the stage that runs it, -1 in the others.
        before_stage: called with s before stage s > 0 is queued.

    Returns:
        [M, K] as `fused_moe_quant`; each tile computed by the same kernels whatever the staging.
    """
    fmt = layout.format
    if fmt.name not in FORMAT_IDS:
        raise ValueError(f"fused_moe_quant runs {', '.join(FORMAT_IDS)} experts, not {fmt.name}")
    num_tokens, hidden_size = hidden.shape
    inter = layout.inter
    top_k = topk_weights.shape[1]
    num_pairs = num_tokens * top_k
    block_m = block_m_for(num_pairs)
    num_rows = sorted_pairs.numel()
    h = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    pairs = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    sec = layout.sections
    gate_up_off, gate_up_n = sec["gate_up"]
    gate_up_scale_off, gate_up_scale_n = sec["gate_up_scale"]
    meta = {
        "FORMAT": FORMAT_IDS[fmt.name],
        "BLOCK_ROWS": fmt.block_rows,
        "BLOCK_COLS": fmt.block_cols,
        "HAS_TENSOR_SCALE": fmt.tensor_scale,
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64,
        "BLOCK_SIZE_K": 64,
    }
    for stage, block_expert in enumerate(tile_stages):
        if stage and before_stage is not None:
            before_stage(stage)
        grid = (num_rows // block_m, triton.cdiv(inter, 64))
        _gate_up_quant_kernel[grid](
            hidden,
            experts,
            h,
            sorted_pairs,
            block_expert,
            num_pairs,
            inter,
            hidden_size,
            top_k,
            hidden.stride(0),
            experts.stride(0),
            h.stride(0),
            gate_up_off + gate_up_n // 2,
            gate_up_scale_off,
            gate_up_scale_off + gate_up_scale_n // 2,
            sec["tensor_scale"][0],
            **meta,
        )
        grid = (num_rows // block_m, triton.cdiv(hidden_size, 64))
        _down_quant_kernel[grid](
            h,
            experts,
            pairs,
            weights,
            sorted_pairs,
            block_expert,
            num_pairs,
            hidden_size,
            inter,
            h.stride(0),
            experts.stride(0),
            pairs.stride(0),
            sec["down"][0],
            sec["down_scale"][0],
            sec["tensor_scale"][0],
            **meta,
        )
    return torch.sum(pairs.view(num_tokens, top_k, hidden_size), dim=1, out=out)


def fused_moe_quant_reference(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe_quant` in plain torch: every expert dequantized (`reference.dequantize_experts`), float32."""
    gate_up, down = dequantize_experts(layout, experts)
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights)
