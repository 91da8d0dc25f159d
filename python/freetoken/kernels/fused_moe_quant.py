"""Grouped SwiGLU over quantized experts (FP8 block, NVFP4, MXFP4) in Triton: weights decoded exactly to bf16
tiles in the inner loop, bf16 tensor-core dots with float32 accumulation.

Variants:
  - `fused_moe_quant`: `freetoken.kernels.fused_moe`'s two grouped kernels (gate/up + SiLU*up, then down + routing
    weight, over (token, expert) pairs sorted by expert and padded to BLOCK_SIZE_M, `align_pairs`), reading each
    expert's bytes from a uint8 table of experts or cache slots in the pool layout (`freetoken.quant.formats`).
    Tile shapes by format and M tile (`LAUNCH_CONFIGS`): decode (16-row M tiles, batch 1-64) and prefill chunks
    (64-row tiles).
  - `fused_moe_quant_tiles`: the same over tiles split in stages (the decode driver's hits, then its fills). Left to
    choose (`default_kernel`), it runs decode batches (<= `fused_moe_gemv.GEMV_MAX_PAIRS` pairs) of NVFP4 / MXFP4
    on CUDA through `freetoken.kernels.fused_moe_fp4_mma` (decode in registers into `mma.sync` operands), other
    decode batches on slots 8-byte aligned as the pool's and the cache's are through
    `freetoken.kernels.fused_moe_gemv`'s CUDA-core kernels: same tiles, same results up to float32 sum order,
    about half this module's time at batch 1 (see those modules).
  - `fused_moe_quant_reference`: the whole layer dequantized by `freetoken.quant.reference`, then
    `freetoken.kernels.fused_moe.fused_moe_reference` (float32), the correctness reference.

Numerics (exact products, as the CPU kernels in rust/freetoken-core/src/quant/kernels/avx512_bf16.rs):
  - FP8 block (DeepSeek-V3 arXiv:2412.19437 section 3.3.2; e4m3 per OCP OFP8 rev. 1.0): a tile is one 128 x 128
    scale block (BLOCK_SIZE_K = block columns, BLOCK_SIZE_N divides block rows), so acc += dot(a, codes) * scale.
    e4m3 codes shifted into a float16 are exact (value * 2^-8, subnormals included), hence exact in bf16.
  - NVFP4 (NVIDIA NVFP4, ModelOpt NVFP4QTensor): e2m1 x its e4m3 block scale has <= 6 significant bits, exact in
    bf16; the per-tensor weight_scale_2 multiplies the float32 accumulator once at the end.
  - MXFP4 (OCP MX v1.0 section 6.3): e2m1 x 2^(e8m0 - 127), exact in bf16 between 2^-120 and 2^113 (`_weight_step`).
  - e2m1 and e4m3 (FP8 weights, NVFP4 block scales) are decoded by moving bit fields into float16 (`_e2m1_pair_f16`,
    `e4m3_f16`): no exp2, no select per element. Packed bytes are loaded once: even columns meet the low nibbles,
    odd ones the high nibbles in two dots (sum_k a[k] w[k] = a_even . w_low + a_odd . w_high), so nibbles are never
    interleaved; 16-bit activations come as 32-bit words of (even, odd) columns, split by bit moves.
  - Activations: bf16 enters the dots as it is (the GPU path). float32 (CPU tests) or float16 is split into two bf16
    parts, hi + lo, and dotted twice: float32 results to ~2^-16 relative (tests: 1e-5 of the largest output).
  The kernels then equal the reference's dequantized weights bit for bit; only float32 sum order differs.

Measured on an H200 (`benches/quant_moe.py --profile`, before the word loads below), gate/up + down kernel
microseconds per layer call, Qwen3-30B-A3B (H 2048, I 768, top-8): batch 1: bf16 20.3 + 9.8, FP8 16.8 + 8.3, NVFP4
39.4 + 14.1, MXFP4 24.3 + 9.9; batch 4: bf16 46.6 + 26.4, FP8 44.8 + 26.2, NVFP4 128.8 + 44.7, MXFP4 76.7 + 32.2;
batch 16: NVFP4 342 + 125, MXFP4 205 + 88, bf16 135 + 68. (Batch 4 routes to ~3.5x the experts of batch 1, so
most of the growth with batch is weight bytes, not per-row work.)

SASS of the sm_90 builds (compiled without a GPU: triton.compile for GPUTarget("cuda", 90, 32), nvdisasm;
`benches/quant_moe_sass.py`), the K loop at 16-row tiles. Before: the 4-bit block scales were loaded by byte
(1 byte per thread) and the activations by 16-bit element at stride 2; Triton's pipeliner stages only loads of >= 4
bytes per thread by cp.async, so both stayed plain loads inside every K step (NVFP4 gate/up: 40 LDG per loop, 4 of
them scale bytes from DRAM whose wait, a shared-memory layout conversion and a barrier sat before the weights'
multiply; 34 STS + 5 BAR), and NVFP4's gate/up took 255 registers with a 16-byte stack; per weight NVFP4 12.2 and
14.8 instructions (gate/up, down), MXFP4 11.1 and 13.6. Now (`WORD_LOADS`): scales read as the 32-bit words that
hold them and 16-bit activations as 32-bit words of (even, odd) columns, all staged by cp.async with the weights
(no LDG, no STS, 2 BAR in the loop), e4m3 scales decoded by bit moves (no I2F/FSEL), e2m1 by sign-extension shifts
(five integer operations per byte instead of eight); at the 32 x 128 tiles now used for decode NVFP4 10.0 and 12.2
per weight with 128 and 104 registers (4 programs per SM instead of 2), MXFP4 9.5 and 11.7, FP8 (unchanged) 9.2 and
10.3. Measured on the H200 with the word loads (`benches/quant_moe.py --profile`, main at adcb2a2), gate/up + down
microseconds: batch 1: bf16 19.9 + 9.7, FP8 16.7 + 8.2, NVFP4 38.7 + 14.7, MXFP4 19.2 + 9.3; batch 4: bf16 45.5 +
25.1, FP8 44.2 + 25.4, NVFP4 128.1 + 51.1, MXFP4 48.1 + 29.0; batch 16: NVFP4 340 + 140, MXFP4 122 + 79. Against the
figures above (another run, the byte loads), the word loads sped MXFP4 up by 1.3-1.7x and left NVFP4 where it was:
NVFP4's extra cost is in its 16-column scale blocks (8 per K step, each decoded from e4m3 and broadcast over 8 byte
rows), not in the loads. Per weight byte at batch 1 that is FP8 1.7x bf16's kernel time, MXFP4 3.6x, NVFP4 6.4x
(the issue's target is 1.3x).
  - bytes: NVFP4 18.9 MB codes + 2.4 MB scales = 21.2 MB -> 4.4 us; MXFP4 20.0 MB -> 4.2 us; FP8 37.7 MB -> 7.9 us;
    bf16 75.5 MB -> 15.7 us (the baseline's floor).
  - issue (132 SMs x 4 schedulers x ~1.98 GHz = 1.05e12 warp-instr/s): 37.7 M weights x instr/weight / 32 lanes /
    1.05e12 ~ 11-12 us for NVFP4 and MXFP4 at batch 1, ~10.8 us for FP8: at decode the kernels are bound by
    instruction issue and latency, not bandwidth (the M tile's 16 rows cost the same decode as one). Programs:
    gate/up 8 tiles x 768 / 32 = 192, down 8 x 2048 / 32 = 512.
  Per weight what is left is the decode itself: byte extraction and shifts (PRMT, SHL, SHF, LOP3; ~3.5), the
  float16 -> float32 conversion (HADD2.F32), the scale's FMUL and half an F2FP pack.
Why NVFP4 measured ~2x MXFP4 with loops of nearly the same SASS: the bench packed its slots expert_nbytes apart, and
NVFP4's 2654220 bytes (the 12-byte tensor scale at the end) are not 16-divisible, so Triton's launch did not
specialize the expert stride as 16-divisible and the weights' loads lost their alignment: byte loads (LDG.E.U8) each
K step, not cp.async, 64 STS.U16 + 8 BAR in the loop, 214 registers, 16.8 instructions per weight (gate/up, 16-row
tiles; `benches/quant_moe_sass.py --unaligned-stride`). MXFP4's 2506752 bytes are 16-divisible. The pool and the slot
cache space experts 256 bytes apart (EXPERT_ALIGN), as the bench now does (`--packed-slots` for the old spacing), so
served NVFP4 runs the aligned build; not the 16-column scale blocks: the scales' broadcast to byte rows compiles to
no shared-memory traffic at 16-row tiles (each thread's byte rows share its scales).
Scale modes (`SCALE_MODES`): "f32" as above; "bf16" decodes e2m1 straight to bf16 (`_e2m1_pair_bf16`) and
multiplies by a bf16 scale, one packed HMUL2.BF16 per two weights instead of a HADD2.F32, an FMUL and half an F2FP
per weight, the power of two left out put back on the accumulator (`_unscale`). sm_90 SASS, instructions per weight
(gate/up, down; registers): 16-row tiles NVFP4 f32 10.0, 12.2 (128, 104) -> bf16 8.1, 10.2 (128, 104), MXFP4 9.5,
11.7 (104, 78) -> 7.4, 9.7 (104, 78); 64-row tiles NVFP4 8.5, 10.2 (249, 167) -> 6.5, 8.2 (223, 154), MXFP4 8.3, 9.9
(255, 168) -> 6.3, 7.9 (226, 159); shared-memory operations in the loop unchanged (16-row: LDS 21/16, no STS, 2 BAR).
"bf16" is the default; `benches/quant_moe.py --sweep` times both. Going below needs packed conversions (several
weights per 32-bit instruction, Marlin-style: PTX cvt.rn.f16x2.e4m3x2 for FP8, a PRMT lookup of 8 nibbles per word
for e2m1 through tl.inline_asm_elementwise, which the interpreter cannot run, or tl.dot_scaled for MXFP4).

Shapes (project letters): M tokens, K hidden, N expert intermediate, S slots (or E experts), k top-k.
Test: python -m pytest tests/kernels/test_kernels_quant.py   (TRITON_INTERPRET=1 without a GPU, as conftest sets;
      the Qwen3-30B shapes: -m gpu on a CUDA machine)
Bench: python benches/quant_moe.py [--profile] [--sweep]   (GPU: us per call by format and batch against bf16)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from freetoken.kernels import fused_moe_fp4_mma as fp4_mma
from freetoken.kernels.fused_moe import align_pairs, block_m_for, fused_moe_reference
from freetoken.kernels.fused_moe_gemv import GEMV_MAX_PAIRS, GemvConfig, gemv_supported, gemv_tiles
from freetoken.kernels.moe_tiles import FORMAT_IDS, e4m3_f16, sum_pairs, swiglu_rounded, tile_rows
from freetoken.quant.formats import ExpertFormat, ExpertLayout
from freetoken.quant.reference import dequantize_experts


@triton.jit
def _e2m1_pair_f16(byte):
    """Packed e2m1 bytes (int32, sign-extended from int8) -> (low nibble, high nibble) as float16 holding the value
    * 2^-14.

    e2m1 (s ee m, bias 1) placed at float16's sign, low exponent bits and top mantissa bit is the value scaled by
    2^(1 - 15): e = 0 (0 and 0.5) lands on float16 subnormals m/2 * 2^-14, which every float16 path keeps (no
    flush to zero for 16-bit floats, and the float16 -> float32 conversion is exact). No select and no exp2; the
    caller folds 2^14 into the block scale. Bits are moved with the sign's copies: the low nibble shifted to the
    top of the word then arithmetically back to bits 9-12 leaves copies of its sign bit 3 above, bit 15 among them;
    the sign-extended byte shifted by 5 puts bits 4-6 at 9-11 and copies of bit 7 from bit 13 up. One mask keeps
    bits 9-11 and 15: five integer operations per byte (the previous masks-and-ors took eight)."""
    low = ((byte << 28) >> 19) & 0x8E00
    high = (byte << 5) & 0x8E00
    return low.to(tl.int16).to(tl.float16, bitcast=True), high.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_pair_bf16(byte):
    """Packed e2m1 bytes (int32, sign-extended from int8) -> (low nibble, high nibble) as bfloat16 holding the value
    * 2^-126 (`SCALE_MODES` "bf16").

    `_e2m1_pair_f16`'s bit moves aimed at bfloat16's fields (sign bit 15, exponent from bit 7, top mantissa bit 6):
    e2m1's exponent (bias 1) in bf16's low exponent bits scales the value by 2^(1 - 127), e = 0 (0 and 0.5) landing
    on bf16 subnormals m/2 * 2^-126. The same five integer operations per byte."""
    low = ((byte << 28) >> 22) & 0x81C0
    high = (byte << 2) & 0x81C0
    return low.to(tl.int16).to(tl.bfloat16, bitcast=True), high.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_split(a, SPLIT_ACTIVATIONS: tl.constexpr):
    """Activations -> (hi, lo) bfloat16 operands for tensor-core dots. bf16 activations pass as they are (lo is
    unused). Other dtypes (float32 under the CPU tests, float16) split into hi = bf16(a) and lo = bf16(a - hi):
    hi + lo carries 16 significant bits, so two bf16 dots give float32-activation results to ~2^-16 relative."""
    hi = a.to(tl.bfloat16)
    if SPLIT_ACTIVATIONS:
        lo = (a.to(tl.float32) - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _dot_split(a_hi, a_lo, w, acc, SPLIT_ACTIVATIONS: tl.constexpr):
    """acc + a . w, bf16 operands, float32 accumulation (tensor cores); `_bf16_split`'s lo part when split."""
    acc = tl.dot(a_hi, w, acc)
    if SPLIT_ACTIVATIONS:
        acc = tl.dot(a_lo, w, acc)
    return acc


