//! Matrix-vector kernels over bf16 weights: `out[t, r] = Σ_c W[r, c] · x[t, c]`, fp32 accumulation.
//!
//! Variants, chosen at run time ([`Isa::detect`]):
//! - [`Isa::AmxBf16`]: Intel AMX tiles (`tdpbf16ps`, 16x16 fp32 += 16x32 bf16 · 32x16 bf16) for
//!   calls of at least [`AMX_MIN_TOKENS`] tokens; below that, and for rows that do not fill a
//!   16-row tile or `cols` not a multiple of 32, the AVX-512-BF16 path.
//! - [`Isa::Avx512Bf16`]: `vdpbf16ps` on 32 bf16 pairs per instruction; `x` is rounded to bf16
//!   first (the weights are bf16 already), products are exact and summed in fp32.
//! - [`Isa::Avx2`]: weights widened to fp32 (`vpmovzxwd` + shift), `x` in fp32, FMA.
//! - [`Isa::Scalar`]: the reference, fp32 `x`, one row at a time.
//!
//! All three block 4 rows x up to 4 tokens so one pass over a weight row serves every token of
//! the block (the weight block stays in L1 while the token blocks loop), and handle any `cols`
//! (masked / scalar tails). Tests: `cargo test -p freetoken-core cpu::`; bench:
//! `cargo bench -p freetoken-core --bench cpu_kernel`.
use crate::bf16::bf16_to_f32;

/// An instruction-set path of the CPU expert kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable reference.
    Scalar,
    /// AVX2 + FMA (x86-64-v3).
    Avx2,
    /// AVX-512F/BW + AVX512_BF16.
    Avx512Bf16,
    /// AMX-BF16 tiles (with AVX-512-BF16 for small batches and edges).
    AmxBf16,
}

/// Fewest tokens per call for which the AMX path is used (below, AVX-512-BF16 is as fast or
/// faster: the call is bound by memory, and a 16-token tile would be mostly padding). On the
/// H200 box (15 threads, Qwen3-30B-A3B experts, every token routed to each of n experts) AVX-512
/// with its prefetch beat AMX at 4 tokens too (136-139 / 302-309 / 753-814 us for n = 1 / 3 / 8
/// against 239-242 / 380-390 / 781-846), but with a threshold of 8 some of the demo model's expert
/// calls took the other rounding, and the log-probabilities of an `n = 2` request then differed
/// from those of `n = 1` (tests/test_server_logprobs.py); so it stays at 4, where that test holds.
pub const AMX_MIN_TOKENS: usize = 4;

impl Isa {
    /// Name as used by the Python API: `scalar`, `avx2`, `avx512_bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512Bf16 => "avx512_bf16",
            Self::AmxBf16 => "amx_bf16",
        }
    }

    /// Parses [`Isa::name`].
    pub fn from_name(s: &str) -> Option<Self> {
        [Self::Scalar, Self::Avx2, Self::Avx512Bf16, Self::AmxBf16]
            .into_iter()
            .find(|i| i.name() == s)
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Bf16 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Self::AmxBf16 => Self::Avx512Bf16.supported() && amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path this CPU supports, slowest first.
    pub fn all_supported() -> Vec<Self> {
        [Self::Scalar, Self::Avx2, Self::Avx512Bf16, Self::AmxBf16]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }

    /// The fastest supported path.
    pub fn detect() -> Self {
        *Self::all_supported().last().unwrap_or(&Self::Scalar)
    }

    /// Whether the path reads activations as bf16 (else fp32).
    pub fn wants_bf16(self) -> bool {
        matches!(self, Self::Avx512Bf16 | Self::AmxBf16)
    }
}

