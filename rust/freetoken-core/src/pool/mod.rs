//! The host expert pool: every routed expert of every MoE layer, packed in one arena.
//!
//! Owns: the arena (one 2 MiB-aligned anonymous mapping, [`arena::Arena`]), its layout, and the
//! two ways to fill it: from a checkpoint ([`checkpoint`]) or with deterministic random weights.
//! Not: pinning with CUDA (Python registers `(ptr, nbytes)`), the GPU slots (see [`crate::cache`]).
//!
//! Layout, `[layer][expert]{gate_up, down, scales}`, each expert contiguous so one copy moves it:
//! ```text
//! arena ─┬─ layer 0 ─┬─ expert 0: gate_up [2I, H] (gate rows 0..I, up rows I..2I) │ down [H, I] │ scales │ pad
//!        │           ├─ expert 1: ...
//!        ├─ layer 1 ─ ...
//! ```
//! in the pool's [`ExpertFormat`] (bf16: no scales; quantized formats: see [`crate::quant`]).
//! `layer` everywhere in this module is the *pool* layer: an index into [`PoolShape::moe_layers`],
//! which lists the model layer of each pool layer. The stride between experts is
//! `expert_nbytes` rounded up to [`EXPERT_ALIGN`] bytes.
pub mod arena;
pub mod checkpoint;

use crate::bf16::f32_to_bf16;
use crate::error::PoolError;
use crate::numa;
use crate::quant::ExpertFormat;
use arena::Arena;

/// Alignment of every expert inside the arena, in bytes (DMA- and AVX-512-friendly).
pub const EXPERT_ALIGN: usize = 256;

/// The shape of the pool: which model layers are MoE layers and the size of one expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolShape {
    /// Model layer index of each pool layer, strictly increasing.
    pub moe_layers: Vec<usize>,
    /// Routed experts per MoE layer (E).
    pub num_experts: usize,
    /// Model hidden size (H, `hidden_size`).
    pub hidden_size: usize,
    /// Expert intermediate size (I, `moe_intermediate_size`).
    pub intermediate_size: usize,
    /// How each expert's weights are stored (bf16, or a quantized format with its scales).
    pub format: ExpertFormat,
}

impl PoolShape {
    /// Checks that every size is positive and `moe_layers` is strictly increasing.
    pub fn validate(&self) -> Result<(), PoolError> {
        if self.moe_layers.is_empty()
            || self.num_experts == 0
            || self.hidden_size == 0
            || self.intermediate_size == 0
        {
            return Err(PoolError::Config(format!(
                "every size must be positive: {} MoE layers, {} experts, hidden_size {}, intermediate_size {}",
                self.moe_layers.len(),
                self.num_experts,
                self.hidden_size,
                self.intermediate_size
            )));
        }
        if self.moe_layers.windows(2).any(|w| w[0] >= w[1]) {
            return Err(PoolError::Config(format!(
                "moe_layers must be strictly increasing, got {:?}",
                self.moe_layers
            )));
        }
        self.format
            .check_shape(self.hidden_size, self.intermediate_size)?;
        if self.num_experts > u16::MAX as usize {
            return Err(PoolError::Config(format!(
                "num_experts {} exceeds 65535",
                self.num_experts
            )));
        }
        Ok(())
    }

    /// Bytes of one expert's weights and scales: `3 * I * H * 2` for bf16 (gate, up, down).
    pub fn expert_nbytes(&self) -> usize {
        self.format
            .layout(self.hidden_size, self.intermediate_size)
            .expert_nbytes
    }

    /// Distance between consecutive experts in the arena, in bytes.
    pub fn expert_stride(&self) -> usize {
        self.expert_nbytes().next_multiple_of(EXPERT_ALIGN)
    }

    /// Bytes of all experts, with their padding (before rounding the arena up to 2 MiB).
    pub fn experts_nbytes(&self) -> usize {
        self.moe_layers.len() * self.num_experts * self.expert_stride()
    }
}

/// Borrowed weights of one expert, bf16 bit patterns.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// `concat(gate_proj.weight, up_proj.weight)`: `[2I, H]` row-major.
    pub gate_up: &'a [u16],
    /// `down_proj.weight`: `[H, I]` row-major.
    pub down: &'a [u16],
}

