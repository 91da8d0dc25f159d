//! Matrix-vector kernels over quantized weights, dequantized in registers:
//! `out[t, r] = Σ_c W[r, c] · x[t, c]` with `W` in FP8 block, NVFP4 or MXFP4 ([`super::QMatrix`]),
//! f32 accumulation; `x` in bf16 ([`Act::Bf16`]) or f32 ([`Act::F32`]), as the bf16 kernels take it
//! ([`crate::cpu::kernels`]): the paths that want bf16 ([`Isa::wants_bf16`]) get bf16 activations
//! from [`crate::cpu::CpuExperts`].
//!
//! Variants:
//! - scalar: the reference; each element dequantized as the format defines it
//!   ([`super::QMatrix::get`]), summed in column order, f32 activations (bf16 ones widened).
//! - AVX-512-BF16 ([`avx512_bf16`], bf16 activations on [`Isa::Avx512Bf16`] and [`Isa::AmxBf16`]):
//!   each weight decoded to its exact bf16 value, `vdpbf16ps`, block multipliers on f32 partial
//!   sums; every shape the formats allow.
//! - f32 activations: AVX-512F with 16 f32 lanes (taken for [`Isa::Avx512Bf16`] and
//!   [`Isa::AmxBf16`]; needs AVX-512F/BW) and AVX2 + FMA + F16C with 8: one generic body ([`simd`])
//!   over the lane width. bf16 activations on a path without AVX-512-BF16 are widened to f32.
//!
//! How the f32 SIMD paths stay bound by memory rather than by decoding (each weight byte is read once
//! per call and decoded with a handful of register instructions; the scales are decoded once per
//! row, never per element through a lookup call):
//! - FP8: an e4m3 code sign-extended to 16 bits and shifted left by 7 is the IEEE half of
//!   `value / 256` (exponent field 4 bits into 5, bias 7 against 15; e4m3 subnormals land on half
//!   subnormals, so they are exact too), widened with `vcvtph2ps`. Each 128-column block's sum is
//!   multiplied once by `scale · 256`.
//! - NVFP4 / MXFP4: the bytes of a chunk of `2 · lanes` elements are zero-extended to one lane
//!   each; the low nibble indexes the 16-entry e2m1 table directly (`vpermps` reads the index's
//!   low 4 bits), the high nibble after one shift. The chunk's even elements land in one vector
//!   and its odd ones in another, so the activations are deinterleaved the same way once per call
//!   (a copy of `x`, a few percent of the weight bytes). A row's block multipliers are decoded with
//!   SIMD into a small buffer first (NVFP4: `e4m3 / 256 · (tensor_scale · 256)`, the same f32
//!   product as the reference; MXFP4: the e8m0 code shifted into the f32 exponent). From 2 tokens
//!   they multiply the decoded weights (the reference's dequantized weights, bit for bit); at one
//!   token they multiply each chunk's dot product instead, one instruction fewer per chunk.
//! - Rows in blocks of 4 (2 for FP8 at 3-4 tokens: registers), so each activation load serves
//!   4 rows and 4-8 independent FMA chains hide the latency; the next row block is prefetched into
//!   L2 while this one streams (rows of one call are contiguous).
//! - Up to 4 tokens are served from registers; more through each row block dequantized once into
//!   an L1-resident f32 buffer that every 4-token block then reads, so the weights still stream
//!   from memory once per call.
//!
//! Rows are independent (any `r0..r1` split works). Shapes the f32 SIMD paths cannot tile (columns
//! not a multiple of `2 · lanes` for 4-bit or of `lanes` for FP8, FP8 block columns not a multiple
//! of `lanes`) take the AVX2 path when it can, else the scalar one. Tests:
//! `cargo test -p freetoken-core --release quant::`; bench: `cargo bench -p freetoken-core --bench
//! quant_kernel` (and `benches/cpu_experts.py --format`, through `CpuExperts`).
#[cfg(target_arch = "x86_64")]
mod avx512_bf16;

use super::{QExpert, QMatrix};
use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::cpu::{Act, Isa};

/// `out[t * ldo + (r - r0)] = Σ_c m[r, c] · x[t * m.cols + c]` for `r in r0..r1`, `t < n_tok`.
///
/// `x` is bf16 for the paths that want it ([`Isa::wants_bf16`]; elsewhere it is widened) or f32
/// (the f32 paths on any `isa`). Panics (slice indexing or the asserts) when the slices are too
/// short; never reads out of bounds.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    isa: Isa,
    m: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: Act<'_>,
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let per_byte = 8 / m.format.weight_bits();
    assert!(r0 <= r1 && r1 <= m.rows && m.weight.len() >= m.rows * m.cols / per_byte);
    let (srows, scols) = m.format.scale_shape(m.rows, m.cols);
    assert!(m.scales.len() >= srows * scols * m.format.scale_bytes());
    let x_len = match x {
        Act::F32(x) => x.len(),
        Act::Bf16(x) => x.len(),
    };
    assert!(n_tok * m.cols <= x_len);
    assert!(n_tok == 0 || (n_tok - 1) * ldo + (r1 - r0) <= out.len());
    match x {
        #[cfg(target_arch = "x86_64")]
        Act::Bf16(x) if isa.wants_bf16() && Isa::Avx512Bf16.supported() => {
            // SAFETY: features checked; the asserts above bound every row, scale and token read;
            // `out` rows r0..r1 for n_tok tokens lie inside `out`.
            unsafe { avx512_bf16::gemv(m, r0, r1, x, n_tok, out.as_mut_ptr(), ldo) };
        }
        Act::Bf16(x) => {
            let xf: Vec<f32> = x[..n_tok * m.cols]
                .iter()
                .map(|&v| bf16_to_f32(v))
                .collect();
            gemv_f32(isa, m, r0, r1, &xf, n_tok, out, ldo)
        }
        Act::F32(x) => gemv_f32(isa, m, r0, r1, x, n_tok, out, ldo),
    }
}

