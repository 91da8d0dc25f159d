"""Grouped SwiGLU over 4-bit (e2m1) experts for decode batches, decoded in registers straight into the tensor
cores' operands (Gluon, sm_80+ `mma.sync`), Marlin-style.

`fused_moe_gemv`'s CUDA-core kernels spend per weight three integer operations to decode it and a float32 FMA (the
H200's integer pipes run at half the FMA pipe's rate). Here each 32-bit word of eight nibbles becomes four packed
bf16 pairs in 15 integer operations, one packed multiply per pair applies the block scale, and `mma.sync`
(m16n8k16, float32 accumulators) does the multiply-adds: about two integer operations per weight and no FMA. Same
arguments, tiles and results as `fused_moe_gemv.gemv_tiles` (up to float32 sum order); `fused_moe_quant_tiles`
runs these for NVFP4 and MXFP4 decode batches on CUDA.

Operands (Gluon layouts, `_layouts`): the weights are mma's A operand, [rows, K] with k_width 8, so a thread holds
8 consecutive K columns of a row, i.e. one 32-bit word of the packed weights; the tokens of an M tile are the B
operand's 8 columns (a tile's rows, 8 at a time; padding rows read valid memory, token 0 or h's own padding rows,
and are not stored). A dot is a sum over K in any order, so the kernel decodes each word in the order its bits make
cheap and loads the activations in the same order:
  - Decoding (`_DECODE`): nibbles j and j + 4 of a word sit 16 bits apart, as the two halves of a bf16 pair do.
    One shift puts both magnitudes (e2m1 `ee m`) at bf16's low exponent bits and top mantissa bit (bits 6-8 of each
    half), another both signs at bits 15 and 31: a bf16 pair holding the values * 2^-126 (ee = 0, the codes 0 and
    0.5, lands on bf16 subnormals, which the packed bf16 multiply keeps: `fused_moe_quant`'s "bf16" scale mode
    relies on the same, tested on the GPU). Pair j of the word is (nibble j, nibble j + 4), so the word's 8 K
    positions in the operand are the columns 0, 4, 1, 5, 2, 6, 3, 7 of its 8.
  - Activations: gate/up's x, as the layer gets it: each thread loads its 8 columns of a token as they lie (bf16
    pairs, one 16-byte load) and permutes the halves into that order (`_PERMUTE`, four PRMT). The down kernel's h,
    which gate/up writes: stored in mma order (`_mma_order_column`), already in the decode's order and laid so that
    each 16-byte load fills two mma.sync B operands' register pairs: no permute, and no register moves to pair them
    (h stored only in the decode's order left ptxas moving registers, below). Against h as it lies (same bench,
    side by side, two runs each): batch 1 NVFP4 10.30 against 10.56-10.61 us (down's sm_90 SASS 824 against 920
    instructions), MXFP4 10.18-10.24 against 10.14-10.18 (no faster); batch 4 36.6 / 35.5 against 39.3 / 38.1 us;
    batch 8 (staged) 58.6 / 55.3 against 58.7 / 54.5 us.
  - Block scales multiply the decoded pair (`mul.rn.bf16x2`): products of an e2m1 value (2 significant bits) and
    an e4m3 scale (4) are exact in bf16, as in `fused_moe_quant`. The multiplier is the scale * 2^62: NVFP4's e4m3
    code moved into bf16's fields is the scale * 2^-120 (subnormals included), then two multiplies by 2^91;
    MXFP4's e8m0 code e becomes the bf16 2^(e - 65) by one integer multiply-add (exact for e <= 192, scales up to
    2^65, as `fused_moe_gemv`). Products are value * scale * 2^-64; the sums are multiplied by 2^64 once (and by
    NVFP4's per-tensor weight_scale_2).
  - NVFP4's two codes of a lane's row and K step (its 32 columns) load as one 16-bit word, and one bf16 pair holds
    both multipliers (`_NVFP4_MULT_2`: spread, moved and cleared in three integer operations, the two multiplies
    once for both); each decoded pair takes its half of it, which ptxas folds into the multiply as an operand
    swizzle (`.H0_H0` / `.H1_H1`). Against one 8-bit load and multiplier per code: 8 fewer instructions and 2
    fewer loads a K step of a thread (sm_90 SASS, 206 against 214), and at batch 1 the two kernels' span 10.59-10.66
    against 10.98-11.01 us, gate/up alone 6.84-6.87 against 7.26 us (same bench, side by side, five runs against
    four).
  - NVFP4 block scales are taken as non-negative (the sign bit is not decoded): ModelOpt writes amax / 6.
  - The K steps of a lane's words are contiguous in memory (`_dots`): one vector load per row, and the words of a
    scale block in one lane.
Work split: a program owns 16 weight rows of one expert tile (gate/up: 8 gate rows then the same 8 up rows, so a
thread's accumulators for gate n and up n are in its own registers and SwiGLU needs no shuffle) and its warps
each run one slice of K (`Fp4MmaConfig`), their [16, 8] sums added at the end: at batch 1 a layer has only 8 x 96
gate/up blocks of 16 rows, one warp each would leave the SMs' schedulers idle while each warp's steps wait on
memory one after the other.

Loads: a program issues its weights' first loads right after reading its tile's expert, before it looks up its
tokens, and runs a tile's first 8 rows without counting its real rows (`align_pairs` puts them first): the two
round trips to memory overlap. Each step then issues the next step's weight loads before it waits on its own
(given the register cap of `Fp4MmaConfig`; ptxas left to itself sinks them past the step's first mma), and loads
its activations (L1 hits) itself. The warps' K slices interleave by K step (`INTERLEAVED_SLICES`): a step's loads
of a row lie side by side. On sm_90 the down kernel is a programmatic dependent launch of gate/up
(`PROGRAMMATIC_LAUNCH`): its programs start as gate/up's last ones run, and load their expert and first weights
before `griddepcontrol.wait`. What the epilogues read (NVFP4's tensor scales, the rows' pairs and routing weights) is
loaded before the dots. From batch 8 (`default_configs`) a program copies every K step of its slice into shared
memory up front instead (cp.async, 16-byte copies past L1; `FP4_MMA_STAGED_CONFIGS`): all of its bytes in flight
at once, none of them in registers.

One token (`FP4_MMA_SMALL_CONFIGS`, up to 8 pairs) runs the down kernel's K in 3 programs of a third each, which
write their shares to their own rows of `pairs` (`sum_pairs` adds them with the token's k outputs): 3x the down
programs, each a third of the loop that follows `griddepcontrol.wait`. Both kernels' K loops are unrolled by two
there (`Fp4MmaConfig.unroll`). The down kernel's padding columns (tokens past a tile's real ones) read the tile's
first h row, which the real ones read too, not their own rows: at batch 1 their own were 7/8 of the h bytes from L2.

Measured on the H200 (`benches/quant_moe.py --profile --batch 1 4 8 --kernels fp4_mma`, Qwen3-30B-A3B shapes, 128
slots, kernels replayed from a CUDA graph, this module's last runs): the span of the two kernels per layer call, from
gate/up's start to down's end, is at batch 1 10.30 us for NVFP4 (two runs; 1.24x bf16's time per weight byte) and
10.14-10.24 us for MXFP4 (nine runs of the same MXFP4 code; 1.27-1.30x, median 1.285x: MXFP4 has the fewest bytes
to spread the same decode over), against bf16's 29.58-30.34 us (bf16's span moves by up to 0.8 us run to run,
2.6%); the layer call replayed whole (alignment, the zeroed `pairs`, the kernels, `sum_pairs`) 16.9-18.5 /
16.5-18.0 against 33.4-33.9 us. At batch 4 36.6 / 35.5 us (1.83x / 1.88x; bf16 71.2), at batch 8, staged, 58.6 /
55.3 us (1.69x / 1.69x; bf16 123.1). Before h in mma order, batch 1 NVFP4 was 10.56-10.66 us (1.25-1.27x), before
the packed NVFP4 codes 10.98-11.01 us (1.29-1.30x); before the split and the unrolled loops 11.9 / 11.7 us (1.40x /
1.46x), 12.4 / 11.5 us a session earlier. The issue's 1.3x per byte at batch 1: both formats within it, MXFP4 by
its median only (one run of nine at 1.303x, when bf16's span was its shortest).

What bounds batch 1 (Nsight Compute on gate/up, NVFP4, `ncu --section WarpStateStats --section SchedulerStats`):
latency with few warps. The layer's 768 programs of 2 warps are 2.9 warps per scheduler, 0.66 of them eligible on
average; a scheduler issues every 2.1 cycles, and 47% of a warp's cycles between instructions wait on L1TEX loads;
the ALU pipe is 34% busy and DRAM 24% of its peak. Reading the same 12.6 MB of gate/up words in the same order,
without the decode, takes 2.9 us (`benches/read_pattern.py`, 4.3 TB/s), so the bytes are not the limit. Tried and
measured, no faster at batch 1: 4 warp slices (at 72 or 80 registers, to stay one wave; the cross-warp sum and
each warp's own prologue cost more than the extra warps hide), loads 2 steps ahead (128 or 168 registers), every
step's loads up front (spills), 256-column steps, one warp per 16 rows with no K split (10.1 us gate/up), the K
steps staged through shared memory by cp.async (13.7 us), contiguous rather than interleaved slices. Nsight's
per-instruction samples (`--section SourceCounters --page source --print-source sass`): 78% of the stall samples
fall in the K-step loop, 15% before it; 27% of all of them on one instruction, the PRMT that waits on the third of a
step's four 16-byte activation loads, though activations are 4 KB a token that every warp reads again each step:
the L1 hit rate is 58%, and each SM streams ~100 KB of weights through L1. Tried since, no faster at batch 1 (same
bench, side by side): the weights loaded past L1 (`.cg`: 12.66 vs 12.51 us NVFP4), every K step staged in shared
memory (12.4-13.0 us; faster from batch 8, above), two accumulators alternating by K step against the chain of 8
mma.sync a step puts on one (no faster even in a build whose accumulator swap was wrong and broke the chains), the
epilogue's loads hoisted (kept: within noise). Each program's own time (`%globaltimer` stamped at its start and end,
batch 1, eager launches): gate/up programs all start within 0.1 us and each runs ~6.2 us, staged or not; down
programs run 3.4-3.8 us after their wait, their weights staged or not. The bytes arrive in about half that
(read_pattern above), so most of a program's time is issuing the decode: ~20 instructions (SASS) per 32-bit word of
8 values, 8 words a thread per K step, ~3 warps per scheduler, about 2.9 us of issue per SM for gate/up alone at one
instruction a cycle. Five per bf16 pair (two shifts, two LOP3, the scale's HMUL2) is near the least without an e2m1
convert instruction (sm_100's cvt.e2m1x2; PRMT's byte lookup cannot build a 9-bit field).

Tried after that, each no faster (same bench, side by side; batch 1, NVFP4 / MXFP4, unless said):
  - L1 prefetch (`prefetch.global.L1`) at a program's start of its activations' rows, or of those and its weights'
    and scales' rows: 1.6-1.7x slower at batches 1-8 (MXFP4 batch 1: 19.0 / 19.7 us against 11.9).
  - Staged copies waited for step by step (a commit group per K step) instead of all at once: 11.84 / 11.90 us.
  - The down kernel decoding all its K steps into shared memory (bf16 pairs, 24 KB a program) before
    `griddepcontrol.wait`, leaving only h's loads and the mma after it: 13.7 against 12.4 us NVFP4. A program that
    needs 24 KB of shared memory does not land on an SM whose L1/shared split gate/up's programs have set, so the
    down programs started only as gate/up drained (their own time fell from 10.7 to 7.5 us). With gate/up's
    preferred carveout at 100% (`cuFuncSetAttribute`) they ran alongside it, and gate/up's own time grew from 7.7
    to 9.2 us while what follows it shrank from 4.9 to 3.9 us: 13.0 against 12.5 us NVFP4, 12.2 against 11.7 MXFP4
    (the carveout alone costs 0.4 us). Loading h 1, 2, 3 or 6 steps ahead after the wait changed nothing.
  - Two accumulators again, written as the K loop unrolled by two (no tuple swap) and checked against the
    reference: 13.7 / 12.7 us at register caps that do not spill (the unrolled loop spills at 80); staged, 13.1 /
    12.0 against 12.8 / 12.0 us; no faster at batches 4 and 8 either.
  - One launch for both kernels, its down programs waiting on per-tile counters instead of the whole gate/up grid:
    `benches/dependency_gap.py` times the wait alone, on programs shaped as these (768 gate/up programs busy 6 us,
    1024 down programs that only store). A programmatic dependent launch adds 1.0 us to gate/up alone, stream order
    1.2-1.3 us, and the counters 3.7-3.9 us. So one launch could win 1 us at most over PDL, and as written it loses.

Tried with the split (same bench, side by side; batch 1 span, NVFP4 / MXFP4, against the split's 11.1 / 10.5 us):
  - Down's K in 2 or 6 programs: 12.6 / 11.7 and 12.8 / 12.0 us (3 without the unrolled loop: 11.8 / 10.8).
  - h stored by gate/up in the decode's column order, so that down loads it without the PRMT permute: within
    noise with the split (11.12 / 10.66 against 11.14 / 10.6 us), 12.9 against 12.1 us NVFP4 without it; ptxas
    moves registers to pair B's operands instead (mma order, above, lays the pairs as the mma takes them: kept).
  - Down's h loaded a step ahead: 12.1 against 11.8 us NVFP4 without the split, 13.1 with it.
  - Down decoding its two steps into registers before the wait (`griddepcontrol.wait`): 11.5 / 10.6 us at 96
    registers, 11.9 / 11.1 at 128; each step's weights loaded up front instead (prefetch 2): 11.9 / 11.2 us.
  - Gate/up calling `griddepcontrol.launch_dependents` after its dots, not at its start: 12.0 / 11.3 us.
  - Register caps: gate/up 96-144 all within 0.1 us; down 72 or 88 (11.8 / 10.9 us) or ptxas's own (11.3 / 11.2).
  - 256-column K steps: down 12.2 / 11.6 us, gate/up at 168 registers 13.0 / 12.0.

Shapes (project letters): M tokens, K hidden, N expert intermediate. Each matrix's K a multiple of its kernel's
warp slices of whole K steps (`fits`, `supported`).
Test: python -m pytest -m gpu tests/kernels/test_kernels_quant.py -k fp4_mma
Bench: python benches/quant_moe.py --profile --kernels gemv fp4_mma; python benches/gemv_grid.py --kernel fp4_mma;
python benches/read_pattern.py
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from freetoken.quant.formats import ExpertLayout

# nibbles j, j + 4 -> a bf16 pair of the values * 2^-126, times the block multiplier $5 (module doc): pair j's
# magnitudes shifted by 6 - 4j to bits 6-8 / 22-24, its signs by 12 - 4j to bits 15 / 31
_DECODE = gl.constexpr("""{
.reg .b32 m, s;
shl.b32 m, $4, 6;
shl.b32 s, $4, 12;
and.b32 m, m, 0x01C001C0;
and.b32 s, s, 0x80008000;
or.b32 m, m, s;
mul.rn.bf16x2 $0, m, $5;
shl.b32 m, $4, 2;
shl.b32 s, $4, 8;
and.b32 m, m, 0x01C001C0;
and.b32 s, s, 0x80008000;
or.b32 m, m, s;
mul.rn.bf16x2 $1, m, $5;
shr.b32 m, $4, 2;
shl.b32 s, $4, 4;
and.b32 m, m, 0x01C001C0;
and.b32 s, s, 0x80008000;
or.b32 m, m, s;
mul.rn.bf16x2 $2, m, $5;
shr.b32 m, $4, 6;
and.b32 m, m, 0x01C001C0;
and.b32 s, $4, 0x80008000;
or.b32 m, m, s;
mul.rn.bf16x2 $3, m, $5;
}""")

# the block multipliers (scale * 2^62) of two NVFP4 codes as they lie in a 16-bit load $1 (code 0 in the low byte),
# a bf16 pair (code 0's in the low half): each e4m3 code spread to its half, moved to bf16's fields (the scale *
# 2^-120) with its sign bit cleared, then times 2^91 twice (0x6D00: 2^91)
_NVFP4_MULT_2 = gl.constexpr("""{
.reg .b32 t, c, z;
mov.b32 z, 0;
prmt.b32 t, $1, z, 0x4140;
shl.b32 t, t, 4;
and.b32 t, t, 0x07F007F0;
mov.b32 c, 0x6D006D00;
mul.rn.bf16x2 t, t, c;
mul.rn.bf16x2 $0, t, c;
}""")
# a bf16 pair's low / high half in both halves (for the multiply that takes it, an operand swizzle in sm_90 SASS)
_LOW_HALVES = gl.constexpr("""{
.reg .b16 l, h;
mov.b32 {l, h}, $1;
mov.b32 $0, {l, l};
}""")
_HIGH_HALVES = gl.constexpr("""{
.reg .b16 l, h;
mov.b32 {l, h}, $1;
mov.b32 $0, {h, h};
}""")
# MXFP4's e8m0 code e -> its multiplier in both halves: bf16 exponent field e + 62
_MXFP4_MULT = gl.constexpr("mad.lo.u32 $0, $1, 0x00800080, 0x1F001F00;")

# 8 activations of a thread (columns 0-7 of a word, as bf16 pairs $4-$7) -> the decode's order 0, 4, 1, 5, 2, 6, 3, 7
_PERMUTE = gl.constexpr("""{
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
}""")

# bf16 pair (int32) -> its two halves as bf16 elements (a register rename)
_HALVES = gl.constexpr("mov.b32 $0, $1;")

# %tid.x of each thread (the warp's K slice, `_dots`)
_THREAD = gl.constexpr("mov.u32 $0, %tid.x;")

_UNSCALE = gl.constexpr(2.0**64)

# programmatic dependent launch (PTX ISA 7.8, sm_90): the gate/up kernel lets the down kernel launch early, the down
# kernel waits for it before reading h ($0: a dummy output, as inline asm needs one)
_LAUNCH_DEPENDENTS = gl.constexpr("griddepcontrol.launch_dependents; // $0")
_WAIT_PRIMARY = gl.constexpr("griddepcontrol.wait; // $0")

# the warps' K slices: interleaved by K step (True) or contiguous (False; `benches/gemv_grid.py --contiguous-slices`)
INTERLEAVED_SLICES = True

# the down kernel launched as a programmatic dependent of the gate/up kernel where the GPU has it (sm_90+); False:
# one after the other (`benches/quant_moe.py --kernels fp4_mma:GU/DOWN/nopdl`)
PROGRAMMATIC_LAUNCH = True


# A kernel's launch config. The register cap decides where ptxas puts the next steps' loads: left to itself it
# issues them after the step's first mma, so each step waits on its own round trip to memory; given a cap with room
# for them (sm_90 SASS, `benches/quant_moe.py --kernels fp4_mma:..`) it issues them first, before the step's wait.
class Fp4MmaConfig(NamedTuple):
    """One kernel's launch config (plain tuples of the first four or more fields are taken as well)."""

    k_units: int  # K step in 32-column units: a power of two, at least 4 (`fits`)
    num_warps: int  # warps per program, each on its own slice of the program's K
    prefetch: int  # K steps loaded ahead into registers (1 or 2), or 0: every step copied to shared memory up front
    max_registers: int  # ptxas's maxnreg, or 0: ptxas's choice
    unroll: int = 0  # 1: at prefetch 1 and an even number of steps, the K loop unrolled by two (no register moves)
    split: int = 1  # down only: its K split over this many programs, each summing its own share into its own rows


