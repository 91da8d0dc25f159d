//! Matrix-vector kernels over quantized weights, dequantized in registers:
//! `out[t, r] = Σ_c W[r, c] · x[t, c]` with `W` in FP8 block, NVFP4 or MXFP4 ([`super::QMatrix`]),
//! `x` f32, f32 accumulation.
//!
//! Variants (the same [`Isa`] as the bf16 kernels, chosen by the caller):
//! - scalar: the reference; each element dequantized as the format defines it
//!   ([`super::QMatrix::get`]), summed in column order.
//! - AVX-512 (taken for [`Isa::Avx512Bf16`] and [`Isa::AmxBf16`]; needs AVX-512F/BW): 16 weights
//!   per step. FP8: e4m3 bytes widened and moved into the f32 exponent and mantissa fields (exact;
//!   subnormal codes through an integer conversion), summed per scale block, the block sum times
//!   its f32 scale. 4-bit: two nibbles per byte expanded to 16 indices and looked up in the
//!   16-entry e2m1 table with one `vpermps`, times the block multiplier (the dequantized weight,
//!   bit for bit), then FMA with `x`.
//! - AVX2 + FMA: the same with 8 lanes; the e2m1 lookup takes the 8 magnitudes with `vpermps` and
//!   the sign from bit 3.
//!
//! Rows are independent (any `r0..r1` split works), and each weight row is read from memory once
//! per call: up to 4 tokens are served from registers, more from the row dequantized once into an
//! L1-resident f32 buffer. Shapes the SIMD paths cannot tile (columns or FP8 block columns not a multiple of 16,
//! resp. 8) take the scalar path. Tests: `cargo test -p freetoken-core --release quant::`;
//! bench: `cargo bench -p freetoken-core --bench quant_kernel`.
use super::{QExpert, QMatrix};
use crate::cpu::Isa;

