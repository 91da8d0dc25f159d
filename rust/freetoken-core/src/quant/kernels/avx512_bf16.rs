//! AVX-512-BF16 kernels over quantized weights with bf16 activations: every weight is decoded in
//! registers to its exact bf16 value and multiplied by `vdpbf16ps` (32 products per instruction,
//! exact, summed in f32); the block multipliers scale f32 partial sums, never weights.
//!
//! - NVFP4 / MXFP4, chunks of 128 elements (64 weight bytes, one cache line of a row): the 64
//!   bytes are loaded as 32 words, each holding 4 elements as nibbles; the word shifted right by
//!   0, 4, 8 and 12 bits indexes a 32-entry bf16 table with `vpermw` (which reads the low 5 bits:
//!   the 16 e2m1 values twice, so the next nibble's low bit needs no mask). Vector `k` then holds
//!   the chunk's elements `4i + k`; the activations are permuted the same way once per call. An
//!   f32 lane of `vdpbf16ps` sums elements `8j + k` and `8j + 4 + k`, which share a block (16 or
//!   32 elements), so one vector of 16 multipliers per chunk and row (NVFP4: block `j / 2`, MXFP4:
//!   `j / 4`), expanded once per row block, scales the chunk's sum with one FMA. Per 64 weight
//!   bytes and row: 1 load, 3 shifts, 4 `vpermw`, 4 `vdpbf16ps` per token, 1 FMA per token.
//! - FP8: 32 e4m3 codes sign-extended to words; `((w << 4) & 0x07F0) + (120 << 7)` is the bf16 of
//!   every normal code's magnitude, a masked `vpermw` from an 8-entry table puts the subnormal
//!   ones in (exact; `vdpbf16ps` would flush bf16 subnormals, so they cannot be left shifted), a
//!   ternary-logic OR adds the sign. Each block's sum is multiplied once by its f32 scale.
//! - One driver for both ([`run`] over a [`Format`], monomorphised per format, rows and tokens):
//!   rows in blocks of 4 (2 from 3 tokens: registers), tokens in blocks of up to 4 inside each
//!   row block, so a row block's bytes come from memory once and from L1 for the later token
//!   blocks; the next row block is prefetched into L2 while this one streams. A format gives
//!   only its column groups (a 4-bit chunk, an FP8 block), their multipliers and their decode,
//!   dot products and scaling.
//! - Any shape the formats allow: a 4-bit row's last partial chunk and FP8's partial vectors (end
//!   of a block or of the row) are read with byte masks; masked weights and activations are zero.
//!
//! The multipliers are the reference's f32 values (NVFP4 `e4m3 · tensor_scale`, MXFP4 `2^(e8m0 -
//! 127)`, FP8 the f32 scale); the products are exact, so against the scalar reference on the same
//! (bf16) activations only the summation order differs. NaN weight codes are not special-cased.
// The row/token loops index several per-row and per-token arrays at once.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::super::{QMatrix, ScaleType};

/// Elements per 4-bit chunk (64 bytes).
const CHUNK: usize = 128;

/// e2m1 values as bf16, indexed by the low 5 bits of a word: the 16 codes twice.
static E2M1_BF16: [u16; 32] = {
    // bf16 of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (exact), then the same with the sign bit.
    let mags = [
        0x0000u16, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    ];
    let mut t = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = mags[i & 7] | if i & 8 != 0 { 0x8000 } else { 0 };
        i += 1;
    }
    t
};

/// bf16 of the e4m3 subnormal magnitudes `m · 2^-9`, indexed by `m` (entries 8.. unused).
static E4M3_SUBNORMAL_BF16: [u16; 32] = {
    let mut t = [0u16; 32];
    let mut m = 1;
    while m < 8 {
        // m · 2^-9 = 2^(p - 9) · (m / 2^p) with p the top bit of m: exponent field 118 + p.
        let p = 7 - (m as u8).leading_zeros() as usize;
        let frac = (m - (1 << p)) << (7 - p);
        t[m] = (((118 + p) << 7) | frac) as u16;
        m += 1;
    }
    t
};

