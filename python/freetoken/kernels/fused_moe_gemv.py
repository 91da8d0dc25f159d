"""Grouped SwiGLU over quantized experts for decode batches, as matrix-vector products on the CUDA cores (Triton).

`fused_moe_quant`'s tensor-core kernels pad every expert's rows to a 16-row M tile: at decode, one or two real rows,
so 15/16 of each dot is padding, and every decoded weight still pays its way into the dot's operand layout. Here
each program owns BLOCK_SIZE_N output rows of one expert and, for each real row of the expert's tile in turn, runs
the dot over K as float32 fused multiply-adds straight from the decoded words: no padding rows, no layout change,
no shared memory, and programs small enough that a batch-1 call fills the SMs. Same arguments, same tiles (the
`align_pairs` alignment and the driver's stages), same results up to float32 sum order: `fused_moe_quant_tiles`
runs these where its tiles hold few rows (`GEMV_MAX_PAIRS`).

Decoding, per 64-bit word of the packed weights (little-endian, column c of the word in its c-th nibble or byte):
  - e2m1 (NVFP4, MXFP4; s ee m, bias 1): nibble j of a 32-bit half shifted to the top, then arithmetically down
    to bits 22-25, leaves sign copies above; one mask keeps bit 31 (the sign) and bits 22-24, a float32 whose
    exponent field is ee and top mantissa bit m: the value * 2^-126 (ee = 0, the codes 0 and 0.5, lands on float32
    subnormals, which FFMA keeps: the SASS has no .FTZ, `benches/quant_moe_sass.py` checks). Three integer
    operations per weight, no conversion instruction.
  - e4m3 (FP8; s eeee mmm, bias 7): the same moves to bits 20-26 and 31: the value * 2^-120, subnormals included.
  - Activations enter as they are (float32), so a product is the true one times 2^-126 (2^-120): a float32
    subnormal where |value * activation| < 1, rounded to a multiple of 2^-149, i.e. off by at most 2^-24 (2^-30)
    of the block scale; the group sums likewise. That is below the float32 accumulator's own rounding of the dot
    (2^-24 of the running sum, and a sum of 2048 products dwarfs one block scale), so the rows match the
    reference as closely as with scaled activations (measured: the CPU tests' float32 errors), for one float
    multiply per activation less. The block scale brings the sums up to 2^-64 of their value: NVFP4's e4m3 block
    scale decoded to float16 (`moe_tiles.e4m3_f16`, s * 2^-8) times 2^70, MXFP4's 2^(e - 127 + 62) built as
    float32 bits (exact for e8m0 codes <= 192, scales <= 2^65), FP8's float32 block scale times 2^56; each row's
    sum is then multiplied by 2^64 once (and by NVFP4's per-tensor weight_scale_2).
  - Scale blocks: a 4-bit word is one 16-column group (NVFP4's block; half an MXFP4 block), so each word's 16
    products are summed, times its group's scale, into a [rows, words] accumulator; FP8's K step is within one
    128-column block, whose scale multiplies the step's [rows, words] products.

Gate and up are one [2 BLOCK_SIZE_N, K] tile (rows interleaved: even rows gate n, odd rows up n; in the pool they
are one [2 N, K] matrix, scales too), so a K step loads the activations once for both and SwiGLU pairs them after
the row sums.

Measured on the H200 (`benches/quant_moe.py --profile --kernels gemv`, Qwen3-30B-A3B shapes, 128 slots, each
kernel at its own `GEMV_CONFIGS` entry), gate/up + down kernel microseconds per layer call at batch 1 (the same in
three runs within 0.1 us): FP8 12.1 + 5.8, NVFP4 10.1 + 5.7, MXFP4 10.0 + 5.7 against bf16's 20.3 + 9.8 (the
tensor-core kernels, an earlier run: FP8 16.7 + 8.2, NVFP4 25.3 + 10.8, MXFP4 16.5 + 8.5). Per weight byte that is
FP8 1.19x bf16's kernel time, NVFP4 1.87x, MXFP4 1.97x (tensor-core kernels 1.67x, 4.32x, 3.15x). At batch 4 FP8
39.3 + 21.5, NVFP4 42.0 + 23.1, MXFP4 42.0 + 21.7 against bf16's 47.0 + 25.9; at batch 8 (64 pairs, the cut-over)
within 5 % of the tensor-core kernels or faster (NVFP4 119 us against 167). Decode through the expert cache
(`benches/moe_backends.py --backends hybrid --budgets 24 --batch 1`, synthetic trace, two runs): FP8 101.0 and 118.0
tok/s against bf16's 48.0 and 48.1 (2.10x, 2.45x), NVFP4 120.6 and 125.0 (2.51x, 2.60x).
What is left to the issue's 1.3x per byte for the 4-bit formats: per weight they are no faster than FP8 (the same
25.2 M gate/up weights in 10.1 us against FP8's 12.1) although they read half the bytes: the work per weight (5.3-6.0
SASS instructions: 3 integer operations to decode, 1 FFMA, the rest activation loads and splits, `benches/
quant_moe_sass.py --kernels gemv`) and its latency bound them, not bytes (the instruction count alone needs ~6.6 us
for both kernels at full issue rate; they take 15.8). Fewer instructions alone did not help: one 64-bit word per
thread (8-byte loads) cut NVFP4 to 5.5 instructions per weight and 127 registers, and its best configs ran slower
(gate/up 11.5 us, down 6.1; `benches/gemv_grid.py`, one H200 run). The Marlin-style kernel that decodes packed
pairs straight into the tensor cores' operand registers (inline PTX, no FFMA per weight) is
`freetoken.kernels.fused_moe_fp4_mma`: `fused_moe_quant_tiles` runs 4-bit decode batches there where it can (CUDA,
bf16 activations, whole K steps), these kernels FP8 and the rest.

Shapes (project letters): M tokens, K hidden, N expert intermediate, S slots (or E experts), k top-k.
Test: python -m pytest tests/kernels/test_kernels_quant.py   Bench: python benches/quant_moe.py --kernels gemv mma
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.moe_tiles import FORMAT_IDS, e4m3_f16, swiglu_rounded
from freetoken.quant.formats import ExpertFormat, ExpertLayout

# e2m1 / e4m3 sign + field masks as int32 literals (0x81C00000 and 0x87F00000 past int32's top, Triton would widen)
_E2M1_MASK = tl.constexpr(0x81C00000 - (1 << 32))
_E4M3_MASK = tl.constexpr(0x87F00000 - (1 << 32))
_UNSCALE = tl.constexpr(2.0**64)  # the row sums' factor back (module doc)


@triton.jit
def _weight(low, high, J: tl.constexpr, FORMAT: tl.constexpr):
    """Column J of the 64-bit words whose halves are `low` and `high` (int32), as float32: an e4m3 byte (FP8)
    holding the value * 2^-120, or an e2m1 nibble holding the value * 2^-126 (module doc)."""
    BITS: tl.constexpr = 8 if FORMAT == 0 else 4
    PER_HALF: tl.constexpr = 32 // BITS
    UP: tl.constexpr = 32 - BITS * (J % PER_HALF + 1)  # the code's sign to bit 31
    DOWN: tl.constexpr = 4 if FORMAT == 0 else 6  # its exponent and mantissa to float32's low exponent bits
    MASK: tl.constexpr = _E4M3_MASK if FORMAT == 0 else _E2M1_MASK
    if J < PER_HALF:
        half = low
    else:
        half = high
    if UP == 0:
        bits = (half >> DOWN) & MASK
    else:
        bits = ((half << UP) >> DOWN) & MASK
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _step_loads(
    words_ptrs,
    s_ptr,
    wrow,
    row_ok,
    offs_g,
    k0,
    num_in,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    UNIT: tl.constexpr,
):
    """The K step at column k0 of `_row_dots`: its 64-bit words [R, G] (`words_ptrs` points at them) and its raw
    block scales (4-bit: the scale codes [R, G] int32, a group's block each; FP8: the float32 block scale of each
    row [R]); zeros for a step at or past num_in (nothing read)."""
    g_ok = k0 // UNIT + offs_g < num_in // UNIT  # (num_in a multiple of UNIT: false past the end too)
    words = tl.load(words_ptrs, mask=row_ok[:, None] & g_ok[None, :], other=0)
    if FORMAT == 0:
        # one 128 x 128 block per K step and row (BLOCK_SIZE_K divides the block's columns)
        scale_idx = (wrow // BLOCK_ROWS) * tl.cdiv(num_in, BLOCK_COLS) + k0 // BLOCK_COLS
        raw = tl.load(
            s_ptr.to(tl.pointer_type(tl.float32)) + scale_idx, mask=row_ok & (k0 + 0 * wrow < num_in), other=0.0
        )
    else:
        # indexed from k0, not a pointer advanced per step: Triton then sees no contiguity along the groups and
        # loads the bytes in the words' layout (a contiguous byte load takes its own, and a shared-memory conversion
        # per step)
        block = (k0 // UNIT + offs_g) * 16 // BLOCK_COLS
        raw = tl.load(
            s_ptr + wrow[:, None] * (num_in // BLOCK_COLS) + block[None, :],
            mask=row_ok[:, None] & g_ok[None, :],
            other=0,
        ).to(tl.int32)
    return words, raw


@triton.jit
def _row_dots(
    w_ptr,
    s_ptr,
    wrow,
    row_ok,
    x_row,
    num_in,
    row_words,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN_K: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """sum_k W[wrow, k] * x[k] for each of `wrow` ([R] rows of a matrix W [rows, num_in] at `w_ptr`, uint8 pointer
    to its codes, 8-byte aligned rows of `row_words` 64-bit words; block scales at `s_ptr`), float32 [R], without
    NVFP4's tensor scale. `x_row` points at the activations (any float dtype; WORD_ACTIVATIONS: bf16 read as 32-bit
    words of two columns, 4-byte aligned). EVEN_K: num_in is a multiple of BLOCK_SIZE_K (no K masks on them).

    Software-pipelined by hand: each step issues the next step's weight and scale loads before its own arithmetic,
    so one step's HBM latency hides behind the previous step's work (Triton pipelines only loads that feed a dot;
    at decode a program has a few warps, too few to hide it by switching)."""
    UNIT: tl.constexpr = 8 if FORMAT == 0 else 16  # weights per 64-bit word
    G: tl.constexpr = BLOCK_SIZE_K // UNIT
    offs_g = tl.arange(0, G)
    # pointers advanced by whole K steps, so Triton sees the words' 16-byte alignment and loads two per instruction
    words_ptrs = w_ptr.to(tl.pointer_type(tl.int64)) + wrow[:, None].to(tl.int64) * row_words + offs_g[None, :]
    if WORD_ACTIVATIONS:
        x_ptrs = x_row.to(tl.pointer_type(tl.int32)) + offs_g * (UNIT // 2)
    else:
        x_ptrs = x_row + offs_g * UNIT
    words, raw = _step_loads(words_ptrs, s_ptr, wrow, row_ok, offs_g, 0, num_in, FORMAT, BLOCK_ROWS, BLOCK_COLS, UNIT)
    if PREFETCH == 2:
        words_ptrs += G
        words_1, raw_1 = _step_loads(
            words_ptrs, s_ptr, wrow, row_ok, offs_g, BLOCK_SIZE_K, num_in, FORMAT, BLOCK_ROWS, BLOCK_COLS, UNIT
        )
    acc = tl.zeros((wrow.shape[0], G), dtype=tl.float32)
    for k0 in range(0, num_in, BLOCK_SIZE_K):
        words_ptrs += G
        next_words, next_raw = _step_loads(
            words_ptrs, s_ptr, wrow, row_ok, offs_g, k0 + PREFETCH * BLOCK_SIZE_K, num_in, FORMAT, BLOCK_ROWS,
            BLOCK_COLS, UNIT,
        )  # fmt: skip
        if EVEN_K:
            g_ok = offs_g < G
        else:
            g_ok = k0 // UNIT + offs_g < num_in // UNIT
        low = words.to(tl.int32)
        high = (words >> 32).to(tl.int32)
        part = tl.zeros((wrow.shape[0], G), dtype=tl.float32)
        for m in tl.static_range(UNIT // 2):  # columns 2m, 2m + 1 of each word
            if WORD_ACTIVATIONS:
                # bf16 pairs: the low half is column 2m (little-endian); a bf16 is a float32's top 16 bits
                pair = tl.load(x_ptrs + m, mask=g_ok, other=0)
                a_even = (pair << 16).to(tl.float32, bitcast=True)
                a_odd = (pair & -65536).to(tl.float32, bitcast=True)
            else:
                a_even = tl.load(x_ptrs + 2 * m, mask=g_ok, other=0.0).to(tl.float32)
                a_odd = tl.load(x_ptrs + 2 * m + 1, mask=g_ok, other=0.0).to(tl.float32)
            part += _weight(low, high, 2 * m, FORMAT) * a_even[None, :]
            part += _weight(low, high, 2 * m + 1, FORMAT) * a_odd[None, :]
        if FORMAT == 0:
            acc += part * (raw * 72057594037927936.0)[:, None]  # 2^56 (module doc)
        elif FORMAT == 1:
            acc += part * (e4m3_f16(raw).to(tl.float32) * 1.1805916207174113e21)  # s * 2^-8 * 2^70
        else:
            acc += part * ((raw + 62) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 + 62)
        if PREFETCH == 2:
            words, raw, words_1, raw_1 = words_1, raw_1, next_words, next_raw
        else:
            words, raw = next_words, next_raw
        if WORD_ACTIVATIONS:
            x_ptrs += BLOCK_SIZE_K // 2
        else:
            x_ptrs += BLOCK_SIZE_K
    return tl.sum(acc, axis=1) * _UNSCALE


@triton.jit
def _tile_pairs(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M: tl.constexpr):
    """The pair ids of M tile `pid_m` ([BLOCK_SIZE_M] int64, one load) and how many of them are real: `align_pairs`
    puts an expert's pairs first in its tiles, the padding (id num_pairs) after them, so the real rows are the first
    ones. (A scalar load per row inside the row loop waited on memory once per row, padding rows included.)"""
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M))
    return pairs, tl.sum((pairs < num_pairs).to(tl.int32))


@triton.jit
def _pick(values, i):
    """values[i] of a small 1-D tensor, as a scalar (a masked sum: Triton has no dynamic indexing of tensors)."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == i, values, 0))


