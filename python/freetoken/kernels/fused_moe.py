"""Grouped SwiGLU over the routed experts of a batch, in Triton.

Variants:
  - `fused_moe`: (token, expert) pairs are sorted by expert and each expert's group is padded to BLOCK_SIZE_M rows
    (the alignment of vLLM's fused_moe, Kwon et al.), so every M tile belongs to one expert; two kernels then run
    gate/up + SiLU*up (`_gate_up_kernel`) and down + routing weight (`_down_kernel`) as grouped GEMMs, reading
    each expert's weights through its index into a stacked weight tensor (E experts, or S cache slots).
    The launch grid has a fixed upper bound and no step syncs with the host, so a decode step can be captured in
    a CUDA graph.
  - `fused_moe_tiles`: the same over tiles split in stages run one after the other (the decode driver's hits,
    then its fills once they land).
  - `fused_moe_reference`: the same maths in plain torch, the correctness reference.
  - `align_pairs`: the sort and padding, on CUDA at decode sizes one Triton program (`_align_pairs_kernel`), whose
    single launch replaced ~25 small tensor ops: a layer call of `fused_moe` at batch 1 replayed from a CUDA graph
    went from 92.6 to 34.9 us, and the `fused` backend's decode of Qwen3-30B-A3B (H200, bf16, dummy weights) from
    141.5 to 211.0 tok/s at batch 1 and from 660 to 857 at batch 8 (`benches/decode_fused.py --align kernel ops`,
    both in one run; the 92.6 and 34.9 us are `benches/quant_moe.py`'s bf16 row in a run before and one after).

Shapes (project letters): M tokens, K hidden, N expert intermediate, E experts (or slots), k top-k.
Test: python -m pytest tests/kernels/test_kernels.py     Bench: python benches/decode_fused.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from freetoken._core import aligned_len
from freetoken.kernels.moe_tiles import sum_pairs, swiglu_rounded, tile_rows


@triton.jit
def _gate_up_kernel(
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
    stride_wn,
    stride_hm,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """h[row, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n]) for the rows of one expert's M tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    n_ok = offs_n[None, :] < N
    for k0 in range(0, K, BLOCK_SIZE_K):
        k_ok = offs_k + k0 < K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(gate_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        u = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc_gate = tl.dot(a, g, acc_gate, input_precision="ieee")
        acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
        x_ptrs += BLOCK_SIZE_K
        gate_ptrs += BLOCK_SIZE_K
        up_ptrs += BLOCK_SIZE_K
    h = swiglu_rounded(acc_gate, acc_up, h_ptr)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok)