/// Index vectors spreading 16 decoded multipliers over the lanes of the chunks they cover, by
/// multipliers per chunk (NVFP4: blocks of 16 elements, 8 per chunk; MXFP4: 32, 4 per chunk):
/// lane j of chunk c takes multiplier `per_chunk · c + j · per_chunk / 16`.
static SPREAD: [[[u32; 16]; 4]; 2] = {
    let mut t = [[[0u32; 16]; 4]; 2];
    let mut f = 0;
    while f < 2 {
        let per_chunk = if f == 0 { 8 } else { 4 };
        let mut c = 0;
        while c < 16 / per_chunk {
            let mut j = 0;
            while j < 16 {
                t[f][c][j] = (per_chunk * c + j * per_chunk / 16) as u32;
                j += 1;
            }
            c += 1;
        }
        f += 1;
    }
    t
};

/// One format's step, what the driver ([`run`]) leaves to it: a row's weights fall into column
/// groups, each served by one vector of multipliers per row (a 4-bit chunk of 128 elements, an
/// FP8 block's columns); the format gives the rows' multipliers, decodes a group of R rows, dots
/// it with T tokens and adds the scaled sums to the accumulators. The driver owns the row-block
/// and token-block loops, the prefetch, the accumulators and the output, monomorphised for each
/// format, R and T.
///
/// # Safety
/// For every method: rows `r..r + R` lie below `m.rows` and tokens `t0..t0 + T` below the call's
/// `n_tok` (the value was made for that call), `g < groups()`, and the CPU has the features of
/// [`gemv`].
trait Format {
    /// The matrix.
    fn matrix(&self) -> &QMatrix<'_>;
    /// Weight bytes per row.
    #[inline(always)]
    fn row_bytes(&self) -> usize {
        let m = self.matrix();
        m.cols * m.format.weight_bits() / 8
    }
    /// Weight bytes of a row that [`Self::dot`] reads with one load.
    const VECTOR_BYTES: usize;
    /// Weight bytes per column group (the row's last group may be narrower).
    fn group_width(&self) -> usize;
    /// Column groups per row.
    #[inline(always)]
    fn groups(&self) -> usize {
        self.row_bytes().div_ceil(self.group_width())
    }
    /// The groups `0..whole_groups()` are whole: as wide as the others and a whole number of the
    /// format's vectors, so their loads need no mask.
    #[inline(always)]
    fn whole_groups(&self) -> usize {
        if self.group_width().is_multiple_of(Self::VECTOR_BYTES) {
            self.row_bytes() / self.group_width()
        } else {
            0
        }
    }
    /// Group g's weight bytes in a row: `start..end`.
    #[inline(always)]
    fn group_bytes(&self, g: usize) -> (usize, usize) {
        let w = self.group_width();
        (g * w, ((g + 1) * w).min(self.row_bytes()))
    }
    /// Once per row block, before its token blocks: rows r..r+R (NVFP4/MXFP4: their multipliers).
    #[inline(always)]
    unsafe fn begin<const R: usize>(&mut self, _r: usize) {}
    /// Group g of rows r..r+R against tokens t0..t0+T, times the rows' multipliers `s` (from
    /// [`Self::scales`], lane by lane), added to `acc[row][token]`. `WHOLE`: `g < whole_groups()`.
    /// Each (row, token) sum is scaled as soon as it is complete, so only one is live at a time.
    unsafe fn dot<const R: usize, const T: usize, const WHOLE: bool>(
        &self,
        r: usize,
        g: usize,
        t0: usize,
        s: [__m512; R],
        acc: &mut [[__m512; T]; R],
    );
    /// Group g's multipliers of rows r..r+R (one vector a row).
    unsafe fn scales<const R: usize>(&self, r: usize, g: usize) -> [__m512; R];
}

/// What one call computes: rows `r0..r1` for tokens `0..n_tok`, into `out[t * ldo + r - r0]`.
#[derive(Clone, Copy)]
struct Job {
    r0: usize,
    r1: usize,
    n_tok: usize,
    out: *mut f32,
    ldo: usize,
}