@triton.jit
def _gate_up_gemv_kernel(
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
    row_words,
    gate_up_scale_off,
    tensor_scale_off,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_TENSOR_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """h[row, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n]) for each real row of M tile `pid_m`, n in the
    program's BLOCK_SIZE_N: gate_up [2 N, K] at byte 0 of the expert, its scales at `gate_up_scale_off`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * stride_we
        # rows 2i: gate n0 + i, rows 2i + 1: up n0 + i, of the [2 N, K] gate_up matrix
        r = tl.arange(0, 2 * BLOCK_SIZE_N)
        n = pid_n * BLOCK_SIZE_N + r // 2
        wrow = n + (r % 2) * N
        row_ok = n < N
        if HAS_TENSOR_SCALE:  # NVFP4's weight_scale_2: gate's, then up's
            ts = tl.load((base + tensor_scale_off).to(tl.pointer_type(tl.float32)) + r % 2)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        tile_pairs, real_rows = _tile_pairs(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
        for i in range(real_rows):
            row = pid_m * BLOCK_SIZE_M + i
            pair = _pick(tile_pairs, i)
            x_row = x_ptr + (pair // top_k) * stride_xm
            dots = _row_dots(
                base, base + gate_up_scale_off, wrow, row_ok, x_row, K, row_words,
                FORMAT, BLOCK_ROWS, BLOCK_COLS, EVEN_K, WORD_ACTIVATIONS, BLOCK_SIZE_K, PREFETCH,
            )  # fmt: skip
            if HAS_TENSOR_SCALE:
                dots = dots * ts
            gate, up = tl.split(tl.reshape(dots, (BLOCK_SIZE_N, 2)))
            h = swiglu_rounded(gate, up, h_ptr)
            tl.store(h_ptr + row * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _down_gemv_kernel(
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
    row_words,
    down_off,
    down_scale_off,
    tensor_scale_off,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_TENSOR_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """out[pair, kk] = weight[pair] * (h[row] . down[e, kk]) for each real row of M tile `pid_m`, kk in the
    program's BLOCK_SIZE_N of hidden K: down [K, N] at `down_off`, its scales at `down_scale_off`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * stride_we
        offs_out = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        out_ok = offs_out < K
        if HAS_TENSOR_SCALE:
            ts = tl.load((base + tensor_scale_off).to(tl.pointer_type(tl.float32)) + 2)
        tile_pairs, real_rows = _tile_pairs(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
        for i in range(real_rows):
            row = pid_m * BLOCK_SIZE_M + i
            pair = _pick(tile_pairs, i)
            dots = _row_dots(
                base + down_off, base + down_scale_off, offs_out, out_ok, h_ptr + row * stride_hm, N, row_words,
                FORMAT, BLOCK_ROWS, BLOCK_COLS, EVEN_K, WORD_ACTIVATIONS, BLOCK_SIZE_K, PREFETCH,
            )  # fmt: skip
            if HAS_TENSOR_SCALE:
                dots = dots * ts
            routing = tl.load(weight_ptr + pair).to(tl.float32)
            out = dots.to(out_ptr.dtype.element_ty).to(tl.float32) * routing  # rounded like the reference
            tl.store(out_ptr + pair * stride_om + offs_out, out.to(out_ptr.dtype.element_ty), mask=out_ok)


# A kernel's launch config: (BLOCK_SIZE_N output rows per program (gate and up each), BLOCK_SIZE_K columns per K
# step (FP8's capped at its scale block's, `gemv_k_step`), num_warps, K steps loaded ahead (`_row_dots`' PREFETCH)).
GemvConfig = tuple[int, int, int, int]

# (gate/up, down) configs by weight bits, each kernel's own: the two read matrices of other shapes (gate/up [2 I, H]
# rows of H columns, down [H, I]: a third as many columns, 2.7x the rows). One-warp programs lead where they fit: a
# thread then holds 4-8 rows of the same words, so an activation load and split serves that many weights (SASS
# 5.3-6.0 instructions per weight against 6.2-6.9 at two warps, `benches/quant_moe_sass.py`; FP8's gate/up, 128
# columns a step, is the exception at four warps and 7.2). Chosen by
# `benches/gemv_grid.py` on the H200 (each kernel's microseconds over 54 configs, Qwen3-30B-A3B shapes, batch 1 and
# 4): at batch 1 NVFP4 gate/up 10.1 us at (4, 512, 1, 1) against 11.6 at the previous shared (8, 256, 2, 1), down
# 5.9 at (16, 256, 1, 1) against 7.2; MXFP4 10.0 / 10.5 and 5.9 / 7.2; FP8 gate/up 12.2 at (8, 128, 4, 1) against
# 12.7, down 5.7 at (16, 128, 1, 2) against 7.5 (FP8's down runs six 128-column steps: two loaded ahead hid more
# of each step's wait, 5.7 against 6.9 at one). The same configs led or were within 5 % of the best at batch 4.
GEMV_CONFIGS: dict[int, tuple[GemvConfig, GemvConfig]] = {
    4: ((4, 512, 1, 1), (16, 256, 1, 1)),
    8: ((8, 128, 4, 1), (16, 128, 1, 2)),
}

# Tiles whose pairs number at most this run here (fused_moe_quant_tiles): every tile then holds a few rows, each
# re-reading the expert's words (from L2) that the tensor-core kernels read once per tile.
GEMV_MAX_PAIRS = 64


def _weights_per_word(fmt: ExpertFormat) -> int:
    """Weights in one 64-bit word of `fmt`'s codes (the kernels' UNIT): 8 e4m3 bytes or 16 e2m1 nibbles."""
    return 8 if fmt.weight_bits == 8 else 16


def gemv_k_step(fmt: ExpertFormat, block_k: int, num_in: int) -> int:
    """The K step (BLOCK_SIZE_K) of a gemv kernel whose dot runs over `num_in` columns, from the config's `block_k`:
    no wider than the matrix needs, within one scale block's columns for FP8, at least one 64-bit word."""
    step = min(block_k, 1 << max(num_in - 1, 1).bit_length())
    if fmt.weight_bits == 8:
        step = min(step, fmt.block_cols)
    return max(step, _weights_per_word(fmt))


def gemv_supported(layout: ExpertLayout, experts: torch.Tensor) -> bool:
    """Whether these kernels can read `layout`'s experts in `experts` ([S, stride] uint8): 64-bit words need 8-byte
    aligned rows and sections, FP8 blocks of power-of-two columns >= 8."""
    fmt = layout.format
    sec = layout.sections
    aligned = experts.stride(0) % 8 == 0 and experts.data_ptr() % 8 == 0 and sec["down"][0] % 8 == 0
    if fmt.weight_bits == 4:
        return aligned and layout.hidden % 16 == 0 and layout.inter % 16 == 0
    cols = fmt.block_cols
    return aligned and cols >= 8 and cols & (cols - 1) == 0 and layout.hidden % cols == 0 and layout.inter % cols == 0


def _launch_meta(fmt: ExpertFormat, config: GemvConfig, block_m: int, num_in: int) -> dict:
    """The compile-time arguments of a gemv kernel whose dots run over `num_in` columns, under `config`."""
    block_n, block_k, num_warps, prefetch = config
    step = gemv_k_step(fmt, block_k, num_in)
    return {
        "FORMAT": FORMAT_IDS[fmt.name],
        "BLOCK_ROWS": fmt.block_rows,
        "BLOCK_COLS": fmt.block_cols,
        "HAS_TENSOR_SCALE": fmt.tensor_scale,
        "EVEN_K": num_in % step == 0,
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": block_n,
        "BLOCK_SIZE_K": step,
        "PREFETCH": prefetch,
        "num_warps": num_warps,
    }


def gemv_tiles(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
    h: torch.Tensor,
    pairs: torch.Tensor,
    configs: tuple[GemvConfig, GemvConfig] | None = None,
) -> None:
    """One stage of `fused_moe_quant_tiles` through these kernels: h[rows] then pairs[pair] of every real row of the
    tiles whose `block_expert` is >= 0.

    Args:
        hidden: [M, K] activations, CUDA (or CPU under TRITON_INTERPRET=1).
        experts, layout: as `fused_moe_quant`; `gemv_supported(layout, experts)` must hold.
        weights: [M * k] routing weights, flat.
        sorted_pairs, block_expert: the stage's `align_pairs` rows ([R] int64) and tile slots ([R / block_m]).
        block_m: rows per tile.
        h: [R, N] buffer of the SwiGLU outputs (hidden's dtype); pairs: [M * k, K] buffer of the weighted outputs.
        configs: the (gate/up, down) kernels' `GemvConfig`s; None: `GEMV_CONFIGS` of the format's weight bits.
    """
    fmt = layout.format
    hidden_size, inter = layout.hidden, layout.inter
    gate_up_config, down_config = configs or GEMV_CONFIGS[fmt.weight_bits]
    unit = _weights_per_word(fmt)
    sec = layout.sections
    num_pairs = weights.numel()
    tiles = block_expert.numel()
    words = hidden.dtype == torch.bfloat16 and hidden.stride(0) % 2 == 0 and hidden.data_ptr() % 4 == 0
    _gate_up_gemv_kernel[(tiles, triton.cdiv(inter, gate_up_config[0]))](
        hidden,
        experts,
        h,
        sorted_pairs,
        block_expert,
        num_pairs,
        inter,
        hidden_size,
        num_pairs // hidden.shape[0],
        hidden.stride(0),
        experts.stride(0),
        h.stride(0),
        hidden_size // unit,
        sec["gate_up_scale"][0],
        sec["tensor_scale"][0],
        WORD_ACTIVATIONS=words,
        **_launch_meta(fmt, gate_up_config, block_m, hidden_size),
    )
    _down_gemv_kernel[(tiles, triton.cdiv(hidden_size, down_config[0]))](
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
        inter // unit,
        sec["down"][0],
        sec["down_scale"][0],
        sec["tensor_scale"][0],
        WORD_ACTIVATIONS=h.dtype == torch.bfloat16,  # h: a fresh [rows, inter] buffer, inter even
        **_launch_meta(fmt, down_config, block_m, inter),
    )