/// `out[t * ldo + (r - r0)] = Σ_c m[r, c] · x[t * m.cols + c]` for `r in r0..r1`, `t < n_tok`.
///
/// Panics (slice indexing or the asserts) when the slices are too short; never reads out of
/// bounds.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    isa: Isa,
    m: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let per_byte = 8 / m.format.weight_bits();
    assert!(r0 <= r1 && r1 <= m.rows && m.weight.len() >= m.rows * m.cols / per_byte);
    let (srows, scols) = m.format.scale_shape(m.rows, m.cols);
    assert!(m.scales.len() >= srows * scols * m.format.scale_bytes());
    assert!(n_tok * m.cols <= x.len());
    assert!(n_tok == 0 || (n_tok - 1) * ldo + (r1 - r0) <= out.len());
    #[cfg(target_arch = "x86_64")]
    {
        let bc = m.format.block().1;
        match isa {
            Isa::Avx512Bf16 | Isa::AmxBf16
                if m.cols.is_multiple_of(16)
                    && bc.is_multiple_of(16)
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw") =>
            {
                // SAFETY: features checked; the asserts above bound every row, scale and token
                // read; `out` rows r0..r1 for n_tok tokens lie inside `out`.
                unsafe { avx512::gemv(m, r0, r1, x.as_ptr(), n_tok, out.as_mut_ptr(), ldo) };
                return;
            }
            Isa::Avx2 | Isa::Avx512Bf16 | Isa::AmxBf16
                if m.cols.is_multiple_of(8)
                    && bc.is_multiple_of(8)
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma") =>
            {
                // SAFETY: as above.
                unsafe { avx2::gemv(m, r0, r1, x.as_ptr(), n_tok, out.as_mut_ptr(), ldo) };
                return;
            }
            _ => {}
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
/// (the reference the worker pool's split must match, and the bench's unit of work).
pub fn expert_forward(isa: Isa, e: &QExpert<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
    let (h, i) = (e.down.rows, e.gate.rows);
    let mut g = vec![0f32; n_tok * i];
    let mut u = vec![0f32; n_tok * i];
    gemv(isa, &e.gate, 0, i, x, n_tok, &mut g, i);
    gemv(isa, &e.up, 0, i, x, n_tok, &mut u, i);
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = *gv / (1.0 + (-*gv).exp()) * uv;
    }
    gemv(isa, &e.down, 0, h, &g, n_tok, &mut out[..n_tok * h], h);
}

/// The batch split both SIMD paths share, over their own `rows`, `decode_row` and `dot`: up to 4
/// tokens decoded in registers; more through each row dequantized once, then dotted with every
/// 4-token block. Expands to unsafe calls: bounds as [`gemv`] checks them.
#[cfg(target_arch = "x86_64")]
macro_rules! batch_split {
    ($m:ident, $r0:ident, $r1:ident, $x:ident, $n_tok:ident, $out:ident, $ldo:ident) => {
        match $n_tok {
            0 => {}
            1 => rows::<1>($m, $r0, $r1, $x, 0, $out, $ldo),
            2 => rows::<2>($m, $r0, $r1, $x, 0, $out, $ldo),
            3 => rows::<3>($m, $r0, $r1, $x, 0, $out, $ldo),
            4 => rows::<4>($m, $r0, $r1, $x, 0, $out, $ldo),
            _ => {
                let mut row = vec![0f32; $m.cols];
                for r in $r0..$r1 {
                    decode_row($m, r, row.as_mut_ptr());
                    let mut t0 = 0;
                    while t0 < $n_tok {
                        let o = $out.add(t0 * $ldo + r - $r0);
                        match $n_tok - t0 {
                            1 => dot::<1>(row.as_ptr(), $x, $m.cols, t0, o, $ldo),
                            2 => dot::<2>(row.as_ptr(), $x, $m.cols, t0, o, $ldo),
                            3 => dot::<3>(row.as_ptr(), $x, $m.cols, t0, o, $ldo),
                            _ => dot::<4>(row.as_ptr(), $x, $m.cols, t0, o, $ldo),
                        }
                        t0 += 4;
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
// The token loops index several per-token arrays at once (accumulators, row pointers).
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use super::super::{QMatrix, E2M1_TABLE};
    use std::arch::x86_64::*;

    /// 16 e4m3 codes -> f32 (exact; NaN codes are not special-cased: weights hold none).
    #[inline(always)]
    unsafe fn e4m3x16(b: __m128i) -> __m512 {
        // SAFETY: register-only intrinsics (the target features are the caller's).
        unsafe {
            let i = _mm512_cvtepu8_epi32(b);
            let mag = _mm512_and_si512(i, _mm512_set1_epi32(0x7F));
            let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(i, _mm512_set1_epi32(0x80)));
            // Normal: exponent e + 120 (bias 7 -> 127), mantissa m << 20.
            let normal =
                _mm512_add_epi32(_mm512_slli_epi32::<20>(mag), _mm512_set1_epi32(120 << 23));
            // Subnormal (exponent 0): m · 2^-9.
            let sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0 / 512.0));
            let is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
            let v = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
            _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
        }
    }

    /// 8 bytes of packed e2m1 -> 16 f32 (element 2j from the low nibble of byte j).
    #[inline(always)]
    unsafe fn e2m1x16(p: *const u8, lut: __m512) -> __m512 {
        // SAFETY: the caller guarantees 8 readable bytes at p.
        unsafe {
            let b = _mm_loadl_epi64(p as *const __m128i);
            let lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), _mm_set1_epi8(0x0F));
            let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            _mm512_permutexvar_ps(idx, lut)
        }
    }

    /// Rows r0..r1 for tokens t0..t0+T.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows<const T: usize>(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: *const f32,
        t0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let (br, bc) = m.format.block();
        let cols = m.cols;
        // SAFETY: the caller (`super::gemv`) checked every bound: rows < m.rows, cols whole
        // blocks of 16, tokens t0 + T <= n_tok, out rows inside `out`.
        unsafe {
            let lut = _mm512_loadu_ps(E2M1_TABLE.as_ptr());
            let xt: [*const f32; T] = std::array::from_fn(|t| x.add((t0 + t) * cols));
            for r in r0..r1 {
                let mut acc = [_mm512_setzero_ps(); T];
                for cb in 0..cols / bc {
                    let s = _mm512_set1_ps(m.block_scale(r / br, cb));
                    let c0 = cb * bc;
                    if m.format.weight_bits() == 8 {
                        let w = m.weight.as_ptr().add(r * cols);
                        let mut blk = [_mm512_setzero_ps(); T];
                        for c in (c0..c0 + bc).step_by(16) {
                            let v = e4m3x16(_mm_loadu_si128(w.add(c) as *const __m128i));
                            for t in 0..T {
                                blk[t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt[t].add(c)), blk[t]);
                            }
                        }
                        for t in 0..T {
                            acc[t] = _mm512_fmadd_ps(blk[t], s, acc[t]);
                        }
                    } else {
                        let w = m.weight.as_ptr().add(r * cols / 2);
                        for c in (c0..c0 + bc).step_by(16) {
                            let v = _mm512_mul_ps(e2m1x16(w.add(c / 2), lut), s);
                            for t in 0..T {
                                acc[t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt[t].add(c)), acc[t]);
                            }
                        }
                    }
                }
                for t in 0..T {
                    *out.add(t * ldo + r - r0) = _mm512_reduce_add_ps(acc[t]);
                }
            }
        }
    }

    /// Row `r` dequantized into `dst` (`m.cols` f32): each weight times its block's multiplier.
    #[inline(always)]
    unsafe fn decode_row(m: &QMatrix<'_>, r: usize, dst: *mut f32) {
        let (br, bc) = m.format.block();
        // SAFETY: as in `rows`; `dst` holds `m.cols` floats.
        unsafe {
            let lut = _mm512_loadu_ps(E2M1_TABLE.as_ptr());
            for cb in 0..m.cols / bc {
                let s = _mm512_set1_ps(m.block_scale(r / br, cb));
                for c in (cb * bc..(cb + 1) * bc).step_by(16) {
                    let v = if m.format.weight_bits() == 8 {
                        e4m3x16(_mm_loadu_si128(
                            m.weight.as_ptr().add(r * m.cols + c) as *const __m128i
                        ))
                    } else {
                        e2m1x16(m.weight.as_ptr().add((r * m.cols + c) / 2), lut)
                    };
                    _mm512_storeu_ps(dst.add(c), _mm512_mul_ps(v, s));
                }
            }
        }
    }

    /// `out[t * ldo] = w · x[t0 + t]` for T tokens (`w` one dequantized row of `cols` floats).
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        w: *const f32,
        x: *const f32,
        cols: usize,
        t0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: the caller guarantees `cols` floats at w and at each token's row, and the outputs.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); T];
            for c in (0..cols).step_by(16) {
                let wv = _mm512_loadu_ps(w.add(c));
                for t in 0..T {
                    acc[t] =
                        _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.add((t0 + t) * cols + c)), acc[t]);
                }
            }
            for t in 0..T {
                *out.add(t * ldo) = _mm512_reduce_add_ps(acc[t]);
            }
        }
    }

    /// See [`super::gemv`]. Up to 4 tokens: decoded in registers, each row read once. More: each row is
    /// dequantized once into an L1-resident f32 row that every 4-token block then reads, so the weights
    /// still stream from memory once per call.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn gemv(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: *const f32,
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: bounds are the caller's (see the macro).
        unsafe { batch_split!(m, r0, r1, x, n_tok, out, ldo) }
    }
}