/// The job: blocks of R rows (then single rows), each block's [`Format::begin`] once and its token
/// blocks of up to 4 served while its bytes are in L1; the next row block is prefetched while the
/// first token block streams this one. R is 4 up to 2 tokens, 2 from 3 (registers: accumulators,
/// activations).
///
/// # Safety
/// As [`Format`], for the job's rows and tokens; the job's `out` elements are writable.
#[inline(always)]
unsafe fn run<F: Format>(f: &mut F, job: Job) {
    /// [`run`] with R rows a block.
    #[inline(always)]
    unsafe fn blocks<F: Format, const R: usize>(f: &mut F, job: Job) {
        let Job {
            r0,
            r1,
            n_tok,
            out,
            ldo,
        } = job;
        // SAFETY: forwarded; row block r writes out[t * ldo + r - r0 ..].
        unsafe {
            let mut r = r0;
            while r + R <= r1 {
                let pf = r + 2 * R <= r1;
                block::<F, R>(f, r, n_tok, out.add(r - r0), ldo, pf);
                r += R;
            }
            while r < r1 {
                block::<F, 1>(f, r, n_tok, out.add(r - r0), ldo, false);
                r += 1;
            }
        }
    }
    // SAFETY: forwarded.
    unsafe {
        if job.n_tok <= 2 {
            blocks::<F, 4>(f, job)
        } else {
            blocks::<F, 2>(f, job)
        }
    }
}

/// Rows r..r+R for every token, into `out[t * ldo + k]`; `pf`: prefetch rows r+R..r+2R.
#[inline(always)]
unsafe fn block<F: Format, const R: usize>(
    f: &mut F,
    r: usize,
    n_tok: usize,
    out: *mut f32,
    ldo: usize,
    pf: bool,
) {
    // SAFETY: forwarded.
    unsafe {
        f.begin::<R>(r);
        let mut t0 = 0;
        while t0 < n_tok {
            let (o, pf) = (out.add(t0 * ldo), pf && t0 == 0);
            match n_tok - t0 {
                1 => rows::<F, R, 1>(f, r, t0, o, ldo, pf),
                2 => rows::<F, R, 2>(f, r, t0, o, ldo, pf),
                3 => rows::<F, R, 3>(f, r, t0, o, ldo, pf),
                _ => rows::<F, R, 4>(f, r, t0, o, ldo, pf),
            }
            t0 += 4;
        }
    }
}

/// Rows r..r+R, tokens t0..t0+T, into `out[t * ldo + k]`: per group, the format's sums times its
/// multipliers, summed over the groups.
#[inline(always)]
unsafe fn rows<F: Format, const R: usize, const T: usize>(
    f: &F,
    r: usize,
    t0: usize,
    out: *mut f32,
    ldo: usize,
    pf: bool,
) {
    let rb = f.row_bytes();
    // The first byte of row r + R (the next block), only ever prefetched.
    let next = f.matrix().weight.as_ptr().wrapping_add((r + R) * rb);
    // SAFETY: forwarded; prefetches read nothing.
    unsafe {
        /// Group g: its prefetch, then the format's step.
        #[inline(always)]
        unsafe fn group<F: Format, const R: usize, const T: usize, const WHOLE: bool>(
            f: &F,
            (r, g, t0): (usize, usize, usize),
            next: Option<*const u8>,
            acc: &mut [[__m512; T]; R],
        ) {
            // SAFETY: forwarded; prefetches read nothing.
            unsafe {
                if let Some(next) = next {
                    let rb = f.row_bytes();
                    let (start, end) = f.group_bytes(g);
                    let mut o = start.next_multiple_of(64);
                    while o < end {
                        for k in 0..R {
                            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(k * rb + o) as *const i8);
                        }
                        o += 64;
                    }
                }
                f.dot::<R, T, WHOLE>(r, g, t0, f.scales::<R>(r, g), acc)
            }
        }
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let next = pf.then_some(next);
        // Whole groups in a loop of their own, the partial one after it (as the loads are).
        let whole = f.whole_groups();
        for g in 0..whole {
            group::<F, R, T, true>(f, (r, g, t0), next, &mut acc);
        }
        for g in whole..f.groups() {
            group::<F, R, T, false>(f, (r, g, t0), next, &mut acc);
        }
        for k in 0..R {
            for t in 0..T {
                *out.add(t * ldo + k) = hsum(acc[k][t]);
            }
        }
    }
}