/// [`gemv`] with f32 activations: the f32 SIMD paths or the scalar reference.
#[allow(clippy::too_many_arguments)]
fn gemv_f32(
    isa: Isa,
    m: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = matches!(isa, Isa::Avx512Bf16 | Isa::AmxBf16)
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw");
        let avx2 = matches!(isa, Isa::Avx2 | Isa::Avx512Bf16 | Isa::AmxBf16)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx512 && simd::tiles(m, 16) {
            // SAFETY: features checked; `gemv` asserted the bounds of every row, scale and token
            // read and of `out`; `tiles` checked the shape.
            unsafe { simd::gemv_avx512(m, r0, r1, x, n_tok, out.as_mut_ptr(), ldo) };
            return;
        }
        if avx2 && simd::tiles(m, 8) {
            // SAFETY: as above.
            unsafe { simd::gemv_avx2(m, r0, r1, x, n_tok, out.as_mut_ptr(), ldo) };
            return;
        }
    }
    let _ = isa;
    scalar(m, r0, r1, x, n_tok, out, ldo);
}

/// The reference: one row and one token at a time, each weight dequantized, column order.
fn scalar(
    m: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    for t in 0..n_tok {
        let xt = &x[t * m.cols..(t + 1) * m.cols];
        for r in r0..r1 {
            out[t * ldo + r - r0] = (0..m.cols).map(|c| m.get(r, c) * xt[c]).sum();
        }
    }
}

/// SwiGLU of one quantized expert for `n_tok` tokens: `x [n, H]` -> `out [n, H]`, single thread
/// (the reference the worker pool's split must match, and the bench's unit of work). Paths that
/// want bf16 get `x` and the activation `silu(g) · u` rounded to bf16, as [`crate::cpu::CpuExperts`]
/// gives them.
pub fn expert_forward(isa: Isa, e: &QExpert<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
    let (h, i) = (e.down.rows, e.gate.rows);
    let bf = isa.wants_bf16();
    let xb: Vec<u16> = if bf {
        x.iter().map(|&v| f32_to_bf16(v)).collect()
    } else {
        Vec::new()
    };
    fn act<'a>(bf: bool, f: &'a [f32], b: &'a [u16]) -> Act<'a> {
        if bf {
            Act::Bf16(b)
        } else {
            Act::F32(f)
        }
    }
    let mut g = vec![0f32; n_tok * i];
    let mut u = vec![0f32; n_tok * i];
    gemv(isa, &e.gate, 0, i, act(bf, x, &xb), n_tok, &mut g, i);
    gemv(isa, &e.up, 0, i, act(bf, x, &xb), n_tok, &mut u, i);
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = *gv / (1.0 + (-*gv).exp()) * uv;
    }
    let gb: Vec<u16> = if bf {
        g.iter().map(|&v| f32_to_bf16(v)).collect()
    } else {
        Vec::new()
    };
    gemv(
        isa,
        &e.down,
        0,
        h,
        act(bf, &g, &gb),
        n_tok,
        &mut out[..n_tok * h],
        h,
    );
}

#[cfg(target_arch = "x86_64")]
// The row/token loops index several per-row and per-token arrays at once.
#[allow(clippy::needless_range_loop)]
mod simd {
    use super::super::{e4m3_to_f32, e8m0_to_f32, QMatrix, ScaleType, E2M1_TABLE};
    use std::arch::x86_64::*;

    /// Rows per block (the activation loads each serve this many rows).
    const ROWS: usize = 4;

    /// One lane width's register operations. Every method is register-only or reads exactly the
    /// bytes its doc names; callers guarantee those bytes exist and the CPU has the features.
    pub(super) trait Lanes {
        /// f32 lanes per vector.
        const N: usize;
        /// The vector type.
        type V: Copy;
        unsafe fn zero() -> Self::V;
        unsafe fn splat(v: f32) -> Self::V;
        /// N f32 at p.
        unsafe fn load(p: *const f32) -> Self::V;
        /// N f32 to p.
        unsafe fn store(p: *mut f32, v: Self::V);
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
        /// a · b + c.
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn sum(v: Self::V) -> f32;
        /// N e4m3 codes at p -> their values / 256, exact (NaN codes are not special-cased).
        unsafe fn e4m3(p: *const u8) -> Self::V;
        /// N e8m0 codes at p -> 2^(code - 127) (0xFF gives infinity, not NaN).
        unsafe fn e8m0(p: *const u8) -> Self::V;
        /// N bytes of packed e2m1 at p -> (values of the low nibbles, of the high nibbles).
        unsafe fn e2m1(p: *const u8) -> (Self::V, Self::V);
        /// Lanes below N/2 = s[0], the others s[1] (two f32 at s).
        unsafe fn halves(s: *const f32) -> Self::V;
        /// The 2N f32 at src: the even-indexed ones to dst, then the odd ones (2N f32 at dst).
        unsafe fn deinterleave(src: *const f32, dst: *mut f32);
        /// Prefetches the line at p into L2 (p need not be readable).
        unsafe fn prefetch(p: *const u8) {
            // SAFETY: a prefetch reads nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
        }
    }