#[cfg(target_arch = "x86_64")]
// The token loops index several per-token arrays at once (accumulators, row pointers).
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use super::super::{QMatrix, E2M1_TABLE};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register-only intrinsics.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// 8 e4m3 codes at p -> f32 (as the AVX-512 path).
    #[inline(always)]
    unsafe fn e4m3x8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at p.
        unsafe {
            let i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let mag = _mm256_and_si256(i, _mm256_set1_epi32(0x7F));
            let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(i, _mm256_set1_epi32(0x80)));
            let normal =
                _mm256_add_epi32(_mm256_slli_epi32::<20>(mag), _mm256_set1_epi32(120 << 23));
            let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0 / 512.0));
            let is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
            let v = _mm256_blendv_ps(
                _mm256_castsi256_ps(normal),
                sub,
                _mm256_castsi256_ps(is_sub),
            );
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign))
        }
    }

    /// 4 bytes of packed e2m1 at p -> 8 f32; `mags` holds the 8 magnitudes.
    #[inline(always)]
    unsafe fn e2m1x8(p: *const u8, mags: __m256) -> __m256 {
        // SAFETY: the caller guarantees 4 readable bytes at p.
        unsafe {
            let b = _mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32));
            let lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), _mm_set1_epi8(0x0F));
            let idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            let mag = _mm256_permutevar8x32_ps(mags, idx); // uses idx & 7
            let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(idx, _mm256_set1_epi32(8)));
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign))
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows<const T: usize>(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: *const f32,
        t0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let (br, bc) = m.format.block();
        let cols = m.cols;
        // SAFETY: as in the AVX-512 path, with blocks of 8 columns.
        unsafe {
            let mags = _mm256_loadu_ps(E2M1_TABLE.as_ptr());
            let xt: [*const f32; T] = std::array::from_fn(|t| x.add((t0 + t) * cols));
            for r in r0..r1 {
                let mut acc = [_mm256_setzero_ps(); T];
                for cb in 0..cols / bc {
                    let s = _mm256_set1_ps(m.block_scale(r / br, cb));
                    let c0 = cb * bc;
                    if m.format.weight_bits() == 8 {
                        let w = m.weight.as_ptr().add(r * cols);
                        let mut blk = [_mm256_setzero_ps(); T];
                        for c in (c0..c0 + bc).step_by(8) {
                            let v = e4m3x8(w.add(c));
                            for t in 0..T {
                                blk[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xt[t].add(c)), blk[t]);
                            }
                        }
                        for t in 0..T {
                            acc[t] = _mm256_fmadd_ps(blk[t], s, acc[t]);
                        }
                    } else {
                        let w = m.weight.as_ptr().add(r * cols / 2);
                        for c in (c0..c0 + bc).step_by(8) {
                            let v = _mm256_mul_ps(e2m1x8(w.add(c / 2), mags), s);
                            for t in 0..T {
                                acc[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xt[t].add(c)), acc[t]);
                            }
                        }
                    }
                }
                for t in 0..T {
                    *out.add(t * ldo + r - r0) = hsum(acc[t]);
                }
            }
        }
    }

    /// Row `r` dequantized into `dst` (`m.cols` f32), as the AVX-512 path.
    #[inline(always)]
    unsafe fn decode_row(m: &QMatrix<'_>, r: usize, dst: *mut f32) {
        let (br, bc) = m.format.block();
        // SAFETY: as in `rows`; `dst` holds `m.cols` floats.
        unsafe {
            let mags = _mm256_loadu_ps(E2M1_TABLE.as_ptr());
            for cb in 0..m.cols / bc {
                let s = _mm256_set1_ps(m.block_scale(r / br, cb));
                for c in (cb * bc..(cb + 1) * bc).step_by(8) {
                    let v = if m.format.weight_bits() == 8 {
                        e4m3x8(m.weight.as_ptr().add(r * m.cols + c))
                    } else {
                        e2m1x8(m.weight.as_ptr().add((r * m.cols + c) / 2), mags)
                    };
                    _mm256_storeu_ps(dst.add(c), _mm256_mul_ps(v, s));
                }
            }
        }
    }

    /// `out[t * ldo] = w · x[t0 + t]` for T tokens.
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        w: *const f32,
        x: *const f32,
        cols: usize,
        t0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: the caller guarantees `cols` floats at w and at each token's row, and the outputs.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); T];
            for c in (0..cols).step_by(8) {
                let wv = _mm256_loadu_ps(w.add(c));
                for t in 0..T {
                    acc[t] =
                        _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add((t0 + t) * cols + c)), acc[t]);
                }
            }
            for t in 0..T {
                *out.add(t * ldo) = hsum(acc[t]);
            }
        }
    }

    /// See [`super::gemv`] and the AVX-512 path's split by batch size.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv(
        m: &QMatrix<'_>,
        r0: usize,
        r1: usize,
        x: *const f32,
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: bounds are the caller's (see the macro).
        unsafe { batch_split!(m, r0, r1, x, n_tok, out, ldo) }
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
                let mut want = vec![0f32; n * h];
                expert_forward(Isa::Scalar, &e, &x, n, &mut want);
                for isa in Isa::all_supported() {
                    let mut got = vec![0f32; n * h];
                    expert_forward(isa, &e, &x, n, &mut got);
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-4 * scale,
                            "{} {isa:?} n={n}: {a} vs {b}",
                            format.name()
                        );
                    }
                }
                // A row range of the down projection lands at its offset.
                let mut part = vec![0f32; n * 16];
                let a: Vec<f32> = (0..n * i).map(|_| rng.next_f64() as f32).collect();
                gemv(Isa::detect(), &e.down, 32, 48, &a, n, &mut part, 16);
                let mut full = vec![0f32; n * h];
                gemv(Isa::Scalar, &e.down, 0, h, &a, n, &mut full, h);
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
}