/// All routed experts, in host RAM. Immutable once built; cheap to share behind an `Arc`.
pub struct ExpertPool {
    shape: PoolShape,
    arena: Arena,
}

impl ExpertPool {
    /// Maps an (untouched, zeroed) arena for `shape`.
    fn alloc(shape: PoolShape) -> Result<Self, PoolError> {
        shape.validate()?;
        let arena = Arena::new(shape.experts_nbytes())?;
        Ok(Self { shape, arena })
    }

    /// A zeroed pool for `shape`, to be filled through its arena (quantized checkpoints' experts
    /// are packed by Python, `freetoken.quant.checkpoint.fill_quantized_pool`).
    pub fn zeroed(shape: PoolShape) -> Result<Self, PoolError> {
        Self::alloc(shape)
    }

    /// Builds a pool of deterministic random weights (same `seed` and shape, same bytes).
    ///
    /// Values are uniform in `±1/sqrt(fan_in)` (fan_in = H for gate/up, I for down), rounded to
    /// bf16; in a quantized format, uniformly drawn codes (no NaN) with scales that give the same
    /// root mean square ([`fill_quantized`]), so a dummy-weights model runs at the real byte
    /// sizes. Filled by `num_threads` threads (default: all allowed CPUs), each bound to a NUMA node
    /// in turn, each touching the pages it fills first.
    pub fn random(
        shape: PoolShape,
        seed: u64,
        num_threads: Option<usize>,
    ) -> Result<Self, PoolError> {
        let pool = Self::alloc(shape)?;
        let layout = pool.format().layout(pool.hidden_size(), pool.intermediate_size());
        let total = pool.num_layers() * pool.num_experts();
        let threads = num_threads
            .unwrap_or_else(|| numa::allowed_cpus().len())
            .clamp(1, total);
        let nodes = numa::nodes();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let (h, i) = (pool.shape.hidden_size, pool.shape.intermediate_size);
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (pool, next, nodes) = (&pool, &next, &nodes);
                    s.spawn(move || {
                        if nodes.len() > 1 {
                            numa::bind_current_thread(&nodes[t % nodes.len()].cpus);
                        }
                        loop {
                            // ORDERING: a plain work counter; no data is published through it.
                            let idx = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if idx >= total {
                                break;
                            }
                            let (l, e) = (idx / pool.num_experts(), idx % pool.num_experts());
                            let mut rng = SplitMix64::new(
                                seed ^ (idx as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                            );
                            if pool.format() != ExpertFormat::Bf16 {
                                // SAFETY: as below.
                                let bytes = unsafe { pool.expert_bytes_mut(l, e) };
                                fill_quantized(&layout, bytes, &mut rng);
                                continue;
                            }
                            // SAFETY: each (l, e) is claimed by exactly one thread through `next`,
                            // so the ranges written are disjoint; the arena outlives the scope.
                            let w = unsafe { pool.expert_mut(l, e) };
                            let (gate_up, down) = w.split_at_mut(2 * i * h);
                            fill_uniform(gate_up, 1.0 / (h as f32).sqrt(), &mut rng);
                            fill_uniform(down, 1.0 / (i as f32).sqrt(), &mut rng);
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect::<Vec<_>>()
        });
        if result.iter().any(|r| r.is_err()) {
            return Err(PoolError::Internal("a random-fill thread panicked".into()));
        }
        Ok(pool)
    }

    /// The pool's shape.
    pub fn shape(&self) -> &PoolShape {
        &self.shape
    }

    /// Number of MoE layers held (pool layers).
    pub fn num_layers(&self) -> usize {
        self.shape.moe_layers.len()
    }

    /// Routed experts per layer.
    pub fn num_experts(&self) -> usize {
        self.shape.num_experts
    }

    /// Hidden size H.
    pub fn hidden_size(&self) -> usize {
        self.shape.hidden_size
    }

    /// Expert intermediate size I.
    pub fn intermediate_size(&self) -> usize {
        self.shape.intermediate_size
    }

    /// Model layer index of each pool layer.
    pub fn moe_layers(&self) -> &[usize] {
        &self.shape.moe_layers
    }

    /// The experts' format.
    pub fn format(&self) -> ExpertFormat {
        self.shape.format
    }

    /// Bytes of one expert (weights and scales; `3 * I * H * 2` for bf16), without padding.
    pub fn expert_nbytes(&self) -> usize {
        self.shape.expert_nbytes()
    }

    /// Base address of the arena (2 MiB aligned), for `cudaHostRegister`.
    pub fn ptr(&self) -> *const u8 {
        self.arena.ptr()
    }

    /// Length of the arena mapping in bytes (expert bytes + padding, rounded up to 2 MiB).
    pub fn nbytes(&self) -> usize {
        self.arena.len()
    }

    /// The pool layer holding model layer `model_layer`.
    pub fn layer_index(&self, model_layer: i64) -> Result<usize, PoolError> {
        usize::try_from(model_layer)
            .ok()
            .and_then(|m| self.shape.moe_layers.binary_search(&m).ok())
            .ok_or_else(|| PoolError::NotMoeLayer {
                model_layer,
                moe_layers: self.shape.moe_layers.clone(),
            })
    }

    /// Checks `(layer, expert)` and returns them as `usize`.
    pub fn check(&self, layer: i64, expert: i64) -> Result<(usize, usize), PoolError> {
        if layer < 0 || layer as usize >= self.num_layers() {
            return Err(PoolError::LayerIndex {
                layer,
                num_layers: self.num_layers(),
            });
        }
        if expert < 0 || expert as usize >= self.num_experts() {
            return Err(PoolError::ExpertIndex {
                expert,
                num_experts: self.num_experts(),
            });
        }
        Ok((layer as usize, expert as usize))
    }

    /// Byte offset of `(layer, expert)` from the arena base (unchecked).
    fn offset(&self, layer: usize, expert: usize) -> usize {
        (layer * self.shape.num_experts + expert) * self.shape.expert_stride()
    }

    /// `(address, nbytes)` of one expert, checked.
    pub fn expert_ptr(&self, layer: i64, expert: i64) -> Result<(*const u8, usize), PoolError> {
        let (l, e) = self.check(layer, expert)?;
        // SAFETY: offset + expert_nbytes <= experts_nbytes <= arena length for checked indices.
        Ok((
            unsafe { self.arena.ptr().add(self.offset(l, e)) },
            self.expert_nbytes(),
        ))
    }

    /// Weights of one expert of a bf16 pool, checked (a quantized pool's: [`ExpertPool::expert_bytes`]).
    pub fn expert(&self, layer: i64, expert: i64) -> Result<ExpertWeights<'_>, PoolError> {
        let (l, e) = self.check(layer, expert)?;
        if self.format() != ExpertFormat::Bf16 {
            return Err(PoolError::Config(format!(
                "the pool holds {} experts, not bf16 weights",
                self.format().name()
            )));
        }
        Ok(self.expert_unchecked(l, e))
    }

    /// The bytes of one expert (`expert_nbytes`, any format), checked.
    pub fn expert_bytes(&self, layer: i64, expert: i64) -> Result<&[u8], PoolError> {
        let (p, n) = self.expert_ptr(layer, expert)?;
        // SAFETY: `expert_ptr` checked the indices; the range lies inside the arena, which is
        // immutable once built and lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// Weights of one expert of a bf16 pool; panics (debug) or reads another expert (release) on
    /// bad indices or a quantized pool.
    pub fn expert_unchecked(&self, layer: usize, expert: usize) -> ExpertWeights<'_> {
        debug_assert!(layer < self.num_layers() && expert < self.num_experts());
        debug_assert!(self.format() == ExpertFormat::Bf16);
        let (h, i) = (self.shape.hidden_size, self.shape.intermediate_size);
        let n = 3 * i * h;
        // SAFETY: the range lies inside the arena (see `expert_ptr`); offsets are multiples of
        // EXPERT_ALIGN so the u16 pointer is aligned; the pool is immutable once built.
        let all = unsafe {
            std::slice::from_raw_parts(
                self.arena.ptr().add(self.offset(layer, expert)) as *const u16,
                n,
            )
        };
        let (gate_up, down) = all.split_at(2 * i * h);
        ExpertWeights { gate_up, down }
    }

    /// Mutable bytes of one expert (`expert_nbytes`, any format), for the builders.
    ///
    /// # Safety
    /// As [`ExpertPool::expert_mut`].
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn expert_bytes_mut(&self, layer: usize, expert: usize) -> &mut [u8] {
        debug_assert!(layer < self.num_layers() && expert < self.num_experts());
        // SAFETY: the expert's bytes lie inside the arena (offset + expert_nbytes <= its length
        // for in-range indices); exclusivity is the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.ptr().add(self.offset(layer, expert)),
                self.expert_nbytes(),
            )
        }
    }

    /// Mutable bf16 view of one expert, for the builders.
    ///
    /// # Safety
    /// The caller must be the only one accessing this expert while the slice lives, and the pool
    /// must not yet be shared with readers.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn expert_mut(&self, layer: usize, expert: usize) -> &mut [u16] {
        let n = 3 * self.shape.intermediate_size * self.shape.hidden_size;
        // SAFETY: in bounds as in `expert_unchecked`; exclusivity is the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.ptr().add(self.offset(layer, expert)) as *mut u16,
                n,
            )
        }
    }
}