# (gate/up, down) past SMALL_UP_TO_PAIRS (token, expert) pairs and below STAGED_FROM_PAIRS: the H200's fastest at
# batches 4 and 8 on Qwen3-30B-A3B's shapes (`benches/quant_moe.py --profile --kernels fp4_mma:...`, NVFP4 and MXFP4
# alike; `benches/gemv_grid.py --kernel fp4_mma` for one kernel alone), K steps of 128 columns loaded one step ahead,
# 80 registers: gate/up's 2048 columns in 2 warp slices of 8 steps, down's 768 in one warp of 6 steps. Against
# ptxas's own choice (96 registers, loads after the first mma): the same at batch 1, 0.87x the two kernels' span at
# batch 4 (NVFP4; MXFP4 0.94x). No faster: 4 warp slices (at 72 or 80 registers, to stay one wave of programs), 2 for
# down, loads 2 steps ahead (128 or 168 registers), all steps' loads up front (spills), 256-column steps.
FP4_MMA_CONFIGS: tuple[Fp4MmaConfig, Fp4MmaConfig] = (Fp4MmaConfig(4, 2, 1, 80), Fp4MmaConfig(4, 1, 1, 80))
# (gate/up, down) up to SMALL_UP_TO_PAIRS pairs (one token of top-8): the K loops unrolled by two (gate/up at 128
# registers), and down's K split over 3 programs of 2 steps each (3x its programs, each a third of the loop after
# the wait; `sum_pairs` adds the thirds). The two kernels' span on the H200 at batch 1 (same bench, side by side,
# two runs, before NVFP4's packed codes): 10.98-11.01 against 11.04-11.07 us NVFP4 without the peeled last steps
# and 11.9 without the split or the unrolled loops; MXFP4 10.14-10.18 against 10.40-10.42 and 11.8 us; bf16's
# 30.0-30.1 us. Down's register cap with the packed codes: 80 (10.62-10.66 us NVFP4), 88 (11.04), 96 (10.83). Where
# these do not fit a model's sizes (`fits`), FP4_MMA_CONFIGS runs.
FP4_MMA_SMALL_CONFIGS: tuple[Fp4MmaConfig, Fp4MmaConfig] = (
    Fp4MmaConfig(4, 2, 1, 128, unroll=1),
    Fp4MmaConfig(4, 1, 1, 80, unroll=1, split=3),
)
SMALL_UP_TO_PAIRS = 8
# (gate/up, down) from STAGED_FROM_PAIRS (token, expert) pairs on: every K step of a warp's slice copied into shared
# memory up front (cp.async; PREFETCH 0), which holds no registers while the copies fly. The two kernels' span on the
# H200 (same shapes and bench, two runs), against FP4_MMA_CONFIGS: at batch 8 0.88x / 0.88x NVFP4, 0.96x / 0.91x
# MXFP4; at batch 4 0.96x / 1.01x NVFP4, 0.93x / 1.02x MXFP4; at batch 1 1.01x NVFP4, 1.02x MXFP4.
FP4_MMA_STAGED_CONFIGS: tuple[Fp4MmaConfig, Fp4MmaConfig] = (Fp4MmaConfig(4, 2, 0, 0), Fp4MmaConfig(4, 1, 0, 0))
STAGED_FROM_PAIRS = 64  # batch 8 of top-8, the first measured batch where staging wins in every run