    pub(super) struct Avx512;
    pub(super) struct Avx2;

    impl Lanes for Avx512 {
        const N: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_reduce_add_ps(v) }
        }
        #[inline(always)]
        unsafe fn e4m3(p: *const u8) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                // s eeee mmm -> s 0 eeee mmm 0000000 (the sign extension fills bit 15).
                let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
                let h = _mm256_and_si256(
                    _mm256_slli_epi16::<7>(w),
                    _mm256_set1_epi16(0xBF80u16 as i16),
                );
                _mm512_cvtph_ps(h)
            }
        }
        #[inline(always)]
        unsafe fn e8m0(p: *const u8) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                // Code 0 is 2^-127, the f32 subnormal 0x0040_0000; every other code is above it.
                let bits =
                    _mm512_max_epu32(_mm512_slli_epi32::<23>(c), _mm512_set1_epi32(0x0040_0000));
                _mm512_castsi512_ps(bits)
            }
        }
        #[inline(always)]
        unsafe fn e2m1(p: *const u8) -> (__m512, __m512) {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                let lut = _mm512_loadu_ps(E2M1_TABLE.as_ptr());
                let d = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                // vpermps reads the low 4 bits of each index: the low nibble as is.
                let lo = _mm512_permutexvar_ps(d, lut);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(d), lut);
                (lo, hi)
            }
        }
        #[inline(always)]
        unsafe fn halves(s: *const f32) -> __m512 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(*s), _mm512_set1_ps(*s.add(1))) }
        }
        #[inline(always)]
        unsafe fn deinterleave(src: *const f32, dst: *mut f32) {
            // SAFETY: the trait's contract: the bytes read and written exist, the features are the caller's.
            unsafe {
                let (a, b) = (_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
                let even =
                    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
                _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, even, b));
                _mm512_storeu_ps(dst.add(16), _mm512_permutex2var_ps(a, odd, b));
            }
        }
    }

    impl Lanes for Avx2 {
        const N: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
                _mm_cvtss_f32(s)
            }
        }
        #[inline(always)]
        unsafe fn e4m3(p: *const u8) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                let w = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
                let h = _mm_and_si128(_mm_slli_epi16::<7>(w), _mm_set1_epi16(0xBF80u16 as i16));
                _mm256_cvtph_ps(h)
            }
        }
        #[inline(always)]
        unsafe fn e8m0(p: *const u8) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                let bits =
                    _mm256_max_epu32(_mm256_slli_epi32::<23>(c), _mm256_set1_epi32(0x0040_0000));
                _mm256_castsi256_ps(bits)
            }
        }
        #[inline(always)]
        unsafe fn e2m1(p: *const u8) -> (__m256, __m256) {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                // vpermps over 8 lanes reads 3 index bits: the magnitude from the table's first
                // half, the sign (bit 3 of the nibble) moved to bit 31.
                let mags = _mm256_loadu_ps(E2M1_TABLE.as_ptr());
                let sign = _mm256_set1_epi32(i32::MIN);
                let d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                let lo = _mm256_or_si256(
                    _mm256_castps_si256(_mm256_permutevar8x32_ps(mags, d)),
                    _mm256_and_si256(_mm256_slli_epi32::<28>(d), sign),
                );
                let dh = _mm256_srli_epi32::<4>(d);
                let hi = _mm256_or_si256(
                    _mm256_castps_si256(_mm256_permutevar8x32_ps(mags, dh)),
                    _mm256_and_si256(_mm256_slli_epi32::<24>(d), sign),
                );
                (_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi))
            }
        }
        #[inline(always)]
        unsafe fn halves(s: *const f32) -> __m256 {
            // SAFETY: the trait's contract: the bytes read exist, the features are the caller's.
            unsafe {
                _mm256_insertf128_ps::<1>(
                    _mm256_castps128_ps256(_mm_set1_ps(*s)),
                    _mm_set1_ps(*s.add(1)),
                )
            }
        }
        #[inline(always)]
        unsafe fn deinterleave(src: *const f32, dst: *mut f32) {
            // SAFETY: the trait's contract: the bytes read and written exist, the features are the caller's.
            unsafe {
                let (a, b) = (_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8)));
                // Per 128-bit lane (a0 a2 b0 b2 | a4 a6 b4 b6), then the 64-bit pairs in order.
                let even = _mm256_castps_pd(_mm256_shuffle_ps::<0x88>(a, b));
                let odd = _mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(a, b));
                _mm256_storeu_ps(dst, _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(even)));
                _mm256_storeu_ps(
                    dst.add(8),
                    _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(odd)),
                );
            }
        }
    }

    /// Whether the `n`-lane path tiles `m`: FP8 columns and block columns in whole vectors, 4-bit
    /// columns in whole chunks of `2n` with scale groups of at least `n` elements.
    pub(super) fn tiles(m: &QMatrix<'_>, n: usize) -> bool {
        let (_, bc) = m.format.block();
        match m.format.weight_bits() {
            8 => m.cols.is_multiple_of(n) && bc.is_multiple_of(n),
            // A chunk of 2n elements lies in one scale group, or splits into two.
            4 => m.cols.is_multiple_of(2 * n) && (bc.is_multiple_of(2 * n) || bc == n),
            _ => false,
        }
    }

    /// The per-call state: the matrix, the activations as the kernels read them, the block
    /// multipliers of the rows being computed.
    struct Call<'a> {
        m: &'a QMatrix<'a>,
        /// FP8: `x` itself; 4-bit: each chunk of `2N` deinterleaved (even elements, then odd).
        x: *const f32,
        /// 4-bit: `ROWS` rows of `ngroups` block multipliers.
        scales: Vec<f32>,
        /// Block multipliers per row (4-bit).
        ngroups: usize,
    }

    impl<'a> Call<'a> {
        /// 4-bit: decodes row r's block multipliers into slot `k` of `scales`.
        #[inline(always)]
        unsafe fn row_scales<S: Lanes>(&mut self, r: usize, k: usize) {
            let m = self.m;
            let ng = self.ngroups;
            // SAFETY: row r's `ng` scale bytes are inside `m.scales` (checked by `gemv`); SIMD
            // reads stay in whole vectors of them, the tail is scalar.
            unsafe {
                let src = m.scales.as_ptr().add(r * ng);
                let dst = self.scales.as_mut_ptr().add(k * ng);
                let mut g = 0;
                match m.format.scale_type() {
                    ScaleType::E4m3 => {
                        // (e4m3 / 256) · (ts · 256): the reference's e4m3 · ts, the same f32 product.
                        let ts = S::splat(m.tensor_scale * 256.0);
                        while g + S::N <= ng {
                            S::store(dst.add(g), S::mul(S::e4m3(src.add(g)), ts));
                            g += S::N;
                        }
                        for j in g..ng {
                            *dst.add(j) = e4m3_to_f32(*src.add(j)) * m.tensor_scale;
                        }
                    }
                    _ => {
                        while g + S::N <= ng {
                            S::store(dst.add(g), S::e8m0(src.add(g)));
                            g += S::N;
                        }
                        for j in g..ng {
                            *dst.add(j) = e8m0_to_f32(*src.add(j));
                        }
                    }
                }
            }
        }

        /// 4-bit: the e2m1 values of row r's chunk at column c (`2N` elements: the even ones, the
        /// odd ones) and their multipliers (the row's in slot `k`).
        #[inline(always)]
        unsafe fn fp4_chunk_unscaled<S: Lanes>(
            &self,
            r: usize,
            k: usize,
            c: usize,
        ) -> (S::V, S::V, S::V) {
            let m = self.m;
            let g = m.format.block().1;
            // SAFETY: r < rows, c + 2N <= cols (the caller's loop), so the N bytes are in row r.
            unsafe {
                let (lo, hi) = S::e2m1(m.weight.as_ptr().add((r * m.cols + c) / 2));
                let s = self.scales.as_ptr().add(k * self.ngroups + c / g);
                let sv = if g >= 2 * S::N {
                    S::splat(*s)
                } else {
                    S::halves(s)
                };
                (lo, hi, sv)
            }
        }

        /// 4-bit: the dequantized weights of row r's chunk at column c (each e2m1 value times its
        /// multiplier, the reference's f32 product).
        #[inline(always)]
        unsafe fn fp4_chunk<S: Lanes>(&self, r: usize, k: usize, c: usize) -> (S::V, S::V) {
            // SAFETY: forwarded.
            let (lo, hi, sv) = unsafe { self.fp4_chunk_unscaled::<S>(r, k, c) };
            // SAFETY: register-only arithmetic.
            unsafe { (S::mul(lo, sv), S::mul(hi, sv)) }
        }

        /// FP8: block (rb, cb)'s multiplier times 256 (the e4m3 decoding's `1 / 256`).
        #[inline(always)]
        unsafe fn fp8_scale(&self, r: usize, cb: usize) -> f32 {
            let m = self.m;
            let (br, bc) = m.format.block();
            let i = (r / br) * m.cols.div_ceil(bc) + cb;
            // SAFETY: the block lies in the scale grid `gemv` checked against `m.scales`.
            unsafe { std::ptr::read_unaligned(m.scales.as_ptr().add(4 * i) as *const f32) * 256.0 }
        }

        /// Rows r..r+R, tokens t0..t0+T (4-bit), into `out[t * ldo + r - r0]`.
        #[inline(always)]
        unsafe fn fp4_rows<S: Lanes, const R: usize, const T: usize>(
            &mut self,
            r: usize,
            t0: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let cols = self.m.cols;
            // SAFETY: rows r..r+R < m.rows and tokens t0..t0+T < n_tok (the caller); chunks stay
            // inside the row; the prefetch address is never read.
            unsafe {
                for k in 0..R {
                    self.row_scales::<S>(r + k, k);
                }
                let w = self.m.weight.as_ptr().add(r * cols / 2);
                let mut acc = [[S::zero(); T]; R];
                for c in (0..cols).step_by(2 * S::N) {
                    if (c / 2).is_multiple_of(64) {
                        for k in 0..R {
                            S::prefetch(w.wrapping_add((R + k) * cols / 2 + c / 2));
                        }
                    }
                    let xs: [(S::V, S::V); T] = std::array::from_fn(|t| {
                        let p = self.x.add((t0 + t) * cols + c);
                        (S::load(p), S::load(p.add(S::N)))
                    });
                    for k in 0..R {
                        if T == 1 {
                            // One token: the chunk's products first, then the multipliers once (one
                            // instruction fewer than scaling both halves of the weights).
                            let (lo, hi, sv) = self.fp4_chunk_unscaled::<S>(r + k, k, c);
                            let dot = S::fma(hi, xs[0].1, S::mul(lo, xs[0].0));
                            acc[k][0] = S::fma(dot, sv, acc[k][0]);
                        } else {
                            let (lo, hi) = self.fp4_chunk::<S>(r + k, k, c);
                            for t in 0..T {
                                acc[k][t] = S::fma(hi, xs[t].1, S::fma(lo, xs[t].0, acc[k][t]));
                            }
                        }
                    }
                }
                for k in 0..R {
                    for t in 0..T {
                        *out.add(t * ldo + k) = S::sum(acc[k][t]);
                    }
                }
            }
        }

        /// Rows r..r+R, tokens t0..t0+T (FP8), into `out[t * ldo + k]`.
        #[inline(always)]
        unsafe fn fp8_rows<S: Lanes, const R: usize, const T: usize>(
            &self,
            r: usize,
            t0: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let m = self.m;
            let cols = m.cols;
            let bc = m.format.block().1;
            // SAFETY: as `fp4_rows`.
            unsafe {
                let w = m.weight.as_ptr().add(r * cols);
                let mut acc = [[S::zero(); T]; R];
                for cb in 0..cols.div_ceil(bc) {
                    let mut blk = [[S::zero(); T]; R];
                    for c in (cb * bc..((cb + 1) * bc).min(cols)).step_by(S::N) {
                        if c.is_multiple_of(64) {
                            for k in 0..R {
                                S::prefetch(w.wrapping_add((R + k) * cols + c));
                            }
                        }
                        let xs: [S::V; T] =
                            std::array::from_fn(|t| S::load(self.x.add((t0 + t) * cols + c)));
                        for k in 0..R {
                            let v = S::e4m3(w.add(k * cols + c));
                            for t in 0..T {
                                blk[k][t] = S::fma(v, xs[t], blk[k][t]);
                            }
                        }
                    }
                    for k in 0..R {
                        let s = S::splat(self.fp8_scale(r + k, cb));
                        for t in 0..T {
                            acc[k][t] = S::fma(blk[k][t], s, acc[k][t]);
                        }
                    }
                }
                for k in 0..R {
                    for t in 0..T {
                        *out.add(t * ldo + k) = S::sum(acc[k][t]);
                    }
                }
            }
        }

        /// Rows r..r+R for tokens t0..t0+T in registers, into `out` (row r's output at `out`).
        #[inline(always)]
        unsafe fn rows<S: Lanes, const R: usize, const T: usize>(
            &mut self,
            r: usize,
            t0: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            // SAFETY: forwarded.
            unsafe {
                if self.m.format.weight_bits() == 8 {
                    self.fp8_rows::<S, R, T>(r, t0, out, ldo)
                } else {
                    self.fp4_rows::<S, R, T>(r, t0, out, ldo)
                }
            }
        }

        /// Rows r0..r1 for tokens t0..t0+T: blocks of `R` rows, then single rows.
        #[inline(always)]
        unsafe fn all_rows<S: Lanes, const R: usize, const T: usize>(
            &mut self,
            r0: usize,
            r1: usize,
            t0: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            // SAFETY: forwarded; each block's output starts at its first row's offset.
            unsafe {
                let mut r = r0;
                while r + R <= r1 {
                    self.rows::<S, R, T>(r, t0, out.add(t0 * ldo + r - r0), ldo);
                    r += R;
                }
                while r < r1 {
                    self.rows::<S, 1, T>(r, t0, out.add(t0 * ldo + r - r0), ldo);
                    r += 1;
                }
            }
        }

        /// Rows r..r+R dequantized into `dst` (`R` rows of `cols` f32, in the order the
        /// activations are in: 4-bit chunks deinterleaved).
        #[inline(always)]
        unsafe fn decode_rows<S: Lanes, const R: usize>(&mut self, r: usize, dst: *mut f32) {
            let m = self.m;
            let cols = m.cols;
            // SAFETY: as `fp4_rows`; `dst` holds R * cols floats.
            unsafe {
                for k in 0..R {
                    let d = dst.add(k * cols);
                    if m.format.weight_bits() == 8 {
                        let bc = m.format.block().1;
                        for cb in 0..cols.div_ceil(bc) {
                            let s = S::splat(self.fp8_scale(r + k, cb));
                            for c in (cb * bc..((cb + 1) * bc).min(cols)).step_by(S::N) {
                                let v = S::e4m3(m.weight.as_ptr().add((r + k) * cols + c));
                                S::store(d.add(c), S::mul(v, s));
                            }
                        }
                    } else {
                        self.row_scales::<S>(r + k, k);
                        for c in (0..cols).step_by(2 * S::N) {
                            let (lo, hi) = self.fp4_chunk::<S>(r + k, k, c);
                            S::store(d.add(c), lo);
                            S::store(d.add(c + S::N), hi);
                        }
                    }
                }
            }
        }

        /// `out[t * ldo + k] = w[k] · x[t0 + t]` for R decoded rows at `w` and T tokens.
        #[inline(always)]
        unsafe fn dot<S: Lanes, const R: usize, const T: usize>(
            &self,
            w: *const f32,
            t0: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let cols = self.m.cols;
            // SAFETY: the caller guarantees R * cols floats at w, the tokens and the outputs.
            unsafe {
                let mut acc = [[S::zero(); T]; R];
                for c in (0..cols).step_by(S::N) {
                    let xs: [S::V; T] =
                        std::array::from_fn(|t| S::load(self.x.add((t0 + t) * cols + c)));
                    for k in 0..R {
                        let wv = S::load(w.add(k * cols + c));
                        for t in 0..T {
                            acc[k][t] = S::fma(wv, xs[t], acc[k][t]);
                        }
                    }
                }
                for k in 0..R {
                    for t in 0..T {
                        *out.add(t * ldo + k) = S::sum(acc[k][t]);
                    }
                }
            }
        }

        /// R decoded rows at `w` against every token, 4 at a time.
        #[inline(always)]
        unsafe fn dot_tokens<S: Lanes, const R: usize>(
            &self,
            w: *const f32,
            n_tok: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            // SAFETY: forwarded; token block t0 writes at out + t0 * ldo.
            unsafe {
                let mut t0 = 0;
                while t0 < n_tok {
                    let o = out.add(t0 * ldo);
                    match n_tok - t0 {
                        1 => self.dot::<S, R, 1>(w, t0, o, ldo),
                        2 => self.dot::<S, R, 2>(w, t0, o, ldo),
                        3 => self.dot::<S, R, 3>(w, t0, o, ldo),
                        _ => self.dot::<S, R, 4>(w, t0, o, ldo),
                    }
                    t0 += 4;
                }
            }
        }
    }

    /// See [`super::gemv`]; the shape is one [`tiles`] accepts for `S::N` lanes.
    #[inline(always)]
    unsafe fn gemv<S: Lanes>(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: &[f32],
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let cols = m.cols;
        let four_bit = m.format.weight_bits() == 4;
        // 4-bit: each chunk's even elements first, then its odd ones, as `e2m1` decodes them.
        let xd: Vec<f32> = if four_bit {
            let mut xd = vec![0f32; n_tok * cols];
            for c in (0..n_tok * cols).step_by(2 * S::N) {
                // SAFETY: cols is a multiple of 2N (`tiles`) and x holds n_tok * cols floats (`super::gemv`).
                unsafe { S::deinterleave(x.as_ptr().add(c), xd.as_mut_ptr().add(c)) };
            }
            xd
        } else {
            Vec::new()
        };
        let ngroups = if four_bit {
            cols.div_ceil(m.format.block().1)
        } else {
            0
        };
        let mut call = Call {
            m,
            x: if four_bit { xd.as_ptr() } else { x.as_ptr() },
            scales: vec![0f32; ROWS * ngroups],
            ngroups,
        };
        // SAFETY: bounds as `super::gemv` checked them.
        unsafe {
            match (n_tok, four_bit) {
                (0, _) => {}
                (1, _) => call.all_rows::<S, ROWS, 1>(r0, r1, 0, out, ldo),
                (2, _) => call.all_rows::<S, ROWS, 2>(r0, r1, 0, out, ldo),
                // FP8 keeps a block sum beside each accumulator: 2 rows at 3-4 tokens (registers).
                (3, false) => call.all_rows::<S, 2, 3>(r0, r1, 0, out, ldo),
                (4, false) => call.all_rows::<S, 2, 4>(r0, r1, 0, out, ldo),
                (3, true) => call.all_rows::<S, ROWS, 3>(r0, r1, 0, out, ldo),
                (4, true) => call.all_rows::<S, ROWS, 4>(r0, r1, 0, out, ldo),
                _ => {
                    let mut w = vec![0f32; ROWS * cols];
                    let mut r = r0;
                    while r + ROWS <= r1 {
                        call.decode_rows::<S, ROWS>(r, w.as_mut_ptr());
                        call.dot_tokens::<S, ROWS>(w.as_ptr(), n_tok, out.add(r - r0), ldo);
                        r += ROWS;
                    }
                    while r < r1 {
                        call.decode_rows::<S, 1>(r, w.as_mut_ptr());
                        call.dot_tokens::<S, 1>(w.as_ptr(), n_tok, out.add(r - r0), ldo);
                        r += 1;
                    }
                }
            }
        }
    }

    /// [`gemv`] with 16 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(super) unsafe fn gemv_avx512(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: &[f32],
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: the caller's.
        unsafe { gemv::<Avx512>(m, r0, r1, x, n_tok, out, ldo) }
    }

    /// [`gemv`] with 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_avx2(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: &[f32],
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: the caller's.
        unsafe { gemv::<Avx2>(m, r0, r1, x, n_tok, out, ldo) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ExpertFormat, E2M1_TABLE};
    use super::*;
    use crate::pool::SplitMix64;

    /// Random expert bytes of `format` with scales in a sane range (no NaN codes).
    fn random_expert(format: ExpertFormat, h: usize, i: usize, seed: u64) -> Vec<u8> {
        let layout = format.layout(h, i);
        let mut rng = SplitMix64::new(seed);
        let mut b: Vec<u8> = (0..layout.expert_nbytes)
            .map(|_| rng.next_u64() as u8)
            .collect();
        // Weights: any e2m1 byte is valid; e4m3 codes avoid the NaN patterns.
        if format.weight_bits() == 8 {
            for s in [layout.gate_up, layout.down] {
                for v in &mut b[s.0..s.0 + s.1] {
                    if *v & 0x7F == 0x7F {
                        *v = 0x7E;
                    }
                }
            }
        }
        for s in [layout.gate_up_scale, layout.down_scale] {
            let scales = &mut b[s.0..s.0 + s.1];
            match format {
                ExpertFormat::Fp8Block { .. } => {
                    for c in scales.chunks_mut(4) {
                        let v = 1e-3 * (1.0 + rng.next_f64() as f32);
                        c.copy_from_slice(&v.to_le_bytes());
                    }
                }
                // e4m3 scales in [2^-3, 2^3): exponent codes 4..10.
                ExpertFormat::Nvfp4 => scales.iter_mut().for_each(|v| *v = 0x20 + *v % 0x30),
                _ => scales.iter_mut().for_each(|v| *v = 120 + *v % 8),
            }
        }
        if layout.tensor_scale.1 > 0 {
            for k in 0..3 {
                let o = layout.tensor_scale.0 + 4 * k;
                b[o..o + 4].copy_from_slice(&(1e-3f32 * (k + 1) as f32).to_le_bytes());
            }
        }
        b
    }

    fn formats() -> [ExpertFormat; 4] {
        [
            ExpertFormat::Fp8Block {
                block_rows: 128,
                block_cols: 128,
            },
            ExpertFormat::Fp8Block {
                block_rows: 16,
                block_cols: 32,
            },
            ExpertFormat::Nvfp4,
            ExpertFormat::Mxfp4,
        ]
    }

    /// `x` as a path reads it: bf16 bits for the paths that want them, and the f32 values the
    /// scalar reference must see to compute the same sum (`x` rounded to bf16 there).
    fn as_read(isa: Isa, x: &[f32]) -> (Vec<u16>, Vec<f32>) {
        let b: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
        let f = if isa.wants_bf16() {
            b.iter().map(|&v| bf16_to_f32(v)).collect()
        } else {
            x.to_vec()
        };
        (b, f)
    }

    #[test]
    fn every_path_matches_the_scalar_reference() {
        let (h, i) = (256, 128);
        for format in formats() {
            let layout = format.layout(h, i);
            let bytes = random_expert(format, h, i, 3);
            let e = layout.expert(&bytes).unwrap();
            let mut rng = SplitMix64::new(9);
            for n in [1usize, 3, 4, 7, 16] {
                let x: Vec<f32> = (0..n * h).map(|_| rng.next_f64() as f32 - 0.5).collect();
                for isa in Isa::all_supported() {
                    // The bf16 paths against the reference on the bf16-rounded input; they also
                    // round silu(g) · u (2^-9 relative each), which the reference keeps in f32.
                    let (_, xr) = as_read(isa, &x);
                    let mut want = vec![0f32; n * h];
                    expert_forward(Isa::Scalar, &e, &xr, n, &mut want);
                    let tol = if isa.wants_bf16() { 4e-3 } else { 1e-4 };
                    let mut got = vec![0f32; n * h];
                    expert_forward(isa, &e, &x, n, &mut got);
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= tol * scale,
                            "{} {isa:?} n={n}: {a} vs {b}",
                            format.name()
                        );
                    }
                }
                // A row range of the down projection lands at its offset.
                let mut part = vec![0f32; n * 16];
                let a: Vec<f32> = (0..n * i).map(|_| rng.next_f64() as f32).collect();
                let (ab, ar) = as_read(Isa::detect(), &a);
                let act = if Isa::detect().wants_bf16() {
                    Act::Bf16(&ab)
                } else {
                    Act::F32(&a)
                };
                gemv(Isa::detect(), &e.down, 32, 48, act, n, &mut part, 16);
                let mut full = vec![0f32; n * h];
                gemv(Isa::Scalar, &e.down, 0, h, Act::F32(&ar), n, &mut full, h);
                let scale = full.iter().fold(0f32, |a, v| a.max(v.abs()));
                for t in 0..n {
                    for r in 0..16 {
                        let (p, f) = (part[t * 16 + r], full[t * h + 32 + r]);
                        assert!((p - f).abs() <= 1e-4 * scale, "{p} {f}");
                    }
                }
            }
        }
    }

    #[test]
    fn dequantized_elements_follow_the_definitions() {
        let (h, i) = (64, 32);
        let nv = ExpertFormat::Nvfp4.layout(h, i);
        let mut b = vec![0u8; nv.expert_nbytes];
        b[0] = 0x9F; // gate[0, 0] = code 0xF = -6, gate[0, 1] = code 0x9 = -0.5
        b[nv.gate_up_scale.0] = 0x40; // e4m3 2.0
        b[nv.tensor_scale.0..nv.tensor_scale.0 + 4].copy_from_slice(&0.25f32.to_le_bytes());
        let e = nv.expert(&b).unwrap();
        assert_eq!(e.gate.get(0, 0), -6.0 * (2.0 * 0.25));
        assert_eq!(e.gate.get(0, 1), -0.5 * 0.5);
        assert_eq!(E2M1_TABLE[7], 6.0);
        let mx = ExpertFormat::Mxfp4.layout(h, i);
        let mut b = vec![0u8; mx.expert_nbytes];
        b[mx.down.0 + i / 2] = 0x07; // down[1, 0] = 6
        b[mx.down_scale.0 + 1] = 125; // row 1's scale 2^-2
        assert_eq!(mx.expert(&b).unwrap().down.get(1, 0), 1.5);
    }

    /// Formats and shape units (H and I are multiples of the unit): FP8 blocks that the AVX-512
    /// path tiles, that only the AVX2 path tiles (block columns 8 or 24), NVFP4 with 16-column
    /// multiples (odd ones: AVX2 only), MXFP4; 4-bit rows of whole 128-element chunks of the bf16
    /// kernels and a partial last one (48 and 96 columns a unit).
    fn odd_formats() -> [(ExpertFormat, usize); 8] {
        let fp8 = |block_rows, block_cols| ExpertFormat::Fp8Block {
            block_rows,
            block_cols,
        };
        [
            (fp8(128, 128), 128),
            (fp8(16, 16), 16),
            (fp8(8, 8), 8),
            (fp8(32, 24), 96),
            (ExpertFormat::Nvfp4, 16),
            (ExpertFormat::Mxfp4, 32),
            (ExpertFormat::Nvfp4, 48),
            (ExpertFormat::Mxfp4, 96),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Every path on odd shapes, row ranges (tails of the 4-row blocks) and token counts (the
        /// register paths and the decoded-row path) matches the scalar reference within f32
        /// summation error: 1e-5 of the sum of |w · x| of each output.
        #[test]
        fn every_path_matches_scalar_on_odd_shapes(
            f in 0usize..8,
            a in 1usize..5,
            b in 1usize..5,
            n in 1usize..10,
            down in proptest::bool::ANY,
            rs in 0usize..1000,
            re in 0usize..1000,
            seed in 0u64..1000,
        ) {
            let (format, unit) = odd_formats()[f];
            let (h, i) = (unit * a, unit * b);
            let bytes = random_expert(format, h, i, seed);
            let e = format.layout(h, i).expert(&bytes).unwrap();
            let m = if down { e.down } else { e.gate };
            let (r0, r1) = {
                let (p, q) = (rs % (m.rows + 1), re % (m.rows + 1));
                (p.min(q), p.max(q))
            };
            let mut rng = SplitMix64::new(seed ^ 7);
            let x: Vec<f32> = (0..n * m.cols).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let rows = r1 - r0;
            // Each path with each activation type it takes (bf16: the AVX-512-BF16 kernels where
            // the path wants bf16, else widened) against the reference on the same values.
            for isa in Isa::all_supported() {
                for bf in [false, true] {
                    let (xb, xr) = if bf { as_read(Isa::Avx512Bf16, &x) } else { as_read(Isa::Scalar, &x) };
                    let act = if bf { Act::Bf16(&xb) } else { Act::F32(&x) };
                    let mut want = vec![0f32; n * rows];
                    gemv(Isa::Scalar, &m, r0, r1, Act::F32(&xr), n, &mut want, rows);
                    let mut got = vec![f32::NAN; n * rows];
                    gemv(isa, &m, r0, r1, act, n, &mut got, rows);
                    for t in 0..n {
                        for r in 0..rows {
                            let bound: f32 =
                                (0..m.cols).map(|c| (m.get(r0 + r, c) * xr[t * m.cols + c]).abs()).sum();
                            let (g, w) = (got[t * rows + r], want[t * rows + r]);
                            proptest::prop_assert!(
                                (g - w).abs() <= 1e-5 * bound + 1e-30,
                                "{} {h}x{i} down={down} {isa:?} bf16={bf} n={n} rows {r0}..{r1}: row {r} token {t}: {g} vs {w}",
                                format.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simd_scale_decoding_is_the_reference_bit_for_bit() {
        // Every e4m3 scale code (but NaN) and e8m0 code through the SIMD row decoding: a 1-row
        // matrix whose weights are all e2m1 1.0 (code 2) times x = one-hot picks each multiplier.
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let g = format.block().1;
            let codes: Vec<u8> = (0..=254u8)
                .filter(|c| format == ExpertFormat::Mxfp4 || c & 0x7F != 0x7F)
                .collect();
            let cols = codes.len().next_multiple_of(2) * g;
            let weight = vec![0x22u8; cols / 2];
            let mut scales = codes.clone();
            scales.resize(cols / g, codes[0]);
            let m = super::super::QMatrix {
                format,
                rows: 1,
                cols,
                weight: &weight,
                scales: &scales,
                tensor_scale: 0.375,
            };
            for isa in Isa::all_supported() {
                for (k, _) in codes.iter().enumerate() {
                    let mut x = vec![0f32; cols];
                    x[k * g + 1] = 1.0;
                    let (xb, _) = as_read(isa, &x);
                    let act = if isa.wants_bf16() {
                        Act::Bf16(&xb)
                    } else {
                        Act::F32(&x)
                    };
                    let mut got = [0f32];
                    gemv(isa, &m, 0, 1, act, 1, &mut got, 1);
                    // Equal as floats: e4m3 0x80 is -0.0, which a sum of +0.0 terms reports as +0.0.
                    assert_eq!(
                        got[0],
                        m.block_scale(0, k),
                        "{} {isa:?} code {}",
                        format.name(),
                        codes[k]
                    );
                }
            }
        }
    }
}