/// Activations of `n_tok` tokens, `[n_tok, cols]` row-major, in the format the path wants.
#[derive(Clone, Copy)]
pub enum Act<'a> {
    /// fp32 (scalar, AVX2).
    F32(&'a [f32]),
    /// bf16 bits (AVX-512-BF16).
    Bf16(&'a [u16]),
}

/// `out[t * ldo + (r - r0)] = Σ_c w[r * cols + c] · x[t * cols + c]` for `r in r0..r1`, `t < n_tok`.
///
/// `w` holds the whole `[rows, cols]` matrix; `x` must match `isa.wants_bf16()`.
/// Panics (via slice indexing) if the slices are too short; never reads out of bounds.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    isa: Isa,
    w: &[u16],
    cols: usize,
    r0: usize,
    r1: usize,
    x: Act<'_>,
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    assert!(r1 * cols <= w.len() && r0 <= r1);
    assert!(n_tok == 0 || (n_tok - 1) * ldo + (r1 - r0) <= out.len());
    match (isa, x) {
        #[cfg(target_arch = "x86_64")]
        (Isa::AmxBf16, Act::Bf16(x))
            if n_tok >= AMX_MIN_TOKENS
                && cols.is_multiple_of(32)
                && r1 - r0 >= 16
                && isa.supported() =>
        {
            assert!(n_tok * cols <= x.len());
            // SAFETY: AMX support and permission checked; bounds asserted above.
            let done =
                unsafe { amx::gemv(w.as_ptr(), cols, r0, r1, x, n_tok, out.as_mut_ptr(), ldo) };
            if done < r1 {
                // SAFETY: AVX-512-BF16 is implied by AMX support here; same bounds.
                unsafe {
                    avx512::gemv(
                        w.as_ptr(),
                        cols,
                        done,
                        r1,
                        x.as_ptr(),
                        n_tok,
                        out.as_mut_ptr().add(done - r0),
                        ldo,
                    )
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Bf16 | Isa::AmxBf16, Act::Bf16(x)) if Isa::Avx512Bf16.supported() => {
            assert!(n_tok * cols <= x.len());
            // SAFETY: feature support checked; bounds asserted above.
            unsafe {
                avx512::gemv(
                    w.as_ptr(),
                    cols,
                    r0,
                    r1,
                    x.as_ptr(),
                    n_tok,
                    out.as_mut_ptr(),
                    ldo,
                )
            }
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Act::F32(x)) if isa.supported() => {
            assert!(n_tok * cols <= x.len());
            // SAFETY: feature support checked; bounds asserted above.
            unsafe {
                avx2::gemv(
                    w.as_ptr(),
                    cols,
                    r0,
                    r1,
                    x.as_ptr(),
                    n_tok,
                    out.as_mut_ptr(),
                    ldo,
                )
            }
        }
        (_, Act::F32(x)) => scalar(w, cols, r0, r1, x, n_tok, out, ldo),
        (_, Act::Bf16(x)) => {
            let xf: Vec<f32> = x.iter().map(|&v| bf16_to_f32(v)).collect();
            scalar(w, cols, r0, r1, &xf, n_tok, out, ldo)
        }
    }
}

/// The reference: one row, one token at a time, fp32.
#[allow(clippy::too_many_arguments)]
fn scalar(
    w: &[u16],
    cols: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    ldo: usize,
) {
    for r in r0..r1 {
        let row = &w[r * cols..(r + 1) * cols];
        for t in 0..n_tok {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut acc = 0.0f32;
            for c in 0..cols {
                acc += bf16_to_f32(row[c]) * xt[c];
            }
            out[t * ldo + r - r0] = acc;
        }
    }
}

/// Defines `rows` and `gemv` of a SIMD module around its `block::<R, T>` kernel: rows in blocks
/// of 4 (then 1), tokens in blocks of `$tmax` (then the 3/2/1 remainder); `$xt` is the activation
/// element type and `$features` the target features of `gemv`.
///
/// While a block of rows streams, `block` prefetches the next block of the call's rows into L2
/// (`pf`, null after the last one): a row of a decode expert is 1.5-4 KiB, so each block starts
/// new 4 KiB pages, where the hardware prefetchers stop and must find the stream again.
#[cfg(target_arch = "x86_64")]
macro_rules! blocked_gemv {
    ($xt:ty, $tmax:literal, $features:literal) => {
        #[inline(always)]
        #[allow(unused_assignments, clippy::too_many_arguments)]
        unsafe fn rows<const R: usize>(
            w: *const u16,
            cols: usize,
            r: usize,
            pf: *const u16,
            x: *const $xt,
            n_tok: usize,
            out: *mut f32,
            ldo: usize,
            o: usize,
        ) {
            // SAFETY: forwarded bounds from `gemv`; `pf` is only prefetched, never read.
            unsafe {
                let wp: [*const u16; R] = std::array::from_fn(|i| w.add((r + i) * cols));
                let mut t = 0;
                macro_rules! tok {
                    ($t:literal) => {{
                        let xp: [*const $xt; $t] = std::array::from_fn(|j| x.add((t + j) * cols));
                        let v = block::<R, $t>(wp, xp, cols, pf);
                        for j in 0..$t {
                            for i in 0..R {
                                *out.add((t + j) * ldo + o + i) = v[j][i];
                            }
                        }
                        t += $t;
                    }};
                }
                while t + $tmax <= n_tok {
                    tok!($tmax);
                }
                match n_tok - t {
                    3 => tok!(3),
                    2 => tok!(2),
                    1 => tok!(1),
                    _ => {}
                }
            }
        }

        /// See [`super::gemv`].
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn gemv(
            w: *const u16,
            cols: usize,
            r0: usize,
            r1: usize,
            x: *const $xt,
            n_tok: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let mut r = r0;
            // SAFETY: rows r0..r1 of w and n_tok rows of x are in bounds (asserted by the caller).
            unsafe {
                while r + 4 <= r1 {
                    let pf = if r + 8 <= r1 {
                        w.wrapping_add((r + 4) * cols)
                    } else {
                        std::ptr::null()
                    };
                    rows::<4>(w, cols, r, pf, x, n_tok, out, ldo, r - r0);
                    r += 4;
                }
                while r < r1 {
                    rows::<1>(w, cols, r, std::ptr::null(), x, n_tok, out, ldo, r - r0);
                    r += 1;
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// R rows x T tokens block; `out[t][r]`.
    #[inline(always)]
    unsafe fn block<const R: usize, const T: usize>(
        w: [*const u16; R],
        x: [*const u16; T],
        cols: usize,
        pf: *const u16,
    ) -> [[f32; R]; T] {
        // SAFETY: the caller guarantees `cols` readable elements behind every pointer; the tail
        // uses masked loads, which do not touch masked-off bytes; `pf` is only prefetched.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); R]; T];
            let mut c = 0;
            while c + 32 <= cols {
                let mut wv = [_mm512_setzero_si512(); R];
                for r in 0..R {
                    wv[r] = _mm512_loadu_si512(w[r].add(c) as *const _);
                }
                if !pf.is_null() {
                    // One 64-byte line of each next row per step (32 bf16).
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(r * cols + c) as *const i8);
                    }
                }
                for t in 0..T {
                    let xv: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(x[t].add(c) as *const _));
                    for r in 0..R {
                        acc[t][r] = _mm512_dpbf16_ps(
                            acc[t][r],
                            std::mem::transmute::<__m512i, __m512bh>(wv[r]),
                            xv,
                        );
                    }
                }
                c += 32;
            }
            if c < cols {
                let m: __mmask32 = (1u32 << (cols - c)) - 1;
                let mut wv = [_mm512_setzero_si512(); R];
                for r in 0..R {
                    wv[r] = _mm512_maskz_loadu_epi16(m, w[r].add(c) as *const i16);
                }
                for t in 0..T {
                    let xv: __m512bh =
                        std::mem::transmute(_mm512_maskz_loadu_epi16(m, x[t].add(c) as *const i16));
                    for r in 0..R {
                        acc[t][r] = _mm512_dpbf16_ps(
                            acc[t][r],
                            std::mem::transmute::<__m512i, __m512bh>(wv[r]),
                            xv,
                        );
                    }
                }
            }
            let mut out = [[0.0f32; R]; T];
            for t in 0..T {
                for r in 0..R {
                    out[t][r] = _mm512_reduce_add_ps(acc[t][r]);
                }
            }
            out
        }
    }

    blocked_gemv!(u16, 4, "avx512f,avx512bw,avx512bf16");
}

#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    use std::sync::OnceLock;

    /// Whether the CPU has AMX-TILE + AMX-BF16 and the kernel lets this process use tile data
    /// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked once).
    pub fn available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            let max = std::arch::x86_64::__cpuid(0).eax;
            if max < 7 {
                return false;
            }
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            let (bf16, tile) = (edx & (1 << 22) != 0, edx & (1 << 24) != 0);
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain syscall with integer arguments; failure is reported by its result.
            bf16 && tile
                && unsafe {
                    libc::syscall(
                        libc::SYS_arch_prctl,
                        ARCH_REQ_XCOMP_PERM,
                        XFEATURE_XTILEDATA,
                    )
                } == 0
        })
    }

    /// The 64-byte tile configuration (palette 1): tiles 0..7 all 16 rows x 64 bytes, 8..15 unused.
    #[repr(C, align(64))]
    struct TileCfg {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    thread_local! {
        /// Per thread: x packed in pairs `[cols/2][16 tokens]` u32, and the C tiles' spill area.
        static SCRATCH: std::cell::RefCell<(Vec<u32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }

    /// Rows `r0..done` of `out` (multiples of 16 rows); returns `done`. See [`super::gemv`].
    ///
    /// Tiles: C0, C1 = tmm0, tmm1 (32 weight rows x 16 tokens, fp32), A = tmm4/tmm5 (16 weight
    /// rows x 32 cols, straight from the row-major weights), B = tmm6 (x in pairs: 16 rows of
    /// 32-bit (c, c+1) pairs x 16 tokens). `C[r][t] += Σ_c W[r][c] · x[t][c]`. Two C tiles (32
    /// weight rows in flight), not four: each weight row is one memory stream, and 64 streams per
    /// core overrun the hardware prefetcher (measured on the device: +5-8 % at batch 4 and 16).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv(
        w: *const u16,
        cols: usize,
        r0: usize,
        r1: usize,
        x: &[u16],
        n_tok: usize,
        out: *mut f32,
        ldo: usize,
    ) -> usize {
        let full = r0 + (r1 - r0) / 16 * 16;
        // Palette 1 has 8 tiles; the entries of tiles 8..15 must be zero or ldtilecfg faults.
        let mut cfg = TileCfg {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        cfg.colsb[..8].fill(64);
        cfg.rows[..8].fill(16);
        let ws = cols * 2; // weight row stride, bytes
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let (xv, ct) = &mut *s;
            xv.resize(cols / 2 * 16, 0);
            ct.resize(32 * 16, 0.0);
            // SAFETY: the CPU supports AMX and the process has permission (checked by the caller
            // through `Isa::supported`); `cfg` is a valid palette-1 configuration.
            unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileCfg, options(nostack, readonly)) };
            for t0 in (0..n_tok).step_by(16) {
                let nt = (n_tok - t0).min(16);
                for c2 in 0..cols / 2 {
                    for t in 0..16 {
                        xv[c2 * 16 + t] = if t < nt {
                            let b = (t0 + t) * cols + 2 * c2;
                            x[b] as u32 | ((x[b + 1] as u32) << 16)
                        } else {
                            0
                        };
                    }
                }
                let mut r = r0;
                while r < full {
                    let nb = ((full - r) / 16).min(2);
                    // The next block's rows, prefetched into L2 while this one streams (as in
                    // `blocked_gemv`: each block starts new 4 KiB pages).
                    let next = (full - r - nb * 16).min(nb * 16);
                    // SAFETY: every tile load reads 16 rows of 64 bytes: weight rows r..r+16·nb
                    // (< r1) at columns c..c+32 (< cols), and xv rows c/2..c/2+16 (< cols/2);
                    // prefetches read nothing.
                    unsafe {
                        asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                        let wr = w.add(r * cols);
                        let pf = wr.wrapping_add(nb * 16 * cols);
                        for c in (0..cols).step_by(32) {
                            for i in 0..next {
                                _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(i * cols + c) as *const i8);
                            }
                            let xb = xv.as_ptr().add(c / 2 * 16);
                            let a = wr.add(c);
                            asm!(
                                "tileloadd tmm6, [{xb} + {xs}*1]",
                                "tileloadd tmm4, [{a} + {ws}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                xb = in(reg) xb, xs = in(reg) 64usize, a = in(reg) a, ws = in(reg) ws,
                                options(nostack, readonly)
                            );
                            if nb == 2 {
                                asm!(
                                    "tileloadd tmm5, [{a} + {ws}*1]",
                                    "tdpbf16ps tmm1, tmm5, tmm6",
                                    a = in(reg) a.add(16 * cols), ws = in(reg) ws,
                                    options(nostack, readonly)
                                );
                            }
                        }
                        let cp = ct.as_mut_ptr();
                        asm!(
                            "tilestored [{c0} + {s}*1], tmm0",
                            "tilestored [{c1} + {s}*1], tmm1",
                            c0 = in(reg) cp, c1 = in(reg) cp.add(256), s = in(reg) 64usize,
                            options(nostack)
                        );
                        for i in 0..nb * 16 {
                            for t in 0..nt {
                                *out.add((t0 + t) * ldo + (r - r0) + i) = ct[i * 16 + t];
                            }
                        }
                    }
                    r += nb * 16;
                }
            }
            // SAFETY: releases this thread's tile state.
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
        });
        full
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn widen(p: *const u16) -> __m256 {
        // SAFETY: caller guarantees 8 readable u16 at p.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
                16,
            ))
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register-only intrinsics.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }

    #[inline(always)]
    unsafe fn block<const R: usize, const T: usize>(
        w: [*const u16; R],
        x: [*const f32; T],
        cols: usize,
        pf: *const u16,
    ) -> [[f32; R]; T] {
        // SAFETY: `cols` readable elements behind each pointer; the vector loop stops at the
        // last full 8-element group and the tail is scalar; `pf` is only prefetched.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); R]; T];
            let mut c = 0;
            while c + 8 <= cols {
                let mut wv = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    wv[r] = widen(w[r].add(c));
                }
                if !pf.is_null() && c.is_multiple_of(32) {
                    // One 64-byte line of each next row per 32 bf16.
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(r * cols + c) as *const i8);
                    }
                }
                for t in 0..T {
                    let xv = _mm256_loadu_ps(x[t].add(c));
                    for r in 0..R {
                        acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
                    }
                }
                c += 8;
            }
            let mut out = [[0.0f32; R]; T];
            for t in 0..T {
                for r in 0..R {
                    let mut s = hsum(acc[t][r]);
                    for cc in c..cols {
                        s += f32::from_bits((*w[r].add(cc) as u32) << 16) * *x[t].add(cc);
                    }
                    out[t][r] = s;
                }
            }
            out
        }
    }

    blocked_gemv!(f32, 3, "avx2,fma");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::f32_to_bf16;
    use crate::pool::SplitMix64;

    #[test]
    fn every_path_matches_scalar() {
        let mut rng = SplitMix64::new(3);
        // (83, 64, 17) and (40, 96, 5) exercise AMX: 16-row tiles, 4/2/1-tile blocks, row and token tails.
        for &(rows, cols, n_tok) in &[
            (1, 1, 1),
            (7, 33, 5),
            (13, 511, 4),
            (8, 64, 9),
            (5, 100, 2),
            (83, 64, 17),
            (40, 96, 5),
            (128, 256, 33),
        ] {
            let w: Vec<u16> = (0..rows * cols)
                .map(|_| f32_to_bf16(rng.next_f64() as f32 - 0.5))
                .collect();
            let x: Vec<f32> = (0..n_tok * cols)
                .map(|_| rng.next_f64() as f32 - 0.5)
                .collect();
            let xb: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|&v| bf16_to_f32(v)).collect();
            let (r0, r1) = (rows / 3, rows);
            let ldo = rows + 3;
            let mut want = vec![0.0; n_tok * ldo];
            scalar(&w, cols, r0, r1, &xr, n_tok, &mut want, ldo);
            for isa in Isa::all_supported() {
                let mut got = vec![0.0; n_tok * ldo];
                let act = if isa.wants_bf16() {
                    Act::Bf16(&xb)
                } else {
                    Act::F32(&xr)
                };
                gemv(isa, &w, cols, r0, r1, act, n_tok, &mut got, ldo);
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()) * (cols as f32).sqrt(),
                        "{isa:?} {rows}x{cols}x{n_tok}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