@triton.jit
def _activations(
    x_rows,
    row_ok,
    k0,
    num_in,
    FORMAT: tl.constexpr,
    SPLIT_ACTIVATIONS: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """The activation operands of one K step, columns k0 .. k0 + BLOCK_SIZE_K of rows `x_rows` ([M, 1] pointers).

    FP8: (hi, lo, hi, lo) of a [M, BLOCK_SIZE_K]. 4-bit formats: (even hi, even lo, odd hi, odd lo), each
    [M, BLOCK_SIZE_K / 2]: the packed weights hold column 2j in a byte's low nibble and 2j + 1 in its high one, and
    sum_k a[k] w[k] = even columns . low nibbles + odd columns . high nibbles, so the bytes are loaded once and
    never interleaved."""
    # one return for both formats: compiled Triton requires every return of a function to have one type
    if FORMAT == 0:
        offs = k0 + tl.arange(0, BLOCK_SIZE_K)
        a = tl.load(x_rows + offs[None, :], mask=row_ok[:, None] & (offs[None, :] < num_in), other=0.0)
        first_hi, first_lo = _bf16_split(a, SPLIT_ACTIVATIONS)
        second_hi, second_lo = first_hi, first_lo
    elif WORD_ACTIVATIONS:
        # 16-bit activations read as 32-bit words, one per (even, odd) column pair: a contiguous load that the
        # pipeliner stages by cp.async (a stride-2 load of 16-bit elements is neither vectorized nor staged), split
        # by bit moves (low half: the even column, little-endian)
        offs_w = k0 // 2 + tl.arange(0, BLOCK_SIZE_K // 2)
        words = tl.load(
            x_rows.to(tl.pointer_type(tl.int32)) + offs_w[None, :],
            mask=row_ok[:, None] & (offs_w[None, :] < num_in // 2),
            other=0,
        )
        dtype = x_rows.dtype.element_ty
        first_hi, first_lo = _bf16_split(words.to(tl.int16).to(dtype, bitcast=True), SPLIT_ACTIVATIONS)
        second_hi, second_lo = _bf16_split((words >> 16).to(tl.int16).to(dtype, bitcast=True), SPLIT_ACTIVATIONS)
    else:
        offs = k0 + 2 * tl.arange(0, BLOCK_SIZE_K // 2)
        ok = row_ok[:, None] & (offs[None, :] < num_in)
        first_hi, first_lo = _bf16_split(tl.load(x_rows + offs[None, :], mask=ok, other=0.0), SPLIT_ACTIVATIONS)
        second_hi, second_lo = _bf16_split(tl.load(x_rows + offs[None, :] + 1, mask=ok, other=0.0), SPLIT_ACTIVATIONS)
    return first_hi, first_lo, second_hi, second_lo


@triton.jit
def _weight_step(
    acc,
    a1_hi,
    a1_lo,
    a2_hi,
    a2_lo,
    weights,
    scales,
    out0,
    offs_out,
    out_ok,
    k0,
    num_in,
    FORMAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SPLIT_ACTIVATIONS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """acc [M, BLOCK_SIZE_N] + activations . W[offs_out, k0 : k0 + BLOCK_SIZE_K]^T for one matrix W [rows (out),
    num_in] stored at `weights` (uint8 pointer, row-major codes) with its block scales at `scales`.

    Weights become bf16 tiles exactly (see the module doc) and meet the activations in bf16 dots with float32
    accumulation. FP8: the tile is one scale block (BLOCK_SIZE_K = BLOCK_COLS, BLOCK_SIZE_N divides BLOCK_ROWS), so
    the dot runs on the codes and its result is scaled once. NVFP4/MXFP4: codes times their block scale, exact in
    bf16, per element (the scale varies along K within the tile); NVFP4's per-tensor scale is left to the caller."""
    # if/else, one return: compiled Triton generates what follows a return inside a constexpr branch
    if FORMAT == 0:
        offs_k = k0 + tl.arange(0, BLOCK_SIZE_K)
        codes = tl.load(
            weights + offs_out[None, :] * num_in + offs_k[:, None],
            mask=(offs_k[:, None] < num_in) & out_ok[None, :],
            other=0,
        )
        # [BLOCK_SIZE_K, BLOCK_SIZE_N] weights * 2^-8, exact; through float32 because sm_90 has no packed
        # float16 -> bf16 convert (a direct cast compiles to one quarter-rate F2F per element; this to a
        # full-rate HADD2.F32 and half an F2FP pack)
        w = e4m3_f16(codes.to(tl.int32)).to(tl.float32).to(tl.bfloat16)
        part = _dot_split(a1_hi, a1_lo, w, tl.zeros_like(acc), SPLIT_ACTIVATIONS)
        scale_idx = (out0 // BLOCK_ROWS) * tl.cdiv(num_in, BLOCK_COLS) + k0 // BLOCK_COLS
        scale = tl.load(scales.to(tl.pointer_type(tl.float32)) + scale_idx)
        acc = acc + part * (scale * 256.0)
    else:
        offs_j = k0 // 2 + tl.arange(0, BLOCK_SIZE_K // 2)  # byte columns
        byte = (
            tl.load(
                weights + offs_out[None, :] * (num_in // 2) + offs_j[:, None],
                mask=(offs_j[:, None] < num_in // 2) & out_ok[None, :],
                other=0,
            )
            .to(tl.int8, bitcast=True)
            .to(tl.int32)
        )  # [BLOCK_SIZE_K / 2, BLOCK_SIZE_N], sign-extended
        num_blocks: tl.constexpr = BLOCK_SIZE_K // BLOCK_COLS
        if SCALE_WORDS:
            # the 32-bit word holding each block's scale byte (4 blocks share a word, so their loads repeat its
            # address): loads of 4 bytes, which the pipeliner stages by cp.async with the weights (a byte load waits
            # for memory inside every K step); bytes picked by shifts, little-endian
            words_per_row = num_in // (4 * BLOCK_COLS)
            offs_b = k0 // BLOCK_COLS + tl.arange(0, num_blocks)
            word = tl.load(
                scales.to(tl.pointer_type(tl.int32)) + offs_out[None, :] * words_per_row + offs_b[:, None] // 4,
                mask=(offs_b[:, None] // 4 < words_per_row) & out_ok[None, :],
                other=0,
            )  # [blocks, BLOCK_SIZE_N]
            code = (word >> (8 * (offs_b[:, None] % 4))) & 0xFF
        else:
            offs_b = k0 // BLOCK_COLS + tl.arange(0, num_blocks)
            code = tl.load(
                scales + offs_out[None, :] * (num_in // BLOCK_COLS) + offs_b[:, None],
                mask=(offs_b[:, None] < num_in // BLOCK_COLS) & out_ok[None, :],
                other=0,
            ).to(tl.int32)  # [blocks, BLOCK_SIZE_N]
        if SCALE_MODE == 0:
            if FORMAT == 1:
                # e4m3 by bit moves (`e4m3_f16`: the scale * 2^-8, exact); 2^22 = 2^8 back times 2^14, which undoes
                # `_e2m1_pair_f16`'s 2^-14
                scale = e4m3_f16(code).to(tl.float32) * 4194304.0
            else:
                # 2^(e - 127) * 2^14 built as float32 bits: exact for e <= 240; e8m0 codes above (scales past 2^113)
                # and 0xFF (NaN) are never in a checkpoint's weights. Below ~2^-120 the products leave bf16's normal
                # range and lose bits (the reference keeps float32 subnormals); no real block is that small either.
                scale = ((code + 14) << 23).to(tl.float32, bitcast=True)
        else:
            # bf16 scales that undo `_e2m1_pair_bf16`'s 2^-126 but for NVFP4's 2^-7, MXFP4's 2^-32 (`_unscale`)
            if FORMAT == 1:
                # the e4m3 scale * 2^-8 (`e4m3_f16`) * 2^127: s * 2^119 <= 480 * 2^119 < bf16's largest, exact (4
                # significant bits, normal from s = 2^-9 up); products value * s * 2^-7 lie in 2^-17 .. 21
                scale = (e4m3_f16(code).to(tl.float32) * 1.7014118346046923e38).to(tl.bfloat16)
            else:
                # 2^(e - 127 + 126 - 32) as bf16 bits: products value * 2^(e - 127 - 32) stay normal and exact for
                # block scales 2^-93 .. 2^33 (e8m0 codes 34 .. 160, real checkpoints' far inside)
                scale = ((code + 94) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        # byte row j (columns 2j, 2j + 1) takes block (k0 + 2j) // BLOCK_COLS: [blocks, BLOCK_COLS / 2, N] -> [K / 2, N]
        scale = tl.reshape(
            tl.broadcast_to(scale[:, None, :], (num_blocks, BLOCK_COLS // 2, scale.shape[1])),
            (BLOCK_SIZE_K // 2, scale.shape[1]),
        )
        # e2m1 (<= 2 significant bits) x e4m3 (<= 4) or x 2^e fits bf16's 8: the rounding to bf16 is exact
        if SCALE_MODE == 0:
            low, high = _e2m1_pair_f16(byte)
            w_even = (low.to(tl.float32) * scale).to(tl.bfloat16)
            w_odd = (high.to(tl.float32) * scale).to(tl.bfloat16)
        else:
            # one packed bf16 multiply per two weights (PTX mul.bf16x2, SASS HMUL2.BF16_V2; bf16 has no flush to
            # zero, the subnormal codes count): written widened to float32 because Triton's interpreter multiplies
            # bf16 as its raw uint16 bits; LLVM narrows fptrunc(fmul(fpext a, fpext b)) back to the bf16 multiply
            # (float32's 24 bits >= 2 x 8 + 2: one rounding either way)
            low, high = _e2m1_pair_bf16(byte)
            w_even = (low.to(tl.float32) * scale.to(tl.float32)).to(tl.bfloat16)
            w_odd = (high.to(tl.float32) * scale.to(tl.float32)).to(tl.bfloat16)
        acc = _dot_split(a1_hi, a1_lo, w_even, acc, SPLIT_ACTIVATIONS)
        acc = _dot_split(a2_hi, a2_lo, w_odd, acc, SPLIT_ACTIVATIONS)
    return acc


@triton.jit
def _unscale(acc, FORMAT: tl.constexpr, SCALE_MODE: tl.constexpr):
    """acc times the power of two that `_weight_step`'s "bf16" scale mode left out of the 4-bit weights (NVFP4 2^7,
    MXFP4 2^32): exact, so the sums equal those of unscaled weights (float32 subnormal products aside: below 2^-119
    or 2^-94 of a weight times an activation, far under what a sum keeps)."""
    if FORMAT == 1 and SCALE_MODE == 1:
        acc = acc * 128.0
    elif FORMAT == 2 and SCALE_MODE == 1:
        acc = acc * 4294967296.0
    return acc


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
    SPLIT_ACTIVATIONS: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """h[row, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n]) for the rows of one expert's M tile: gate [N, K] at
    byte 0 of the expert, up [N, K] at `up_off`, their block scales at `gate_up_scale_off` and `up_scale_off`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    token = pair // top_k
    n0 = pid_n * BLOCK_SIZE_N
    offs_n = n0 + tl.arange(0, BLOCK_SIZE_N)
    n_ok = offs_n < N
    base = w_ptr + expert.to(tl.int64) * stride_we  # int64: slots * stride passes 2^31 bytes
    x_rows = x_ptr + token[:, None] * stride_xm
    acc_gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        a1_hi, a1_lo, a2_hi, a2_lo = _activations(
            x_rows, row_ok, k0, K, FORMAT, SPLIT_ACTIVATIONS, WORD_ACTIVATIONS, BLOCK_SIZE_K
        )
        acc_gate = _weight_step(
            acc_gate, a1_hi, a1_lo, a2_hi, a2_lo, base, base + gate_up_scale_off, n0, offs_n, n_ok, k0, K,
            FORMAT, BLOCK_ROWS, BLOCK_COLS, SPLIT_ACTIVATIONS, SCALE_WORDS, SCALE_MODE, BLOCK_SIZE_K,
        )  # fmt: skip
        acc_up = _weight_step(
            acc_up, a1_hi, a1_lo, a2_hi, a2_lo, base + up_off, base + up_scale_off, n0, offs_n, n_ok, k0, K,
            FORMAT, BLOCK_ROWS, BLOCK_COLS, SPLIT_ACTIVATIONS, SCALE_WORDS, SCALE_MODE, BLOCK_SIZE_K,
        )  # fmt: skip
    acc_gate = _unscale(acc_gate, FORMAT, SCALE_MODE)
    acc_up = _unscale(acc_up, FORMAT, SCALE_MODE)
    if HAS_TENSOR_SCALE:  # NVFP4's weight_scale_2, once per output instead of once per weight
        ts_ptr = (base + tensor_scale_off).to(tl.pointer_type(tl.float32))
        acc_gate = acc_gate * tl.load(ts_ptr)
        acc_up = acc_up * tl.load(ts_ptr + 1)
    h = swiglu_rounded(acc_gate, acc_up, h_ptr)
    tl.store(
        h_ptr + rows[:, None] * stride_hm + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
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
    SPLIT_ACTIVATIONS: tl.constexpr,
    WORD_ACTIVATIONS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """out[pair, kk] = weight[pair] * (h[row] . down[e, kk]) for the rows of one expert's M tile (kk over hidden K,
    the dot over N): down [K, N] at `down_off`, its block scales at `down_scale_off`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows, pair, row_ok = tile_rows(sorted_pair_ptr, num_pairs, pid_m, BLOCK_SIZE_M)
    out0 = pid_n * BLOCK_SIZE_N
    offs_out = out0 + tl.arange(0, BLOCK_SIZE_N)
    out_ok = offs_out < K
    base = w_ptr + expert.to(tl.int64) * stride_we
    h_rows = h_ptr + rows[:, None] * stride_hm
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_SIZE_K):
        a1_hi, a1_lo, a2_hi, a2_lo = _activations(
            h_rows, row_ok, n0, N, FORMAT, SPLIT_ACTIVATIONS, WORD_ACTIVATIONS, BLOCK_SIZE_K
        )
        acc = _weight_step(
            acc, a1_hi, a1_lo, a2_hi, a2_lo, base + down_off, base + down_scale_off, out0, offs_out, out_ok, n0, N,
            FORMAT, BLOCK_ROWS, BLOCK_COLS, SPLIT_ACTIVATIONS, SCALE_WORDS, SCALE_MODE, BLOCK_SIZE_K,
        )  # fmt: skip
    acc = _unscale(acc, FORMAT, SCALE_MODE)
    if HAS_TENSOR_SCALE:
        acc = acc * tl.load((base + tensor_scale_off).to(tl.pointer_type(tl.float32)) + 2)
    routing = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]  # rounded like the reference
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_out[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


# (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) by (weight bits, BLOCK_SIZE_M): decode tiles (16 rows) take
# narrow N tiles so a batch-1 call still spreads over the SMs (gate/up: 8 experts x 768 / 32 = 192 programs, down:
# 8 x 2048 / 32 = 512 on Qwen3-30B-A3B) with 3-4 stages of 2 KB per matrix in flight; prefill tiles (64 rows) take
# 64 x 128 tiles, tensor-core sized. 4-bit decode K steps are 128 (were 256): in the sm_90 SASS the 256 step's gate/up
# took 244 registers (255 and a stack before the word loads), 2 programs per SM, the 128 step 128 registers, 4 per SM,
# at 10.0 instructions per weight against 9.3 (not yet timed on a GPU; --sweep times both). FP8's BLOCK_SIZE_K is its
# scale block's columns and its BLOCK_SIZE_N a divisor of the block's rows (one scale per tile), whatever this table
# says. The module doc has the reasoning; `benches/quant_moe.py --sweep` times alternatives on a GPU.
LAUNCH_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (4, 16): (32, 128, 4, 4),
    (4, 64): (64, 128, 4, 3),
    (8, 16): (32, 128, 4, 4),
    (8, 64): (64, 128, 4, 3),
}


# 16-bit activations and 4-bit formats' block scales read as 32-bit words where aligned (`_activations`,
# `_weight_step`); False: the byte and 16-bit element loads (kept to time both: benches/quant_moe.py --byte-loads)
WORD_LOADS = True


# How the 4-bit kernels apply block scales (`_weight_step`), by name: "f32" decodes e2m1 to float16, multiplies by
# a float32 scale and rounds to bf16 (a HADD2.F32 convert, an FMUL and half an F2FP pack per weight); "bf16" decodes
# e2m1 straight to bf16 and multiplies by a bf16 scale (half a packed HMUL2.BF16 per weight), the power of two kept
# out of range put back on the accumulator (`_unscale`). Both give the reference's weights bit for bit.
# benches/quant_moe.py --sweep times each.
SCALE_MODES = {"f32": 0, "bf16": 1}
SCALE_MODE = "bf16"


def launch_config(fmt: ExpertFormat, num_pairs: int) -> tuple[int, int, int, int]:
    """The default (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) of `fmt`'s kernels for `num_pairs` pairs."""
    return LAUNCH_CONFIGS[(fmt.weight_bits, block_m_for(num_pairs))]


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _blocks(fmt: ExpertFormat, config: tuple[int, int, int, int], num_in: int) -> tuple[int, int]:
    """(BLOCK_SIZE_N, BLOCK_SIZE_K) of one kernel whose dot runs over `num_in` columns, from `config`.

    Raises:
        ValueError: a block shape the kernels cannot tile (names it): FP8 needs power-of-two block columns >= 16
            and block rows with a power-of-two divisor >= 16 (128 x 128 and 32 x 32 do).
    """
    block_n, block_k = config[0], config[1]
    if fmt.weight_bits == 8:
        rows, cols = fmt.block_rows, fmt.block_cols
        block_n = min(_pow2_at_most(block_n), rows & -rows)  # largest power of two dividing both
        if cols < 16 or cols & (cols - 1) or block_n < 16:
            raise ValueError(
                f"fused_moe_quant tiles FP8 blocks of power-of-two columns >= 16 and rows divisible by 16; the "
                f"checkpoint's weight_block_size is [{rows}, {cols}] (serve it with the CPU backend or requantize)"
            )
        return block_n, cols  # one scale block per tile
    # 4-bit: whole scale blocks per K step and K / 2 >= 16 for tl.dot; no step wider than the matrix needs
    wanted = min(_pow2_at_most(block_k), 1 << max(num_in - 1, 1).bit_length())
    return block_n, max(wanted, fmt.block_cols, 32)


def _scale_words(fmt: ExpertFormat, num_in: int, block_k: int) -> bool:
    """Whether a 4-bit kernel over `num_in` columns with K steps of `block_k` can read its block scales as 32-bit
    words: whole words per K step and per matrix row (the byte offsets' alignment is the caller's to check)."""
    word_cols = 4 * fmt.block_cols
    return block_k % word_cols == 0 and num_in % word_cols == 0


def default_kernel(layout: ExpertLayout, experts: torch.Tensor, num_pairs: int, hidden: torch.Tensor) -> str:
    """The kernels `fused_moe_quant_tiles` runs for `num_pairs` (token, expert) pairs of `experts` on `hidden`
    when left to choose. Decode batches (at most `GEMV_MAX_PAIRS` pairs): "fp4_mma" (`fused_moe_fp4_mma`) for
    NVFP4 / MXFP4 where it runs (`fused_moe_fp4_mma.supported`: on the H200 0.8x gemv's time at batch 1, 0.65x
    at batch 4, 0.6x at batch 8), else "gemv" (`fused_moe_gemv`) on slots it can read (`gemv_supported`);
    otherwise "mma" (this module's tensor-core kernels)."""
    if num_pairs > GEMV_MAX_PAIRS:
        return "mma"
    if fp4_mma.supported(layout, experts, hidden):
        return "fp4_mma"
    return "gemv" if gemv_supported(layout, experts) else "mma"


def fused_moe_quant(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    scale_mode: str | None = None,
    kernel: str | None = None,
    gemv_configs: tuple[GemvConfig, GemvConfig] | None = None,
    fp4_mma_configs: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed SwiGLU experts of each token, the experts quantized.

    Args:
        hidden: [M, K] activations (bf16/fp16/fp32, contiguous), CUDA (or CPU under TRITON_INTERPRET=1).
        experts: [S, stride] uint8, one expert (or cache slot) per row in `layout`'s pool layout, stride >=
            expert_nbytes; the same device. A stride (and base address) that is a multiple of 16 bytes, as the
            pool's 256 are, keeps the weights' loads vectorized and staged (else they go by byte: see the module doc).
        layout: the experts' `ExpertLayout` (fp8_block, nvfp4 or mxfp4; K = layout.hidden, N = layout.inter).
        topk_ids: [M, k] int64 rows of `experts`; negative: skip that pair (computed elsewhere).
        topk_weights: [M, k] routing weights.
        alignment: `align_pairs(topk_ids, S, block_m_for(M * k))`, when the caller has it.
        out: [M, K] buffer for the result (hidden's dtype); None allocates.
        config: (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) of both kernels; None: `launch_config`.
        scale_mode: how 4-bit block scales are applied, a `SCALE_MODES` name; None: `SCALE_MODE`.
        kernel, gemv_configs, fp4_mma_configs: as `fused_moe_quant_tiles`.

    Returns:
        [M, K] in hidden's dtype, as `freetoken.kernels.fused_moe.fused_moe` computes it from the dequantized
        weights: the dequantized weights exactly (bf16 tiles), float32 accumulation, rounded to hidden's dtype where
        it rounds. bf16 activations enter the dots as they are; float32 or float16 ones as two bf16 parts (hi + lo,
        ~2^-16 relative), so a float32 call matches the float32 reference to float32-sum rounding.
    """
    if alignment is None:
        alignment = align_pairs(topk_ids, experts.shape[0], block_m_for(topk_ids.numel()))
    sorted_pairs, block_expert = alignment
    return fused_moe_quant_tiles(
        hidden,
        experts,
        layout,
        topk_weights,
        sorted_pairs,
        block_expert[None],
        out,
        config=config,
        scale_mode=scale_mode,
        kernel=kernel,
        gemv_configs=gemv_configs,
        fp4_mma_configs=fp4_mma_configs,
    )


def fused_moe_quant_tiles(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    topk_weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    tile_stages: torch.Tensor,
    out: torch.Tensor | None = None,
    before_stage: Callable[[int], None] | None = None,
    config: tuple[int, int, int, int] | None = None,
    scale_mode: str | None = None,
    kernel: str | None = None,
    gemv_configs: tuple[GemvConfig, GemvConfig] | None = None,
    fp4_mma_configs: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """`fused_moe_quant` over an alignment whose tiles are split in stages run one after the other, as
    `freetoken.kernels.fused_moe.fused_moe_tiles` does for bf16 (the decode driver's hits, then its fills).

    Args:
        hidden, experts, layout, topk_weights, out, config, scale_mode: as `fused_moe_quant`.
        sorted_pairs: [R] int64 of `align_pairs` (block_m_for(M * k) rows per tile).
        tile_stages: [S, R / block_m] int64: the slot of each tile in the stage that runs it, -1 in the others.
        before_stage: called with s before stage s > 0 is queued.
        kernel: "mma" (this module's tensor-core kernels), "gemv" (`fused_moe_gemv`'s CUDA-core ones), "fp4_mma"
            (`fused_moe_fp4_mma`'s, NVFP4 / MXFP4 on CUDA) or None: `default_kernel`, unless `config` is given.
        gemv_configs: the "gemv" kernels' (gate/up, down) `fused_moe_gemv.GemvConfig`s; None: their defaults.
        fp4_mma_configs: the "fp4_mma" kernels' (gate/up, down) `fused_moe_fp4_mma.Fp4MmaConfig`s (or plain tuples of
            their leading fields); None: `fused_moe_fp4_mma.default_configs`.

    Returns:
        [M, K] as `fused_moe_quant`; each tile computed by the same kernels whatever the staging.

    Raises:
        ValueError: an unknown `kernel`, "gemv" for experts `gemv_supported` refuses, "fp4_mma" where
            `fused_moe_fp4_mma.supported` does not hold, or `fp4_mma_configs` that `fused_moe_fp4_mma.configs_for`
            refuses.
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
    weights = topk_weights.reshape(-1).contiguous()
    if kernel not in (None, "mma", "gemv", "fp4_mma"):
        raise ValueError(f"fused_moe_quant kernel {kernel!r}: expected 'mma', 'gemv' or 'fp4_mma'")
    if kernel == "gemv" and not gemv_supported(layout, experts):
        raise ValueError(f"the gemv kernels cannot read these {fmt.name} experts (unaligned rows or FP8 blocks)")
    if kernel == "fp4_mma" and not fp4_mma.supported(layout, experts, hidden):
        raise ValueError(
            f"the fp4_mma kernels run NVFP4 / MXFP4 experts on sm_80+ CUDA with bf16 activations, not these {fmt.name}"
        )
    if kernel is None and config is None:
        kernel = default_kernel(layout, experts, num_pairs, hidden)
    split = 1  # rows of `pairs` a pair: its down dot's shares (`fused_moe_fp4_mma.fp4_mma_tiles`)
    fp4_configs = None
    if kernel == "fp4_mma":
        fp4_configs = fp4_mma.configs_for(fp4_mma_configs, num_pairs, hidden_size, inter)
        split = fp4_configs[1].split
    pairs = torch.zeros(num_pairs * split, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if kernel in ("gemv", "fp4_mma"):
        for stage, block_expert in enumerate(tile_stages):
            if stage and before_stage is not None:
                before_stage(stage)
            if kernel == "gemv":
                gemv_tiles(
                    hidden, experts, layout, weights, sorted_pairs, block_expert, block_m, h, pairs, gemv_configs
                )
            else:
                assert fp4_configs is not None  # resolved above
                fp4_mma.fp4_mma_tiles(
                    hidden, experts, layout, weights, sorted_pairs, block_expert, block_m, h, pairs, fp4_configs
                )
        return sum_pairs(pairs, top_k * split, out)
    sec = layout.sections
    gate_up_off, gate_up_n = sec["gate_up"]
    gate_up_scale_off, gate_up_scale_n = sec["gate_up_scale"]
    config = config or launch_config(fmt, num_pairs)
    meta = {
        "FORMAT": FORMAT_IDS[fmt.name],
        "BLOCK_ROWS": fmt.block_rows,
        "BLOCK_COLS": fmt.block_cols,
        "HAS_TENSOR_SCALE": fmt.tensor_scale,
        "SPLIT_ACTIVATIONS": hidden.dtype != torch.bfloat16,
        "SCALE_MODE": SCALE_MODES[scale_mode or SCALE_MODE] if fmt.weight_bits == 4 else 0,  # FP8: one build
        "BLOCK_SIZE_M": block_m,
        "num_warps": config[2],
        "num_stages": config[3],
    }
    gate_up_n_block, gate_up_k_block = _blocks(fmt, config, hidden_size)
    down_n_block, down_k_block = _blocks(fmt, config, inter)
    # word loads need 4-byte aligned rows and sections (checked here: a misaligned 32-bit load faults)
    words_ok = WORD_LOADS and fmt.weight_bits == 4 and experts.stride(0) % 4 == 0 and experts.data_ptr() % 4 == 0
    gate_up_words = {
        "WORD_ACTIVATIONS": words_ok
        and hidden.element_size() == 2
        and hidden.stride(0) % 2 == 0
        and hidden.data_ptr() % 4 == 0,
        "SCALE_WORDS": words_ok
        and _scale_words(fmt, hidden_size, gate_up_k_block)
        and gate_up_scale_off % 4 == 0
        and (gate_up_scale_n // 2) % 4 == 0,
    }
    down_words = {
        "WORD_ACTIVATIONS": words_ok and h.element_size() == 2,  # h: a fresh [rows, inter] buffer, inter even
        "SCALE_WORDS": words_ok and _scale_words(fmt, inter, down_k_block) and sec["down_scale"][0] % 4 == 0,
    }
    for stage, block_expert in enumerate(tile_stages):
        if stage and before_stage is not None:
            before_stage(stage)
        grid = (num_rows // block_m, triton.cdiv(inter, gate_up_n_block))
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
            BLOCK_SIZE_N=gate_up_n_block,
            BLOCK_SIZE_K=gate_up_k_block,
            **gate_up_words,
            **meta,
        )
        grid = (num_rows // block_m, triton.cdiv(hidden_size, down_n_block))
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
            BLOCK_SIZE_N=down_n_block,
            BLOCK_SIZE_K=down_k_block,
            **down_words,
            **meta,
        )
    return sum_pairs(pairs, top_k, out)


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