/// Fills one quantized expert's bytes (`layout`): weight codes drawn uniformly (e4m3 NaN codes
/// moved to their neighbour), every block scale one value chosen so the dequantized weights' root
/// mean square is bf16 [`ExpertPool::random`]'s, `1/sqrt(3 fan_in)`. Padding stays zero.
fn fill_quantized(layout: &crate::quant::ExpertLayout, bytes: &mut [u8], rng: &mut SplitMix64) {
    use crate::quant::{e4m3_to_f32, ScaleType, E2M1_TABLE};
    let f = layout.format;
    for (o, n) in [layout.gate_up, layout.down] {
        for chunk in bytes[o..o + n].chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            for (d, v) in chunk.iter_mut().zip(r) {
                *d = if f.weight_bits() == 8 && v & 0x7F == 0x7F {
                    v ^ 1
                } else {
                    v
                };
            }
        }
    }
    // Root mean square of the codes drawn: e4m3 over its 254 finite codes, e2m1 over its 16.
    let code_rms = if f.weight_bits() == 8 {
        let sq: f32 = (0..=255u8)
            .filter(|c| c & 0x7F != 0x7F)
            .map(|c| e4m3_to_f32(c).powi(2))
            .sum();
        (sq / 254.0).sqrt()
    } else {
        (E2M1_TABLE.iter().map(|v| v * v).sum::<f32>() / 16.0).sqrt()
    };
    let (h, i) = (layout.hidden, layout.inter);
    let put_f32 = |bytes: &mut [u8], o: usize, v: f32| bytes[o..o + 4].copy_from_slice(&v.to_le_bytes());
    for ((o, n), fan_in, tensors) in [(layout.gate_up_scale, h, 0..2), (layout.down_scale, i, 2..3)] {
        let multiplier = 1.0 / (3.0 * fan_in as f32).sqrt() / code_rms;
        match f.scale_type() {
            ScaleType::F32 => (0..n / 4).for_each(|j| put_f32(bytes, o + 4 * j, multiplier)),
            // The block scale 1.0 (e4m3 0x38); the multiplier goes to the tensor scales below.
            ScaleType::E4m3 => bytes[o..o + n].fill(0x38),
            // The nearest power of two.
            ScaleType::E8m0 => bytes[o..o + n].fill((127.0 + multiplier.log2().round()) as u8),
            ScaleType::None => {}
        }
        if layout.tensor_scale.1 > 0 {
            // (gate, up) for gate_up, (down) for down.
            for t in tensors {
                put_f32(bytes, layout.tensor_scale.0 + 4 * t, multiplier);
            }
        }
    }
}