@triton.jit
def _down_kernel(
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
    stride_wk,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """out[pair, kk] = weight[pair] * (h[row] . w[e, kk]) for the rows of one expert's M tile (kk over hidden K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    offs_out = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_in = tl.arange(0, BLOCK_SIZE_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_in[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_out[None, :] * stride_wk + offs_in[:, None]
    out_ok = offs_out[None, :] < K
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_SIZE_K):
        in_ok = offs_in + n0 < N
        a = tl.load(h_ptrs, mask=row_ok[:, None] & in_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=in_ok[:, None] & out_ok, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        h_ptrs += BLOCK_SIZE_K
        w_ptrs += BLOCK_SIZE_K
    routing = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]  # rounded like the reference
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_out[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok)


@triton.jit
def _align_pairs_kernel(
    ids_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_rows,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FILL: tl.constexpr,
):
    """`align_pairs` in one program: a histogram of the pairs' buckets (experts, then bucket `num_experts` for the
    skipped pairs, which ids past the experts join; padding lanes in the last bin, BLOCK_E - 1 > num_experts), each
    bucket's padded start from a prefix sum, and a sort of the keys bucket * BLOCK_P + pair (distinct, so the order
    within a bucket is the pairs' own: stable). The sorted key at position p is pair p - first[bucket] rows into its
    bucket's padded group; a tile starts at every such row that is a multiple of BLOCK_M. Rows and tiles are filled
    first (num_pairs, -1; FILL at a time), then written over after a barrier: one program, so its threads see each
    other's stores after it."""
    i = tl.arange(0, BLOCK_P)
    real = i < num_pairs
    ids = tl.load(ids_ptr + i, mask=real, other=0)
    bucket = tl.where(real, tl.where((ids < 0) | (ids >= num_experts), num_experts, ids), BLOCK_E - 1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e <= num_experts, tl.histogram(bucket, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_start = tl.cumsum(padded, 0) - padded
    first = tl.cumsum(counts, 0) - counts
    keys = tl.sort(bucket * BLOCK_P + i)  # padding lanes (the last bin) sort last
    pair = keys % BLOCK_P
    sorted_bucket = keys // BLOCK_P
    rank = i - tl.gather(first, sorted_bucket, 0)
    dest = tl.gather(group_start, sorted_bucket, 0) + rank
    f = tl.arange(0, FILL)
    for start in range(0, num_rows, FILL):
        tl.store(sorted_pair_ptr + start + f, tl.full([FILL], 0, tl.int64) + num_pairs, mask=start + f < num_rows)
    for start in range(0, num_tiles, FILL):
        tl.store(block_expert_ptr + start + f, tl.full([FILL], -1, tl.int64), mask=start + f < num_tiles)
    tl.debug_barrier()
    tl.store(sorted_pair_ptr + dest, pair.to(tl.int64), mask=real)
    tile_first = real & (rank % BLOCK_M == 0) & (sorted_bucket < num_experts)
    tl.store(block_expert_ptr + dest // BLOCK_M, sorted_bucket.to(tl.int64), mask=tile_first)


# `align_pairs` runs `_align_pairs_kernel` on CUDA up to these sizes (decode steps and short prefill chunks; larger
# chunks take the tensor ops, whose launches are a small share of their time): pairs, and experts (or slots) + 2
# histogram bins
ALIGN_KERNEL_MAX_PAIRS = 1024
ALIGN_KERNEL_MAX_BINS = 8192


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert and pad each expert's group to a multiple of `block_m`.

    Fixed-shape work only (no host sync), so it can be captured in a CUDA graph: one Triton program
    (`_align_pairs_kernel`) or ~25 tensor ops, the same result bit for bit. The one launch is what a decode step's
    CUDA graph wants, once per MoE layer.

    Args:
        topk_ids: [M, k] int64 (or, for the Triton program, int32) expert (or slot) ids in [0, num_experts), on any
            device; a negative id skips the pair (an expert computed elsewhere, e.g. on the CPU): its tiles get
            expert -1. An id >= num_experts is an error: the tensor ops raise (an index error, a device assert on
            CUDA), the Triton program skips the pair as if negative.
        num_experts: E, the number of distinct ids possible.
        block_m: rows per M tile.
        kernel: True: the Triton program (Triton's interpreter off CUDA), False: the tensor ops, None: the program
            on CUDA within ALIGN_KERNEL_MAX_PAIRS pairs and ALIGN_KERNEL_MAX_BINS - 2 experts, else the ops.

    Returns:
        sorted_pairs: [R] int64, pair index (token * k + j) of each row, `M * k` on padding rows;
            R = M*k + min(M*k, E + 1) * (block_m - 1) rounded up to block_m, an upper bound of the padded total
            (`freetoken._core.aligned_len`).
        block_expert: [R / block_m] int64, the expert of each M tile, -1 for tiles past the end.

    Raises:
        ValueError: kernel=True past ALIGN_KERNEL_MAX_PAIRS pairs or ALIGN_KERNEL_MAX_BINS - 2 experts.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    fits = num_pairs <= ALIGN_KERNEL_MAX_PAIRS and num_experts + 2 <= ALIGN_KERNEL_MAX_BINS
    if kernel and not fits:
        raise ValueError(
            f"align_pairs' Triton program takes up to {ALIGN_KERNEL_MAX_PAIRS} pairs and "
            f"{ALIGN_KERNEL_MAX_BINS - 2} experts, not {num_pairs} and {num_experts}"
        )
    num_rows, num_tiles = aligned_len(num_pairs, num_experts, block_m)
    if kernel or (kernel is None and fits and flat.is_cuda):
        sorted_pairs = torch.empty(num_rows, dtype=torch.int64, device=flat.device)
        block_expert = torch.empty(num_tiles, dtype=torch.int64, device=flat.device)
        if num_pairs:  # else no rows and no tiles
            _align_pairs_kernel[(1,)](
                flat.contiguous(),
                sorted_pairs,
                block_expert,
                num_pairs,
                num_experts,
                num_rows,
                num_tiles,
                BLOCK_M=block_m,
                BLOCK_P=max(16, triton.next_power_of_2(num_pairs)),
                BLOCK_E=triton.next_power_of_2(num_experts + 2),
                FILL=1024,
                num_warps=4,
            )
        return sorted_pairs, block_expert
    # Skipped pairs go to one extra bucket, number num_experts, whose tiles are marked -1 below.
    flat = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[sorted_ids]
    dest = padded_end[sorted_ids] - padded[sorted_ids] + rank
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)
    tile_start = torch.arange(0, num_rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_pairs, block_expert


def block_m_for(num_pairs: int) -> int:
    """Rows per M tile: 16 for decode-sized batches (<= 512 token-expert pairs), 64 for prefill chunks."""
    return 16 if num_pairs <= 512 else 64


# (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) of both kernels; `fused_moe(config=...)` overrides it
# (benches/prefill_compute.py times alternatives at prefill sizes).
LAUNCH_CONFIG = (64, 64, 4, 3)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] = LAUNCH_CONFIG,
) -> torch.Tensor:
    """Weighted sum of the routed SwiGLU experts of each token.

    Args:
        hidden: [M, K] activations (bf16/fp16/fp32, CUDA, contiguous).
        w_gate_up: [E, 2N, K] gate rows then up rows per expert (or per cache slot), same dtype.
        w_down: [E, K, N] down projection per expert.
        topk_ids: [M, k] int64 indices into the first dim of the weights; negative: skip that pair.
        topk_weights: [M, k] routing weights.
        alignment: (sorted_pairs, block_expert) of `align_pairs` for these ids with block_m_for(M * k), already on
            the device (e.g. from `freetoken._core.align_slots`); computed here when None.
        out: [M, K] buffer for the result (hidden's dtype), e.g. a CUDA graph's static input; None allocates.
        config: (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) of the kernels (`LAUNCH_CONFIG`).

    Returns:
        [M, K] in hidden's dtype: sum_j topk_weights[m, j] * down_e(silu(gate_e h) * up_e h), e = topk_ids[m, j].
        GEMMs accumulate in float32 and round to hidden's dtype where transformers does; the k expert outputs of
        a token are summed in float32 and rounded once (transformers adds them one by one in the model dtype,
        in expert order; the two agree for k <= 2).
    """
    if alignment is None:
        alignment = align_pairs(topk_ids, w_gate_up.shape[0], block_m_for(topk_ids.numel()))
    sorted_pairs, block_expert = alignment
    return fused_moe_tiles(
        hidden, w_gate_up, w_down, topk_weights, sorted_pairs, block_expert[None], out=out, config=config
    )


def fused_moe_tiles(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    tile_stages: torch.Tensor,
    out: torch.Tensor | None = None,
    before_stage: Callable[[int], None] | None = None,
    config: tuple[int, int, int, int] = LAUNCH_CONFIG,
) -> torch.Tensor:
    """`fused_moe` over an alignment whose tiles are split in stages that run one after the other: stage s runs
    the gate/up and down kernels over the tiles of row s, after `before_stage(s)` has queued what it must wait
    for (s > 0). The decode driver runs the tiles of hits while the fills cross PCIe, and the tiles of the filled
    slots once they have landed (`freetoken.moe.handshake`). Each tile is computed by the same kernels as in one
    stage, so the result is bit for bit `fused_moe`'s.

    Args:
        hidden, w_gate_up, w_down, topk_weights, out, config: as `fused_moe`.
        sorted_pairs: [R] int64 of `align_pairs` (block_m_for(M * k) rows per tile).
        tile_stages: [S, R / block_m] int64: the expert (or slot) of each tile in the stage that runs it, -1 in
            the others (each tile in at most one stage).
        before_stage: called with s before stage s > 0 is queued.

    Returns:
        [M, K] as `fused_moe`.
    """
    num_tokens, hidden_size = hidden.shape
    inter = w_gate_up.shape[1] // 2  # experts or slots: any first-dim stride (slot padding) works
    top_k = topk_weights.shape[1]
    num_pairs = num_tokens * top_k
    block_m = block_m_for(num_pairs)
    num_rows = sorted_pairs.numel()
    h = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    pairs = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)  # skipped pairs stay 0
    weights = topk_weights.reshape(-1).contiguous()
    block_n, block_k, num_warps, num_stages = config
    for stage, block_expert in enumerate(tile_stages):
        if stage and before_stage is not None:
            before_stage(stage)
        grid = (num_rows // block_m, triton.cdiv(inter, block_n))
        _gate_up_kernel[grid](
            hidden,
            w_gate_up,
            h,
            sorted_pairs,
            block_expert,
            num_pairs,
            inter,
            hidden_size,
            top_k,
            hidden.stride(0),
            w_gate_up.stride(0),
            w_gate_up.stride(1),
            h.stride(0),
            BLOCK_SIZE_M=block_m,
            BLOCK_SIZE_N=block_n,
            BLOCK_SIZE_K=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        grid = (num_rows // block_m, triton.cdiv(hidden_size, block_n))
        _down_kernel[grid](
            h,
            w_down,
            pairs,
            weights,
            sorted_pairs,
            block_expert,
            num_pairs,
            hidden_size,
            inter,
            h.stride(0),
            w_down.stride(0),
            w_down.stride(1),
            pairs.stride(0),
            BLOCK_SIZE_M=block_m,
            BLOCK_SIZE_N=block_n,
            BLOCK_SIZE_K=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return sum_pairs(pairs, top_k, out)


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe` in plain torch, float32 throughout (the reference of the kernel tests)."""
    x = hidden.float()
    out = torch.zeros_like(x)
    for j in range(topk_ids.shape[1]):
        ids = topk_ids[:, j].clamp(min=0)
        gate, up = torch.bmm(w_gate_up[ids].float(), x[:, :, None]).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(w_down[ids].float(), (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        out += (topk_ids[:, j, None] >= 0) * topk_weights[:, j, None].float() * y
    return out