/// NVFP4 / MXFP4: the rows' block multipliers and the activations in the order the kernels read
/// them; a group is a chunk.
struct Fp4<'a> {
    m: &'a QMatrix<'a>,
    /// Chunks per row (the last may be partial).
    nch: usize,
    /// Activations `[n_tok, nch * CHUNK]` bf16, each chunk permuted (elements `4i + k` at
    /// `32k + i`), zero past `cols`.
    xp: Vec<u16>,
    /// `R` rows of `nch` (rounded up to 4) vectors of 16 lane multipliers.
    sc: Vec<f32>,
    /// Floats per row in `sc`.
    scs: usize,
}

/// See [`super::gemv`] with bf16 activations `x [n_tok, m.cols]`; any shape the format allows.
///
/// # Safety
/// The CPU has AVX-512F/BW and AVX512_BF16; `m`'s slices hold its weights and scales; `x` holds
/// `n_tok * m.cols` values; `out[t * ldo + r - r0]` is writable for `r0 <= r < r1 <= m.rows`,
/// `t < n_tok`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn gemv(
    m: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &[u16],
    n_tok: usize,
    out: *mut f32,
    ldo: usize,
) {
    if n_tok == 0 || r0 == r1 {
        return;
    }
    let job = Job {
        r0,
        r1,
        n_tok,
        out,
        ldo,
    };
    // SAFETY: the caller's; each path reads rows r0..r1 and tokens 0..n_tok only.
    unsafe {
        if m.format.weight_bits() == 8 {
            run(&mut Fp8::new(m, x), job)
        } else {
            run(&mut Fp4::new(m, x, n_tok), job)
        }
    }
}

/// The sum of a vector's 16 lanes.
#[inline(always)]
unsafe fn hsum(v: __m512) -> f32 {
    // SAFETY: register-only; the features are the caller's.
    unsafe { _mm512_reduce_add_ps(v) }
}

/// `acc + a · b` over 32 bf16 pairs.
#[inline(always)]
unsafe fn dp(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
    // SAFETY: register-only; the transmutes reinterpret 512 bits as 32 bf16 (same size).
    unsafe {
        _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512i, __m512bh>(a),
            std::mem::transmute::<__m512i, __m512bh>(b),
        )
    }
}