/// SplitMix64: a tiny, fast, deterministic generator (Steele, Lea, Flood 2014).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (n > 0).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Fills `dst` with bf16 values uniform in `±scale`, four values per 64 random bits.
fn fill_uniform(dst: &mut [u16], scale: f32, rng: &mut SplitMix64) {
    let k = scale / 32768.0;
    for chunk in dst.chunks_mut(4) {
        let r = rng.next_u64();
        for (j, d) in chunk.iter_mut().enumerate() {
            *d = f32_to_bf16(((r >> (16 * j)) as u16 as i16) as f32 * k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> PoolShape {
        PoolShape {
            moe_layers: vec![1, 3],
            num_experts: 4,
            hidden_size: 33,
            intermediate_size: 17,
            format: ExpertFormat::Bf16,
        }
    }

    #[test]
    fn random_is_deterministic_and_in_bounds() {
        let a = ExpertPool::random(shape(), 7, Some(2)).unwrap();
        let b = ExpertPool::random(shape(), 7, Some(1)).unwrap();
        let c = ExpertPool::random(shape(), 8, Some(1)).unwrap();
        assert_eq!(a.expert(1, 3).unwrap().down, b.expert(1, 3).unwrap().down);
        assert_ne!(a.expert(1, 3).unwrap().down, c.expert(1, 3).unwrap().down);
        assert_eq!(a.ptr() as usize % arena::ARENA_ALIGN, 0);
        let (p0, n) = a.expert_ptr(0, 1).unwrap();
        assert_eq!(n, 3 * 33 * 17 * 2);
        assert_eq!(p0 as usize - a.ptr() as usize, shape().expert_stride());
        assert!(matches!(
            a.expert_ptr(2, 0),
            Err(PoolError::LayerIndex { .. })
        ));
        assert!(matches!(
            a.expert_ptr(0, -1),
            Err(PoolError::ExpertIndex { .. })
        ));
        assert_eq!(a.layer_index(3).unwrap(), 1);
        assert!(a.layer_index(2).is_err());
        let max = a
            .expert(0, 0)
            .unwrap()
            .gate_up
            .iter()
            .map(|&x| crate::bf16::bf16_to_f32(x).abs())
            .fold(0.0, f32::max);
        assert!(max > 0.0 && max <= 1.0 / 33f32.sqrt() * 1.01);
    }

    #[test]
    fn quantized_pools_use_the_format_sizes() {
        let mut s = shape();
        s.hidden_size = 64;
        s.intermediate_size = 32;
        s.format = ExpertFormat::Nvfp4;
        let pool = ExpertPool::zeroed(s.clone()).unwrap();
        let layout = ExpertFormat::Nvfp4.layout(64, 32);
        assert_eq!(pool.expert_nbytes(), layout.expert_nbytes);
        assert_eq!(
            pool.expert_nbytes(),
            3 * 64 * 32 / 2 + 3 * 64 * 32 / 16 + 12
        );
        let (p1, _) = pool.expert_ptr(0, 1).unwrap();
        assert_eq!(p1 as usize - pool.ptr() as usize, s.expert_stride());
        assert_eq!(pool.expert_bytes(1, 3).unwrap().len(), layout.expert_nbytes);
        assert!(pool.expert(0, 0).is_err());
        s.intermediate_size = 24; // not a whole number of 16-element blocks
        assert!(ExpertPool::zeroed(s).is_err());
    }

    #[test]
    fn random_quantized_pools_have_bf16_magnitudes() {
        let fp8 = ExpertFormat::Fp8Block {
            block_rows: 32,
            block_cols: 32,
        };
        for format in [fp8, ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let mut s = shape();
            (s.hidden_size, s.intermediate_size, s.format) = (128, 64, format);
            let pool = ExpertPool::random(s.clone(), 7, Some(2)).unwrap();
            let layout = format.layout(128, 64);
            let q = layout.expert(pool.expert_bytes(1, 2).unwrap()).unwrap();
            for (m, fan_in) in [(q.gate, 128f32), (q.up, 128.0), (q.down, 64.0)] {
                let v: Vec<f32> = (0..m.rows)
                    .flat_map(|r| (0..m.cols).map(move |c| m.get(r, c)))
                    .collect();
                assert!(v.iter().all(|x| x.is_finite()), "{format:?}: NaN codes drawn");
                let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
                let want = 1.0 / (3.0 * fan_in).sqrt();
                // MXFP4's scale is the nearest power of two: within a factor sqrt(2).
                assert!(
                    rms > want / 1.45 && rms < want * 1.45,
                    "{format:?}: rms {rms} vs {want}"
                );
            }
            let again = ExpertPool::random(s, 7, Some(1)).unwrap();
            assert_eq!(
                pool.expert_bytes(1, 2).unwrap(),
                again.expert_bytes(1, 2).unwrap()
            );
        }
    }

    #[test]
    fn bad_shapes() {
        let mut s = shape();
        s.moe_layers = vec![3, 1];
        assert!(ExpertPool::random(s, 0, None).is_err());
        let mut s = shape();
        s.hidden_size = 0;
        assert!(ExpertPool::random(s, 0, None).is_err());
    }
}