def _layouts(k_units: int, num_warps: int, group_words: int, mma_order: bool = False) -> dict:
    """The kernel's Gluon layouts for K steps of BK = 32 * `k_units` columns, `num_warps` warps each on its own K
    slice of the program's 16 rows (BM = 16 * num_warps rows of the operands: warp w's 16 are the same rows at
    slice w) and scale blocks of `group_words` 32-bit words (NVFP4 2, MXFP4 4):

    MMA: the [BM, 8] float32 accumulators (mma.sync m16n8, warps along the rows); A / B: the weight and activation
    operands, k_width 8 (a thread holds 8 consecutive K of a row / of a token column); WORDS: the [BM, BK / 8] int32
    packed weights, one per thread and 8 K columns of A (A's layout with its three lowest K bits dropped: bases from
    Triton's linear layout of A, `gl.to_linear_layout`); LOADS: the same elements per lane indexed by where the
    words lie (`_dots`: a lane's words are contiguous, its registers in that order: one vector load); SCALES:
    [BM, groups per lane, 4] scale codes, one per row, scale block and lane of a row (`_weights` broadcasts them to
    WORDS); PAIRS: the activations as loaded, [BK / 2, 8] int32 bf16 pairs in memory's column order, or where
    `mma_order` (activations stored by `_mma_order_column`) [BK / 8, 8, 4]: per token BK / 8 loads of 4 pairs, each
    load two mma.sync's B registers (`_activations`)."""
    bm, bk = 16 * num_warps, 32 * k_units
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    # A: registers K 1, 2, 4, row 8, K 32 .. BK / 2; lanes K 8, 16, rows 1, 2, 4; warps rows 16, 32 ..
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    row_lanes = [[1, 0], [2, 0], [4, 0]]
    units = [1 << i for i in range(k_units.bit_length() - 1)]
    words = gl.DistributedLinearLayout(
        [[8, 0]] + [[0, 4 * u] for u in units], [[0, 1], [0, 2]] + row_lanes, warps, [], [bm, bk // 8]
    )
    loads = gl.DistributedLinearLayout(
        [[0, u] for u in units] + [[8, 0]], [[0, k_units], [0, 2 * k_units]] + row_lanes, warps, [], [bm, bk // 8]
    )
    # SCALES [BM, loads per lane, lane]: the word registers past the group's become the load dimension; NVFP4's
    # codes load two at a time (16 bits; k_units >= 4, `fits`: an even number of groups a lane)
    groups = k_units // group_words
    loads3 = groups // 2 if group_words == 2 else groups
    reg3 = [[8, 0, 0]] + [[0, 1 << i, 0] for i in range(loads3.bit_length() - 1)]
    lanes3 = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    scales = gl.DistributedLinearLayout(reg3, lanes3, [w + [0] for w in warps], [], [bm, loads3, 4])
    # PAIRS [BK / 2, 8] int32: B's elements (K 1, 2, 4 in registers, K 8, 16 and the token in lanes) as bf16 pairs
    pairs = gl.DistributedLinearLayout(
        [[1, 0], [2, 0]] + [[16 * u, 0] for u in units],
        [[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
        [[0, 0]] * (num_warps.bit_length() - 1),
        [],
        [bk // 2, 8],
    )
    if mma_order:
        # [loads g, token, pair e of a load]: g = Lp * R + 2 (t // 2) + p // 2, e = 2 (p % 2) + t % 2 for B's pair
        # q = 4 Lp + p + 16 t (R = k_units chunks t of 4 pairs p a thread, lanes Lp), so that a load's registers are
        # (t even, p), (t odd, p), (t even, p + 1), (t odd, p + 1): an mma's two B registers are pairs q and q + 16
        pairs = gl.DistributedLinearLayout(
            [[0, 0, 1], [0, 0, 2], [1, 0, 0]] + [[u, 0, 0] for u in units[1:]],
            [[k_units, 0, 0], [2 * k_units, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            [[0, 0, 0]] * (num_warps.bit_length() - 1),
            [],
            [bk // 8, 8, 4],
        )
    # STAGED [BM, 4 groups]: a K step's scale codes of each row (4 lanes x groups, as they lie), per thread one row's
    # (one cp.async of 8 or 4 bytes; the 4 lanes of a row copy the same bytes), rows as SCALES'
    cols = 4 * groups
    staged = gl.DistributedLinearLayout(
        [[0, 1 << i] for i in range(cols.bit_length() - 1)] + [[8, 0]],
        [[0, 0], [0, 0]] + row_lanes,
        warps,
        [],
        [bm, cols],
    )
    return {
        "MMA": mma,
        "A": a,
        "B": b,
        "WORDS": words,
        "LOADS": loads,
        "SCALES": scales,
        "STAGED": staged,
        "PAIRS": pairs,
        "BK": bk,
    }


@gluon.jit
def _weights(
    words, codes, FORMAT: gl.constexpr, A: gl.constexpr, WORDS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr
):
    """Packed words [BM, BK / 8] int32 (WORDS) and the block scale codes of their lanes' groups ([BM, groups, 4]
    int32, SCALES) -> the A operand [BM, BK] bf16: the values * scale * 2^-64, each word's 8 columns in the order
    0, 4, 1, 5, 2, 6, 3, 7."""
    if FORMAT == 1:  # two codes a load (`_layouts`): each one's multiplier in both halves of a pair
        both = gl.inline_asm_elementwise(_NVFP4_MULT_2, "=r,r", [codes], dtype=gl.int32, is_pure=True, pack=1)
        even = gl.inline_asm_elementwise(_LOW_HALVES, "=r,r", [both], dtype=gl.int32, is_pure=True, pack=1)
        odd = gl.inline_asm_elementwise(_HIGH_HALVES, "=r,r", [both], dtype=gl.int32, is_pure=True, pack=1)
        mult = gl.reshape(gl.permute(gl.join(even, odd), [0, 1, 3, 2]), [BM, BK // 64, 4])
        # a lane's words r of its K step: its group r // 2
        mult = gl.reshape(gl.permute(gl.join(mult, mult), [0, 1, 3, 2]), [BM, BK // 32, 4])
    else:
        mult = gl.inline_asm_elementwise(_MXFP4_MULT, "=r,r", [codes], dtype=gl.int32, is_pure=True, pack=1)
        mult = gl.join(mult, mult)
        mult = gl.reshape(gl.permute(gl.join(mult, mult), [0, 1, 3, 4, 2]), [BM, BK // 32, 4])
    mult = gl.convert_layout(gl.reshape(mult, [BM, BK // 8]), WORDS, assert_trivial=True)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        _DECODE, "=r,=r,=r,=r,r,r", [words, mult], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1
    )
    pairs = gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [BM, BK // 8, 4])
    halves = gl.inline_asm_elementwise(
        _HALVES, "=r,r,r", [gl.join(pairs, pairs)], dtype=gl.bfloat16, is_pure=True, pack=2
    )
    return gl.convert_layout(gl.reshape(halves, [BM, BK]), A, assert_trivial=True)


@gluon.jit
def _a_order(raw, WORDS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr):
    """A K step's words as they lie ([BM, BK / 8] int32, LOADS: [BM, lane, R]) -> [BM, R, lane], A's order (WORDS,
    word c = lane + 4 * register)."""
    R: gl.constexpr = BK // 32
    words = gl.reshape(gl.permute(gl.reshape(raw, [BM, 4, R]), [0, 2, 1]), [BM, BK // 8])
    return gl.convert_layout(words, WORDS, assert_trivial=True)


@gluon.jit
def _weight_loads(
    w_ptrs,
    s_ptrs,
    step,
    WORDS: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    GW: gl.constexpr,
    STRIDE: gl.constexpr,
):
    """K step `step` of each warp's slice: its words [BM, BK / 8] int32 in A's order (WORDS) and scale codes
    (SCALES); STRIDE: K steps between a slice's steps (`_weight_ptrs`)."""
    raw = gl.load(w_ptrs + step * (STRIDE * BK // 8))
    code_ptrs = s_ptrs + step * (STRIDE * BK // (8 * GW))
    if GW == 2:  # NVFP4: two codes a load (`_layouts`)
        codes = gl.load(code_ptrs.to(gl.pointer_type(gl.uint16))).to(gl.int32)
    else:
        codes = gl.load(code_ptrs).to(gl.int32)
    return _a_order(raw, WORDS, BM, BK), codes


@gluon.jit
def _staged_loads(staged, WORDS: gl.constexpr, LOADS: gl.constexpr, SCALES: gl.constexpr, BK: gl.constexpr):
    """`_weight_loads` of a K step from its copy in shared memory (`_weight_ptrs`, PREFETCH 0: `staged`, the step's
    words [BM, BK / 8] int32 and scale codes [BM, 4 G] uint8)."""
    w_smem, s_smem = staged
    BM: gl.constexpr = w_smem.shape[0]
    L: gl.constexpr = SCALES.shape[1]  # loads per lane
    if L * 4 == s_smem.shape[1]:
        codes = s_smem.reshape([BM, 4, L]).permute([0, 2, 1]).load(SCALES).to(gl.int32)
    else:  # two codes a load (`_layouts`)
        pairs = s_smem._reinterpret(gl.uint16, [BM, 4 * L], s_smem.layout)
        codes = pairs.reshape([BM, 4, L]).permute([0, 2, 1]).load(SCALES).to(gl.int32)
    return _a_order(w_smem.load(LOADS), WORDS, BM, BK), codes


@gluon.jit
def _weight_ptrs(
    w_ptr,
    s_ptr,
    prow,
    srow,
    FORMAT: gl.constexpr,
    MMA: gl.constexpr,
    WORDS: gl.constexpr,
    LOADS: gl.constexpr,
    SCALES: gl.constexpr,
    STAGED: gl.constexpr,
    BK: gl.constexpr,
    STEPS: gl.constexpr,
    PREFETCH: gl.constexpr,
    INTERLEAVE: gl.constexpr,
    SPLIT: gl.constexpr = 1,
    split=0,
):
    """The word and scale pointers of 16 rows of the matrix W [rows, K] at `w_ptr` (int32 words; the rows `prow`
    [BM] in LOADS' row slice, `srow` in SCALES', each warp's 16 the same; K = SPLIT * STEPS * num_warps * BK, the
    columns of share `split` < SPLIT the program's) and its block scale codes at `s_ptr` (uint8), at each warp's K
    slice of its share, and the loads of the slice's first K steps (`_dots`):
    PREFETCH of them into registers, or where PREFETCH is 0 all STEPS of them copied into shared memory (cp.async,
    one commit group: a step's [BM, BK / 8] int32 words, each thread's own as LOADS reads them, and [BM, 4 G] uint8
    scale codes). They are issued here, so that they are in flight while the caller finds its tokens (and, in the
    down kernel, while it waits for h).

    Slices: contiguous (warp w runs the steps w * STEPS ..) or interleaved (INTERLEAVE: warp w runs the steps w,
    w + W, ..: the warps' loads of a step lie side by side in each row, W * BK / 2 bytes).

    Word c of a K step (c = lane + 4 * register, A's order) is the step's word p = (c % 4) * R + c // 4 (R = BK /
    32 words per lane): a lane's words are contiguous (one vector load) and share scale blocks. Row and slice starts
    are whole K steps: 16-byte aligned words."""
    BM: gl.constexpr = MMA.warps_per_cta[0] * 16
    W: gl.constexpr = MMA.warps_per_cta[0]
    R: gl.constexpr = BK // 32
    GW: gl.constexpr = 2 if FORMAT == 1 else 4  # words per scale block: NVFP4 16 columns, MXFP4 32
    G: gl.constexpr = R // GW
    START: gl.constexpr = 1 if INTERLEAVE else STEPS  # warp 1's first K step
    STRIDE: gl.constexpr = W if INTERLEAVE else 1  # K steps between a slice's steps
    SHARE: gl.constexpr = STEPS * W * BK  # columns of a split's share
    w_ptr += split * (SHARE // 8)
    s_ptr += split * (SHARE // (8 * GW))
    vr = gl.arange(0, BM, layout=gl.SliceLayout(1, LOADS))
    p = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, LOADS))
    w_ptrs = w_ptr + (prow * (SPLIT * SHARE // 8) + (vr // 16) * (START * (BK // 8)))[:, None] + p[None, :]
    vs = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCALES)))
    L: gl.constexpr = SCALES.shape[1]  # loads per lane: G, or G / 2 of two codes each
    gi = gl.arange(0, L, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCALES))) * (G // L)
    lane = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))
    s_row = srow * (SPLIT * SHARE // (8 * GW)) + (vs // 16) * (START * BK // (8 * GW))
    s_ptrs = s_ptr + s_row[:, None, None] + (lane[None, None, :] * G + gi[None, :, None])
    if PREFETCH == 0:
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # row-major
        # a K step's codes of a row lie together, 4 G bytes: one copy a row (SCALES reads them lane by lane)
        row_codes = gl.convert_layout(s_row, gl.SliceLayout(1, STAGED), assert_trivial=True)
        c = gl.arange(0, 4 * G, layout=gl.SliceLayout(0, STAGED))
        t_ptrs = s_ptr + row_codes[:, None] + c[None, :]
        # a buffer per K step, not one indexed by step: Triton's barrier analysis would see each step's copy write
        # where the previous one did, and sync the program's warps between them
        loads = ()
        for step in gl.static_range(STEPS):
            w_smem = gl.allocate_shared_memory(gl.int32, [BM, BK // 8], flat)
            s_smem = gl.allocate_shared_memory(gl.uint8, [BM, 4 * G], flat)
            async_copy.async_copy_global_to_shared(w_smem, w_ptrs + step * (STRIDE * BK // 8))
            async_copy.async_copy_global_to_shared(s_smem, t_ptrs + step * (STRIDE * BK // (8 * GW)))
            loads = loads + ((w_smem, s_smem),)  # type: ignore[assignment]
        async_copy.commit_group()
    else:
        # the first steps' loads (a slice of one step: the step-1 loads repeat step 0's, unused)
        loads = ()
        for step in gl.static_range(PREFETCH):
            # a tuple one step longer each (unrolled) iteration: Triton builds it at compile time; mypy types it fixed
            loads = loads + (_weight_loads(w_ptrs, s_ptrs, min(step, STEPS - 1), WORDS, BM, BK, GW, STRIDE),)  # type: ignore[assignment]
    return w_ptrs, s_ptrs, loads


@gluon.jit
def _dots(
    weights,
    x_rows,
    FORMAT: gl.constexpr,
    MMA: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    WORDS: gl.constexpr,
    LOADS: gl.constexpr,
    SCALES: gl.constexpr,
    PAIRS: gl.constexpr,
    BK: gl.constexpr,
    STEPS: gl.constexpr,
    PREFETCH: gl.constexpr,
    INTERLEAVE: gl.constexpr,
    UNROLL: gl.constexpr,
):
    """[16, 8] float32: sum_k W[row, k] * x[n, k] * 2^-64 (without NVFP4's tensor scale) for the 16 rows of
    `weights` (`_weight_ptrs`: pointers and the first steps' loads); `x_rows` [8] the tokens' activation rows
    (bf16, PAIRS' column slice).

    Each warp runs K / num_warps columns (its slice, the warp index from %tid.x: the B operand, which the layout
    holds the same in every warp, is loaded per warp from the warp's slice) and the slices' [16, 8] sums are added
    at the end: at batch 1 a layer has too few 16-row blocks (gate/up 8 x 96) to give every scheduler of 132 SMs
    warps enough, and a warp's steps wait on memory one after the other.

    The activations follow the words' order (`_weight_ptrs`: loads of 8 columns at 8 p). Loads are not masked: the
    caller's rows and tokens are valid ones, and the last step loads itself again as its next. PREFETCH 0: the
    slice's weights are all in shared memory once their copies land (`_weight_ptrs`), the steps unrolled; PREFETCH 1
    or 2: software-pipelined by hand, a step issues the weight loads of the step PREFETCH ahead before its own
    decode; UNROLL (PREFETCH 1, even STEPS): the loop unrolled by two, its two steps' registers in turn, so the back
    edge moves none (14 of the ~232 instructions a step at sm_90), and its last two steps peeled, so that nothing
    loads past the slice (the rolled loop's last step loads itself again). The activations load at their step: L1
    hits after the first program's, they need no registers ahead (measured: ahead with the weights, as before, no
    faster at batch 1 and 3-13% slower at batch 4; h ahead in the down kernel alone, no faster at batch 1)."""
    BM: gl.constexpr = MMA.warps_per_cta[0] * 16
    W: gl.constexpr = MMA.warps_per_cta[0]
    GW: gl.constexpr = 2 if FORMAT == 1 else 4
    R: gl.constexpr = BK // 32
    START: gl.constexpr = 1 if INTERLEAVE else STEPS
    STRIDE: gl.constexpr = W if INTERLEAVE else 1
    w_ptrs, s_ptrs, loads = weights
    # the warp's slice of the activations, from %tid.x (B holds the same elements in every warp, loaded per warp)
    warp = (
        gl.inline_asm_elementwise(
            _THREAD, "=r,r", [gl.full([8], 0, gl.int32, _tokens(PAIRS))], dtype=gl.int32, is_pure=True, pack=1
        )
        // 32
    )
    x_pairs = x_rows.to(gl.pointer_type(gl.int32)) + gl.multiple_of(warp * (START * BK // 2), BK // 2)
    if len(PAIRS.shape) == 3:  # stored in mma order (`_layouts`): load g's 4 pairs at 4 g
        g = gl.arange(0, BK // 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, PAIRS)))
        e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PAIRS)))
        x_ptrs = x_pairs[None, :, None] + (g * 4)[:, None, None] + e[None, None, :]
    else:
        q = gl.arange(0, BK // 2, layout=gl.SliceLayout(1, PAIRS))  # pair q: columns 2q, 2q + 1 of A's order
        cb = q // 4
        x_ptrs = x_pairs[None, :] + (((cb % 4) * R + cb // 4) * 4 + q % 4)[:, None]
    acc = gl.full([BM, 8], 0.0, gl.float32, MMA)
    if PREFETCH == 0:
        async_copy.wait_group(0)
        gl.thread_barrier()  # a row's scale codes: copied by each of its lanes, or by one where Triton dedups
        for step in gl.static_range(STEPS):
            words, codes = _staged_loads(loads[step], WORDS, LOADS, SCALES, BK)
            x = gl.load(x_ptrs + step * (STRIDE * BK // 2))
            acc = mma_v2(_weights(words, codes, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
    elif UNROLL and PREFETCH == 1 and STEPS % 2 == 0:
        words, codes = loads[0]
        for step in range(0, STEPS - 2, 2):
            words_b, codes_b = _weight_loads(w_ptrs, s_ptrs, step + 1, WORDS, BM, BK, GW, STRIDE)
            x = gl.load(x_ptrs + step * (STRIDE * BK // 2))
            acc = mma_v2(_weights(words, codes, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
            words, codes = _weight_loads(w_ptrs, s_ptrs, step + 2, WORDS, BM, BK, GW, STRIDE)
            x = gl.load(x_ptrs + (step + 1) * (STRIDE * BK // 2))
            acc = mma_v2(_weights(words_b, codes_b, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
        # the last two steps, peeled: nothing left to load ahead
        words_b, codes_b = _weight_loads(w_ptrs, s_ptrs, STEPS - 1, WORDS, BM, BK, GW, STRIDE)
        x = gl.load(x_ptrs + (STEPS - 2) * (STRIDE * BK // 2))
        acc = mma_v2(_weights(words, codes, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
        x = gl.load(x_ptrs + (STEPS - 1) * (STRIDE * BK // 2))
        acc = mma_v2(_weights(words_b, codes_b, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
    else:
        words, codes = loads[0]
        if PREFETCH == 2:
            words_1, codes_1 = loads[1]
        for step in range(STEPS):
            ahead = gl.minimum(step + PREFETCH, STEPS - 1)
            next_words, next_codes = _weight_loads(w_ptrs, s_ptrs, ahead, WORDS, BM, BK, GW, STRIDE)
            x = gl.load(x_ptrs + step * (STRIDE * BK // 2))
            acc = mma_v2(_weights(words, codes, FORMAT, A, WORDS, BM, BK), _activations(x, B, BK), acc)
            if PREFETCH == 2:
                words, codes, words_1, codes_1 = words_1, codes_1, next_words, next_codes
            else:
                words, codes = next_words, next_codes
    return gl.sum(gl.reshape(acc, [W, 16, 8]), axis=0)


@gluon.jit
def _activations(x, B: gl.constexpr, BK: gl.constexpr):
    """Activations as loaded, bf16 pairs [BK / 2, 8] int32 (PAIRS: each thread's 8 consecutive columns of a token
    in 4 registers, permuted here) or [BK / 8, 8, 4] (PAIRS in mma order: already in the decode's, only renamed)
    -> the B operand [BK, 8] bf16 in the decode's column order."""
    if len(x.shape) == 3:
        # [g, token, e] -> [Lp, t // 2, p // 2, p % 2, t % 2, token] -> B's pairs q = 16 t + 4 Lp + p
        R: gl.constexpr = BK // 32
        x = gl.reshape(gl.permute(x, [0, 2, 1]), [4, R // 2, 2, 2, 2, 8])
        x = gl.reshape(gl.permute(x, [1, 4, 0, 2, 3, 5]), [BK // 2, 8])
    else:
        x = gl.inline_asm_elementwise(_PERMUTE, "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.int32, is_pure=True, pack=4)
    halves = gl.inline_asm_elementwise(_HALVES, "=r,r,r", [gl.join(x, x)], dtype=gl.bfloat16, is_pure=True, pack=2)
    return gl.convert_layout(gl.reshape(gl.permute(halves, [0, 2, 1]), [BK, 8]), B, assert_trivial=True)


@gluon.constexpr_function
def _tokens(pairs):
    """The token dimension's slice of a PAIRS layout (`_layouts`: dim 1 of [BK / 2, 8] or [BK / 8, 8, 4])."""
    if len(pairs.shape) == 3:
        return gl.SliceLayout(0, gl.SliceLayout(2, pairs))
    return gl.SliceLayout(0, pairs)


@gluon.jit
def _mma_order_column(n, UNITS: gl.constexpr):
    """Where column n of an activation row lies when stored in mma order for K steps of BK = 32 * UNITS columns
    (`_layouts`' PAIRS, `mma_order`). Within each BK columns, column j of the 8 a thread loads as its chunk (Lp, t)
    (chunk Lp * UNITS + t) joins column j + 4 in the decode's pair p = j % 4, and that pair lies at load
    g = Lp * UNITS + 2 (t // 2) + p // 2, place e = 2 (p % 2) + t % 2."""
    BK: gl.constexpr = 32 * UNITS
    c = n % BK
    chunk = c // 8
    p = c % 4
    t = chunk % UNITS
    g = (chunk // UNITS) * UNITS + 2 * (t // 2) + p // 2
    return n - c + 2 * (4 * g + 2 * (p % 2) + t % 2) + (c % 8) // 4


@gluon.jit
def _gate_up_rows(pid_n, N, LAYOUT: gl.constexpr, BM: gl.constexpr):
    """The gate_up [2 N, K] rows of program pid_n's 16 rows, for each of the BM operand rows (LAYOUT: a row slice;
    row r is row r % 16 at K slice r // 16): 8 gate rows n0 .. n0 + 7, then the same 8 up rows; n past N reads row
    N - 1 (its outputs are not stored)."""
    r = gl.arange(0, BM, layout=LAYOUT) % 16
    n = gl.minimum(pid_n * 8 + r % 8, N - 1)
    return n + (r // 8) * N


@gluon.jit
def _gate_up_fp4_mma_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    top_k,
    stride_xm,
    stride_we,
    stride_hm,
    gate_up_scale_off,
    tensor_scale_off,
    FORMAT: gl.constexpr,
    HAS_TENSOR_SCALE: gl.constexpr,
    BLOCK_SIZE_M: gl.constexpr,
    MMA: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    WORDS: gl.constexpr,
    LOADS: gl.constexpr,
    SCALES: gl.constexpr,
    STAGED: gl.constexpr,
    PAIRS: gl.constexpr,
    BK: gl.constexpr,
    STEPS: gl.constexpr,
    PREFETCH: gl.constexpr,
    INTERLEAVE: gl.constexpr,
    PDL: gl.constexpr,
    UNROLL: gl.constexpr,
    H_UNITS: gl.constexpr,
):
    """h[row, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n]) for the real rows of M tile pid_m, n in the
    program's 8: gate_up [2 N, K] at byte 0 of the expert (K = STEPS * num_warps * BK), its scales at
    `gate_up_scale_off`, NVFP4's float32 tensor scales (gate, up) at `tensor_scale_off`. h's columns are stored in
    the down kernel's mma order for its K steps of 32 * H_UNITS columns (`_mma_order_column`).

    The weights' first loads are issued before the tokens are looked up, and a tile's first 8 rows are run without
    counting its real rows (`align_pairs` puts a tile's pairs first, so its first row is always one): neither
    waits on the other's round trip to memory. PDL: the down kernel may launch as soon as every program has
    started (`griddepcontrol.launch_dependents`), so that its weights load while this kernel runs."""
    if PDL:
        gl.inline_asm_elementwise(_LAUNCH_DEPENDENTS, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    BM: gl.constexpr = MMA.warps_per_cta[0] * 16
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert = gl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        base = w_ptr + expert.to(gl.int64) * stride_we
        weights = _weight_ptrs(
            base.to(gl.pointer_type(gl.int32)), base + gate_up_scale_off,
            _gate_up_rows(pid_n, N, gl.SliceLayout(1, LOADS), BM),
            _gate_up_rows(pid_n, N, gl.SliceLayout(1, gl.SliceLayout(2, SCALES)), BM),
            FORMAT, MMA, WORDS, LOADS, SCALES, STAGED, BK, STEPS, PREFETCH, INTERLEAVE,
        )  # fmt: skip
        # what the epilogue reads is loaded before the dots, not after them: no round trip to memory at the end
        if HAS_TENSOR_SCALE:
            ts_ptr = (base + tensor_scale_off).to(gl.pointer_type(gl.float32))
            gate_scale = gl.load(ts_ptr)
            up_scale = gl.load(ts_ptr + 1)
        tok = gl.arange(0, 8, layout=_tokens(PAIRS))
        dtype: gl.constexpr = h_ptr.dtype.element_ty
        for i0 in gl.static_range(0, BLOCK_SIZE_M, 8):  # the tile's rows that hold a pair, 8 at a time
            if i0 == 0 or gl.load(sorted_pair_ptr + pid_m * BLOCK_SIZE_M + i0) < num_pairs:
                pair = gl.load(sorted_pair_ptr + pid_m * BLOCK_SIZE_M + i0 + tok)
                real_rows = pair < num_pairs
                # padding rows (holding `num_pairs`) read token 0, valid memory; their outputs are not stored
                pair = gl.where(real_rows, pair, 0)
                acc = _dots(
                    weights, x_ptr + (pair // top_k) * stride_xm,
                    FORMAT, MMA, A, B, WORDS, LOADS, SCALES, PAIRS, BK, STEPS, PREFETCH, INTERLEAVE, UNROLL,
                )  # fmt: skip
                acc = acc * _UNSCALE
                # [16, 8] -> [gate/up, 8 rows, 8 tokens] -> gate, up [8, 8]
                gate, up = gl.split(gl.permute(gl.reshape(acc, [2, 8, 8]), [1, 2, 0]))
                if HAS_TENSOR_SCALE:
                    gate = gate * gate_scale
                    up = up * up_scale
                g = gate.to(dtype).to(gl.float32)
                act = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
                h = act * up.to(dtype).to(gl.float32)
                hn = pid_n * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, h.type.layout))
                rows = pid_m * BLOCK_SIZE_M + i0 + gl.arange(0, 8, layout=gl.SliceLayout(0, h.type.layout))
                real = gl.convert_layout(real_rows, gl.SliceLayout(0, h.type.layout))
                mask = (hn[:, None] < N) & real[None, :]
                h_cols = _mma_order_column(hn, H_UNITS)
                gl.store(h_ptr + rows[None, :] * stride_hm + h_cols[:, None], h.to(dtype), mask=mask)


@gluon.jit
def _down_fp4_mma_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weight_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    num_pairs,
    K,
    stride_hm,
    stride_we,
    stride_om,
    down_off,
    down_scale_off,
    tensor_scale_off,
    FORMAT: gl.constexpr,
    HAS_TENSOR_SCALE: gl.constexpr,
    BLOCK_SIZE_M: gl.constexpr,
    MMA: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    WORDS: gl.constexpr,
    LOADS: gl.constexpr,
    SCALES: gl.constexpr,
    STAGED: gl.constexpr,
    PAIRS: gl.constexpr,
    BK: gl.constexpr,
    STEPS: gl.constexpr,
    PREFETCH: gl.constexpr,
    INTERLEAVE: gl.constexpr,
    PDL: gl.constexpr,
    UNROLL: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """out[pair * SPLIT + s, kk] = weight[pair] * (h[row] . down[e, kk]) over the columns of split s =
    program_id(2) (N / SPLIT of them) for the real rows of M tile pid_m, kk in the program's 16 rows of hidden K:
    down [K, N] at `down_off` (N = SPLIT * STEPS * num_warps * BK), its scales at `down_scale_off`, NVFP4's float32
    tensor scale at `tensor_scale_off` + 8 bytes. Loads ordered as the gate/up kernel's.

    PDL (launched as a programmatic dependent of the gate/up kernel, sm_90+): everything that does not read h (the
    tile's expert, the weights' first loads: all of them at PREFETCH 0) runs before `griddepcontrol.wait`, which
    returns once the gate/up kernel has finished and its writes are visible."""
    BM: gl.constexpr = MMA.warps_per_cta[0] * 16
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert = gl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        base = w_ptr + expert.to(gl.int64) * stride_we
        wr = gl.minimum(pid_n * 16 + gl.arange(0, BM, layout=gl.SliceLayout(1, LOADS)) % 16, K - 1)
        sr = gl.minimum(pid_n * 16 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCALES))) % 16, K - 1)
        pid_s = gl.program_id(2)
        SLICE: gl.constexpr = STEPS * MMA.warps_per_cta[0] * BK  # columns of a split
        weights = _weight_ptrs(
            (base + down_off).to(gl.pointer_type(gl.int32)), base + down_scale_off, wr, sr,
            FORMAT, MMA, WORDS, LOADS, SCALES, STAGED, BK, STEPS, PREFETCH, INTERLEAVE, SPLIT, pid_s,
        )  # fmt: skip
        # what the epilogue reads (align_pairs' and the router's outputs, not the gate/up kernel's) is loaded before
        # the wait and the dots, not after them: no round trip to memory at the end
        if HAS_TENSOR_SCALE:
            tensor_scale = gl.load((base + tensor_scale_off).to(gl.pointer_type(gl.float32)) + 2)
        row = gl.arange(0, 8, layout=_tokens(PAIRS))
        pairs = ()
        for i0 in gl.static_range(0, BLOCK_SIZE_M, 8):
            rows_pair = gl.load(sorted_pair_ptr + pid_m * BLOCK_SIZE_M + i0 + row)
            rows_routing = gl.load(weight_ptr + rows_pair, mask=rows_pair < num_pairs, other=0.0)
            pairs = pairs + ((rows_pair, rows_routing),)  # type: ignore[assignment]
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        if PDL:
            gl.inline_asm_elementwise(_WAIT_PRIMARY, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        for i0 in gl.static_range(0, BLOCK_SIZE_M, 8):  # the tile's rows that hold a pair, 8 at a time
            tile_pairs, tile_routing = pairs[i0 // 8]  # type: ignore[var-annotated]
            if i0 == 0 or gl.load(sorted_pair_ptr + pid_m * BLOCK_SIZE_M + i0) < num_pairs:
                # padding columns read the tile's first row (always real, `align_pairs`): the lines the real rows
                # read, where their own rows would be 8x the bytes from L2 at batch 1
                h_row = gl.where(tile_pairs < num_pairs, pid_m * BLOCK_SIZE_M + i0 + row, pid_m * BLOCK_SIZE_M)
                h_rows = h_ptr + h_row * stride_hm + pid_s * SLICE
                acc = _dots(
                    weights, h_rows, FORMAT, MMA, A, B, WORDS, LOADS, SCALES, PAIRS, BK, STEPS, PREFETCH, INTERLEAVE,
                    UNROLL,
                )  # fmt: skip
                acc = acc * _UNSCALE
                if HAS_TENSOR_SCALE:
                    acc = acc * tensor_scale
                o_r = pid_n * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, acc.type.layout))
                pair = gl.convert_layout(tile_pairs, gl.SliceLayout(0, acc.type.layout))
                routing = gl.convert_layout(tile_routing, gl.SliceLayout(0, acc.type.layout)).to(gl.float32)
                real = pair < num_pairs
                out = acc.to(dtype).to(gl.float32) * routing[None, :]  # rounded like the reference
                mask = (o_r[:, None] < K) & real[None, :]
                gl.store(out_ptr + (pair[None, :] * SPLIT + pid_s) * stride_om + o_r[:, None], out.to(dtype), mask=mask)


def fits(config: tuple[int, ...], num_in: int) -> bool:
    """Whether a kernel whose dots run over `num_in` columns can take `config` (an `Fp4MmaConfig` or a plain tuple
    of its fields): K steps of a power of two of 32-column units, at least 4 (a lane's words then hold whole
    scale blocks: one MXFP4 block, two NVFP4 ones, `_layouts`), and whole K steps in each warp's slice of each
    split."""
    config = Fp4MmaConfig(*config)
    k_units_ok = config.k_units >= 4 and config.k_units & (config.k_units - 1) == 0
    return k_units_ok and num_in % (32 * config.k_units * config.num_warps * config.split) == 0


def supported(layout: ExpertLayout, experts: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether these kernels can run `layout`'s experts in `experts` ([S, stride] uint8) on `hidden`: NVFP4 or
    MXFP4, CUDA tensors of sm_80+, bf16 activations, 16-byte aligned rows and sections (vector loads), each
    matrix's K (hidden, intermediate) a multiple of its kernel's warps' slices of whole K steps."""
    fmt = layout.format
    if fmt.name not in ("nvfp4", "mxfp4") or not experts.is_cuda or hidden.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(experts.device) < (8, 0):
        return False
    sec = layout.sections
    aligned = experts.stride(0) % 16 == 0 and experts.data_ptr() % 16 == 0 and sec["down"][0] % 16 == 0
    # the staged copies of block scales: 8 or 4 bytes a row and K step
    aligned = aligned and sec["gate_up_scale"][0] % 16 == 0 and sec["down_scale"][0] % 16 == 0
    return aligned and all(
        fits(gate_up, layout.hidden) and fits(down, layout.inter)
        for gate_up, down in (FP4_MMA_CONFIGS, FP4_MMA_STAGED_CONFIGS)
    )


def default_configs(num_pairs: int, hidden_size: int, inter: int) -> tuple[Fp4MmaConfig, Fp4MmaConfig]:
    """The (gate/up, down) `Fp4MmaConfig`s a call of `num_pairs` (token, expert) pairs over experts of these sizes
    runs when not told: FP4_MMA_SMALL_CONFIGS up to SMALL_UP_TO_PAIRS pairs where they fit the sizes,
    FP4_MMA_STAGED_CONFIGS from STAGED_FROM_PAIRS pairs on, else FP4_MMA_CONFIGS."""
    if num_pairs >= STAGED_FROM_PAIRS:
        return FP4_MMA_STAGED_CONFIGS
    small = FP4_MMA_SMALL_CONFIGS
    if num_pairs <= SMALL_UP_TO_PAIRS and fits(small[0], hidden_size) and fits(small[1], inter):
        return small
    return FP4_MMA_CONFIGS


def configs_for(
    configs: tuple[tuple[int, ...], tuple[int, ...]] | None, num_pairs: int, hidden_size: int, inter: int
) -> tuple[Fp4MmaConfig, Fp4MmaConfig]:
    """(gate/up, down) `Fp4MmaConfig`s from `configs` (plain tuples taken as the leading fields) or, where None,
    `default_configs`; the caller sizes `pairs` for the down config's split (`fp4_mma_tiles`).

    Raises:
        ValueError: a config that does not `fit` its matrix, or a gate/up config split over K (SwiGLU needs whole
            sums)."""
    if configs is None:
        return default_configs(num_pairs, hidden_size, inter)
    gate_up, down = (Fp4MmaConfig(*c) for c in configs)
    if gate_up.split != 1:
        raise ValueError(f"fp4_mma gate/up config {tuple(gate_up)}: only the down kernel splits K over programs")
    for config, num_in in ((gate_up, hidden_size), (down, inter)):
        if not fits(config, num_in):
            raise ValueError(
                f"fp4_mma config {tuple(config)} does not fit {num_in} columns: k_units must be a power of two, at "
                "least 4, and each warp's slice of each split whole K steps"
            )
    return gate_up, down


def _constexprs(config: Fp4MmaConfig, num_in: int, group_words: int, mma_order: bool = False) -> dict:
    """A kernel's layouts and tiling constants (and num_warps) for `config` over `num_in` columns (its split's
    share: STEPS per program), its activations stored in mma order or not (`_layouts`)."""
    return {
        **_layouts(config.k_units, config.num_warps, group_words, mma_order),
        "STEPS": num_in // (32 * config.k_units * config.num_warps * config.split),
        "PREFETCH": config.prefetch,
        "INTERLEAVE": INTERLEAVED_SLICES,
        "UNROLL": bool(config.unroll),
        "num_warps": config.num_warps,
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    }


def fp4_mma_tiles(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    layout: ExpertLayout,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
    h: torch.Tensor,
    pairs: torch.Tensor,
    configs: tuple[Fp4MmaConfig, Fp4MmaConfig],
) -> None:
    """One stage of `fused_moe_quant_tiles` through these kernels, as `fused_moe_gemv.gemv_tiles`: h[rows] then
    pairs[pair * split + s] of every real row of the tiles whose `block_expert` is >= 0, s < the down config's split
    (its programs' shares of the down dot, each rounded to `pairs`' dtype and times the routing weight, for
    `sum_pairs` over top_k * split rows a token). `supported(layout, experts, hidden)` must hold; `configs`: the
    (gate/up, down) kernels' `Fp4MmaConfig`s as `configs_for` returns them (checked there, not again per call).

    Raises:
        ValueError: `pairs` not [num_pairs * split, hidden] rows."""
    fmt = layout.format
    hidden_size, inter = layout.hidden, layout.inter
    sec = layout.sections
    num_pairs = weights.numel()
    tiles = block_expert.numel()
    fmt_id = 1 if fmt.name == "nvfp4" else 2
    group_words = 2 if fmt_id == 1 else 4
    gate_up_config, down_config = configs
    if pairs.shape != (num_pairs * down_config.split, hidden_size):
        raise ValueError(
            f"fp4_mma writes [{num_pairs} pairs x split {down_config.split}, {hidden_size}] pairs, not "
            f"{tuple(pairs.shape)}"
        )
    pdl = PROGRAMMATIC_LAUNCH and torch.cuda.get_device_capability(experts.device) >= (9, 0)
    common = {"FORMAT": fmt_id, "HAS_TENSOR_SCALE": fmt.tensor_scale, "BLOCK_SIZE_M": block_m, "PDL": pdl}
    # h is stored in the down kernel's mma order: its loads need no permute (`_activations`)
    gate_up = {**_constexprs(gate_up_config, hidden_size, group_words), "H_UNITS": down_config.k_units}
    down = _constexprs(down_config, inter, group_words, mma_order=True)
    _gate_up_fp4_mma_kernel[(tiles, -(-inter // 8))](
        hidden,
        experts,
        h,
        sorted_pairs,
        block_expert,
        num_pairs,
        inter,
        num_pairs // hidden.shape[0],
        hidden.stride(0),
        experts.stride(0),
        h.stride(0),
        sec["gate_up_scale"][0],
        sec["tensor_scale"][0],
        **common,
        **gate_up,
    )
    _down_fp4_mma_kernel[(tiles, -(-hidden_size // 16), down_config.split)](
        h,
        experts,
        pairs,
        weights,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden_size,
        h.stride(0),
        experts.stride(0),
        pairs.stride(0),
        sec["down"][0],
        sec["down_scale"][0],
        sec["tensor_scale"][0],
        **common,
        **down,
        SPLIT=down_config.split,
        launch_pdl=pdl,
    )