/// The low `n` bits set (`n <= 64`).
#[inline(always)]
fn low_bits(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

impl<'a> Fp4<'a> {
    /// Permutes the activations; `x` holds `n_tok * m.cols` values.
    #[inline(always)]
    unsafe fn new(m: &'a QMatrix<'a>, x: &[u16], n_tok: usize) -> Self {
        let cols = m.cols;
        let nch = cols.div_ceil(CHUNK);
        let ncp = nch * CHUNK;
        let mut xp = vec![0u16; n_tok * ncp];
        // Source word 4i + k of a 64-word pair of vectors to word i (i < 16).
        let idx: [__m512i; 4] = std::array::from_fn(|k| {
            let v: [u16; 32] = std::array::from_fn(|i| if i < 16 { (4 * i + k) as u16 } else { 0 });
            // SAFETY: reads the 64 bytes of `v`.
            unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) }
        });
        for t in 0..n_tok {
            let src = &x[t * cols..(t + 1) * cols];
            let dst = &mut xp[t * ncp..(t + 1) * ncp];
            let full = cols / CHUNK;
            for ch in 0..full {
                // SAFETY: chunk ch's 128 values lie in src (ch < cols / CHUNK) and dst.
                unsafe {
                    let s = src.as_ptr().add(ch * CHUNK);
                    let v: [__m512i; 4] =
                        std::array::from_fn(|q| _mm512_loadu_si512(s.add(32 * q) as *const _));
                    for (k, ik) in idx.iter().enumerate() {
                        let ab = _mm512_permutex2var_epi16(v[0], *ik, v[1]);
                        let cd = _mm512_permutex2var_epi16(v[2], *ik, v[3]);
                        // 128-bit lanes 0, 1 of ab then 0, 1 of cd: words i < 16 of each.
                        let o = _mm512_shuffle_i64x2::<0b01_00_01_00>(ab, cd);
                        _mm512_storeu_si512(dst.as_mut_ptr().add(ch * CHUNK + 32 * k) as *mut _, o);
                    }
                }
            }
            for c in full * CHUNK..cols {
                let (i, k) = ((c % CHUNK) / 4, c % 4);
                dst[full * CHUNK + 32 * k + i] = src[c];
            }
        }
        let scs = nch.next_multiple_of(4) * 16;
        Self {
            m,
            nch,
            xp,
            sc: vec![0f32; 4 * scs],
            scs,
        }
    }

    /// Row r's lane multipliers into row slot `k` of `sc`: 16 per chunk (see [`SPREAD`]).
    #[inline(always)]
    unsafe fn row_scales(&mut self, r: usize, k: usize) {
        // SAFETY: forwarded.
        unsafe {
            if self.m.format.scale_type() == ScaleType::E4m3 {
                self.row_scales_as::<true>(r, k)
            } else {
                self.row_scales_as::<false>(r, k)
            }
        }
    }

    /// [`Self::row_scales`] for e4m3 (NVFP4) or e8m0 (MXFP4) scale codes.
    #[inline(always)]
    unsafe fn row_scales_as<const E4M3: bool>(&mut self, r: usize, k: usize) {
        let m = self.m;
        let ng = m.format.scale_shape(m.rows, m.cols).1;
        // Chunks served by one 16-byte group of scale codes (8 or 4 blocks a chunk).
        let span = if E4M3 { 2 } else { 4 };
        // SAFETY: row r's ng scale bytes are inside m.scales (checked by `super::gemv`); the last
        // group's load is masked to them; the stores stay in slot k (nch rounded up to 4 vectors).
        unsafe {
            let idx: [__m512i; 4] = std::array::from_fn(|c| {
                _mm512_loadu_si512(SPREAD[if E4M3 { 0 } else { 1 }][c].as_ptr() as *const _)
            });
            let src = m.scales.as_ptr().add(r * ng);
            let dst = self.sc.as_mut_ptr().add(k * self.scs);
            let ts = _mm512_set1_ps(m.tensor_scale * 256.0);
            let mut g = 0;
            let mut ch = 0;
            while g < ng {
                let codes = if g + 16 <= ng {
                    _mm_loadu_si128(src.add(g) as *const __m128i)
                } else {
                    _mm512_castsi512_si128(_mm512_maskz_loadu_epi8(
                        low_bits(ng - g),
                        src.add(g) as *const i8,
                    ))
                };
                let mult = if E4M3 {
                    // s eeee mmm -> the half of value / 256 (exact), times tensor_scale · 256:
                    // the reference's e4m3 · tensor_scale.
                    let h = _mm256_and_si256(
                        _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(codes)),
                        _mm256_set1_epi16(0xBF80u16 as i16),
                    );
                    _mm512_mul_ps(_mm512_cvtph_ps(h), ts)
                } else {
                    // 2^(code - 127); code 0 is the subnormal 2^-127.
                    let c = _mm512_cvtepu8_epi32(codes);
                    _mm512_castsi512_ps(_mm512_max_epu32(
                        _mm512_slli_epi32::<23>(c),
                        _mm512_set1_epi32(0x0040_0000),
                    ))
                };
                for (c, ic) in idx.iter().enumerate().take(span) {
                    _mm512_storeu_ps(dst.add((ch + c) * 16), _mm512_permutexvar_ps(*ic, mult));
                }
                g += 16;
                ch += span;
            }
        }
    }
}

impl Format for Fp4<'_> {
    const VECTOR_BYTES: usize = 64;

    #[inline(always)]
    fn matrix(&self) -> &QMatrix<'_> {
        self.m
    }

    #[inline(always)]
    fn group_width(&self) -> usize {
        CHUNK / 2
    }

    #[inline(always)]
    unsafe fn begin<const R: usize>(&mut self, r: usize) {
        for k in 0..R {
            // SAFETY: row r + k < m.rows (the trait's contract), slot k < R <= 4.
            unsafe { self.row_scales(r + k, k) };
        }
    }

    /// Chunk g of rows r..r+R: its 64 bytes a row (the last chunk masked to the row) decoded to
    /// 4 vectors of bf16, each against the tokens' permuted activations.
    #[inline(always)]
    unsafe fn dot<const R: usize, const T: usize, const WHOLE: bool>(
        &self,
        r: usize,
        g: usize,
        t0: usize,
        s: [__m512; R],
        acc: &mut [[__m512; T]; R],
    ) {
        let rb = self.row_bytes();
        let ncp = self.nch * CHUNK;
        // SAFETY: rows r..r+R < m.rows, so bytes r * rb .. (r + R) * rb of the weights exist; a
        // full chunk reads 64 of them, the partial one is masked to the row; chunk g < nch of
        // tokens t0..t0+T lies in xp.
        unsafe {
            let lut = _mm512_loadu_si512(E2M1_BF16.as_ptr() as *const _);
            let w = self.m.weight.as_ptr().add(r * rb + 64 * g);
            let x = self.xp.as_ptr().add(t0 * ncp + g * CHUNK);
            // Every row's bytes loaded first: the loads are the long wait.
            let wv: [__m512i; R] = std::array::from_fn(|k| {
                if WHOLE {
                    _mm512_loadu_si512(w.add(k * rb) as *const _)
                } else {
                    _mm512_maskz_loadu_epi8(low_bits(rb - 64 * g), w.add(k * rb) as *const i8)
                }
            });
            for (k, &wk) in wv.iter().enumerate() {
                // Vector j: element 4i + j of the chunk in word i.
                let q = [
                    _mm512_permutexvar_epi16(wk, lut),
                    _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(wk), lut),
                    _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(wk), lut),
                    _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(wk), lut),
                ];
                for t in 0..T {
                    let xt = x.add(t * ncp);
                    let mut d = _mm512_setzero_ps();
                    for (j, qj) in q.iter().enumerate() {
                        d = dp(d, *qj, _mm512_loadu_si512(xt.add(32 * j) as *const _));
                    }
                    acc[k][t] = _mm512_fmadd_ps(d, s[k], acc[k][t]);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn scales<const R: usize>(&self, _r: usize, g: usize) -> [__m512; R] {
        // SAFETY: slots 0..R hold nch (rounded up to 4) vectors each (`begin`); g < nch.
        std::array::from_fn(|k| unsafe {
            _mm512_loadu_ps(self.sc.as_ptr().add(k * self.scs + g * 16))
        })
    }
}

/// 32 e4m3 codes (a `ymm`) -> their exact bf16 values.
#[inline(always)]
unsafe fn e4m3_bf16(codes: __m256i, sub: __m512i) -> __m512i {
    // SAFETY: register-only; the features are the caller's.
    unsafe {
        let w = _mm512_cvtepi8_epi16(codes);
        // s eeee mmm -> 0 (e + 120) mmm 0000: the bf16 of a normal code's magnitude.
        let norm = _mm512_add_epi16(
            _mm512_and_si512(_mm512_slli_epi16::<4>(w), _mm512_set1_epi16(0x07F0)),
            _mm512_set1_epi16(120 << 7),
        );
        // Exponent 0: m · 2^-9 from the table (vpermw reads bits 0-4: m, as bits 3-4 are 0).
        let subn = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x0078));
        let mag = _mm512_mask_permutexvar_epi16(norm, subn, w, sub);
        // mag | (w & 0x8000): the sign (bit 15 of the sign-extended code).
        _mm512_ternarylogic_epi32::<0xF8>(mag, w, _mm512_set1_epi16(0x8000u16 as i16))
    }
}

/// FP8 blocks: a group is a block's columns of a row (32 at a time, the last ones masked).
struct Fp8<'a> {
    m: &'a QMatrix<'a>,
    /// Activations `[n_tok, m.cols]` bf16.
    x: &'a [u16],
    /// Column blocks per row.
    ncb: usize,
}

impl<'a> Fp8<'a> {
    fn new(m: &'a QMatrix<'a>, x: &'a [u16]) -> Self {
        Self {
            m,
            x,
            ncb: m.cols.div_ceil(m.format.block().1),
        }
    }
}

impl Format for Fp8<'_> {
    const VECTOR_BYTES: usize = 32;

    #[inline(always)]
    fn matrix(&self) -> &QMatrix<'_> {
        self.m
    }

    /// A block's columns.
    #[inline(always)]
    fn group_width(&self) -> usize {
        self.m.format.block().1
    }

    /// Block g of rows r..r+R: 32 codes at a time to bf16, each against the tokens' activations.
    #[inline(always)]
    unsafe fn dot<const R: usize, const T: usize, const WHOLE: bool>(
        &self,
        r: usize,
        g: usize,
        t0: usize,
        s: [__m512; R],
        acc: &mut [[__m512; T]; R],
    ) {
        let cols = self.m.cols;
        let (start, end) = self.group_bytes(g);
        // SAFETY: rows r..r+R < m.rows and tokens t0..t0+T < n_tok (the trait's contract); every
        // load is masked to the block, which ends inside the row.
        unsafe {
            let sub = _mm512_loadu_si512(E4M3_SUBNORMAL_BF16.as_ptr() as *const _);
            let w = self.m.weight.as_ptr().add(r * cols);
            let xb = self.x.as_ptr().add(t0 * cols);
            let mut d = [[_mm512_setzero_ps(); T]; R];
            let mut c = start;
            while c < end {
                let n = (end - c).min(32);
                let (xs, wv): ([__m512i; T], [__m512i; R]) = if WHOLE || n == 32 {
                    (
                        std::array::from_fn(|t| {
                            _mm512_loadu_si512(xb.add(t * cols + c) as *const _)
                        }),
                        std::array::from_fn(|k| {
                            e4m3_bf16(
                                _mm256_loadu_si256(w.add(k * cols + c) as *const __m256i),
                                sub,
                            )
                        }),
                    )
                } else {
                    let mask = low_bits(n);
                    (
                        std::array::from_fn(|t| {
                            _mm512_maskz_loadu_epi16(
                                mask as u32,
                                xb.add(t * cols + c) as *const i16,
                            )
                        }),
                        std::array::from_fn(|k| {
                            let b = _mm512_maskz_loadu_epi8(mask, w.add(k * cols + c) as *const i8);
                            e4m3_bf16(_mm512_castsi512_si256(b), sub)
                        }),
                    )
                };
                for k in 0..R {
                    for t in 0..T {
                        d[k][t] = dp(d[k][t], wv[k], xs[t]);
                    }
                }
                c += 32;
            }
            for k in 0..R {
                for t in 0..T {
                    acc[k][t] = _mm512_fmadd_ps(d[k][t], s[k], acc[k][t]);
                }
            }
        }
    }

    /// Each row's f32 block scale, in every lane.
    #[inline(always)]
    unsafe fn scales<const R: usize>(&self, r: usize, g: usize) -> [__m512; R] {
        let br = self.m.format.block().0;
        // SAFETY: block (row (r + k) / br, column g) lies in the scale grid `super::gemv` checked.
        std::array::from_fn(|k| unsafe {
            let i = ((r + k) / br) * self.ncb + g;
            _mm512_set1_ps(std::ptr::read_unaligned(
                self.m.scales.as_ptr().add(4 * i) as *const f32
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::{e4m3_to_f32, E2M1_TABLE};
    use super::*;
    use crate::bf16::bf16_to_f32;

    #[test]
    fn tables_hold_the_exact_values() {
        for (i, &b) in E2M1_BF16.iter().enumerate() {
            assert_eq!(
                bf16_to_f32(b).to_bits(),
                E2M1_TABLE[i & 15].to_bits(),
                "e2m1 {i}"
            );
        }
        for m in 0..8u8 {
            assert_eq!(bf16_to_f32(E4M3_SUBNORMAL_BF16[m as usize]), e4m3_to_f32(m));
        }
    }

    #[test]
    fn e4m3_decoding_is_exact_for_every_code() {
        if !crate::cpu::Isa::Avx512Bf16.supported() {
            return;
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
        unsafe fn decode(codes: &[u8; 32]) -> [u16; 32] {
            let mut out = [0u16; 32];
            // SAFETY: 32 bytes read, 64 written; the features are checked by the caller.
            unsafe {
                let sub = _mm512_loadu_si512(E4M3_SUBNORMAL_BF16.as_ptr() as *const _);
                let v = e4m3_bf16(_mm256_loadu_si256(codes.as_ptr() as *const __m256i), sub);
                _mm512_storeu_si512(out.as_mut_ptr() as *mut _, v);
            }
            out
        }
        for base in (0..256).step_by(32) {
            let codes: [u8; 32] = std::array::from_fn(|i| (base + i) as u8);
            // SAFETY: AVX-512-BF16 checked above.
            let got = unsafe { decode(&codes) };
            for (c, g) in codes.iter().zip(got) {
                if c & 0x7F == 0x7F {
                    continue; // NaN codes are not special-cased
                }
                assert_eq!(
                    bf16_to_f32(g).to_bits(),
                    e4m3_to_f32(*c).to_bits(),
                    "code {c:#x}"
                );
            }
        }
    }
}
