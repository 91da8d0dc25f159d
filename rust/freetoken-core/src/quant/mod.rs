//! Expert weight formats: how one routed expert is stored in the pool (and the GPU slots) in
//! bf16, FP8 with block scales, NVFP4 or MXFP4, the element codecs, and read-only views of one
//! expert's matrices for the kernels ([`kernels`]).
//!
//! Owns: the format table (mirrored by `python/freetoken/quant/formats.py`, which documents the
//! formats and cites their definitions; `tests/test_quant_core.py` checks the two agree), the
//! byte layout of one expert, decoding of e4m3 / e2m1 / e8m0. Not: reading checkpoints (Python
//! packs experts into the pool), the worker pool (see [`crate::cpu`]).
//!
//! One expert, contiguous so one copy moves it; the weights back to back, each scale section at a
//! multiple of [`SECTION_ALIGN`] bytes:
//! ```text
//! gate_up weight [2I, H] │ down weight [H, I] │ gate_up scales │ down scales │ tensor scales f32 [3]
//! ```
//! Scales are row-major over blocks `[ceil(rows / block_rows), ceil(cols / block_cols)]`; FP8's
//! block rows divide I, so gate_up's first `I / block_rows` scale rows are gate_proj's. Tensor
//! scales (NVFP4's `weight_scale_2`) are (gate, up, down). 4-bit weights: element `2j` in the low
//! nibble of byte `j`. Dequantized weight: FP8 `e4m3 · scale`; NVFP4
//! `e2m1 · (e4m3(scale) · tensor_scale)`; MXFP4 `e2m1 · 2^(e8m0 - 127)`, each product in f32.
pub mod kernels;

use crate::error::PoolError;

/// Alignment of each section of an expert, in bytes (a cache line).
pub const SECTION_ALIGN: usize = 64;

/// A routed-expert weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertFormat {
    /// bf16 weights, no scales.
    Bf16,
    /// float8 e4m3 weights, one f32 scale per `block_rows x block_cols` block (`weight_scale_inv`).
    Fp8Block {
        /// Rows (output features) per scale block.
        block_rows: usize,
        /// Columns (input features) per scale block.
        block_cols: usize,
    },
    /// e2m1 two per byte, an e4m3 scale per 16 elements of a row, an f32 scale per tensor.
    Nvfp4,
    /// e2m1 two per byte, an e8m0 scale per 32 elements of a row (OCP MX).
    Mxfp4,
}

/// The element type of a format's block scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleType {
    /// No scales (bf16).
    None,
    /// IEEE f32, little-endian.
    F32,
    /// float8 e4m3.
    E4m3,
    /// e8m0, a power of two.
    E8m0,
}

/// The byte layout of one expert: `(offset, nbytes)` of each section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// The format.
    pub format: ExpertFormat,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// gate_up weights `[2I, H]`.
    pub gate_up: (usize, usize),
    /// down weights `[H, I]`.
    pub down: (usize, usize),
    /// gate_up block scales.
    pub gate_up_scale: (usize, usize),
    /// down block scales.
    pub down_scale: (usize, usize),
    /// Tensor scales f32 `[3]` (gate, up, down); nbytes 0 when the format has none.
    pub tensor_scale: (usize, usize),
    /// Bytes of one expert: to the end of its last non-empty section.
    pub expert_nbytes: usize,
}

impl ExpertFormat {
    /// The format's name, as Python's `ExpertFormat.name`: bf16, fp8_block, nvfp4, mxfp4.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8Block { .. } => "fp8_block",
            Self::Nvfp4 => "nvfp4",
            Self::Mxfp4 => "mxfp4",
        }
    }

    /// Parses [`ExpertFormat::name`]; `block` is FP8's `weight_block_size` (ignored otherwise).
    pub fn from_name(name: &str, block: (usize, usize)) -> Result<Self, PoolError> {
        match name {
            "bf16" => Ok(Self::Bf16),
            "fp8_block" if block.0 > 0 && block.1 > 0 => Ok(Self::Fp8Block {
                block_rows: block.0,
                block_cols: block.1,
            }),
            "nvfp4" => Ok(Self::Nvfp4),
            "mxfp4" => Ok(Self::Mxfp4),
            _ => Err(PoolError::Config(format!(
                "expert format {name:?} with block {block:?} is not one of bf16, fp8_block (positive block), nvfp4, mxfp4"
            ))),
        }
    }

    /// Bits per weight element.
    pub fn weight_bits(self) -> usize {
        match self {
            Self::Bf16 => 16,
            Self::Fp8Block { .. } => 8,
            Self::Nvfp4 | Self::Mxfp4 => 4,
        }
    }

    /// `(rows, cols)` sharing one scale; `(0, 0)` without scales.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::Bf16 => (0, 0),
            Self::Fp8Block {
                block_rows,
                block_cols,
            } => (block_rows, block_cols),
            Self::Nvfp4 => (1, 16),
            Self::Mxfp4 => (1, 32),
        }
    }

    /// The block scales' element type.
    pub fn scale_type(self) -> ScaleType {
        match self {
            Self::Bf16 => ScaleType::None,
            Self::Fp8Block { .. } => ScaleType::F32,
            Self::Nvfp4 => ScaleType::E4m3,
            Self::Mxfp4 => ScaleType::E8m0,
        }
    }

    /// Bytes per block scale.
    pub fn scale_bytes(self) -> usize {
        match self.scale_type() {
            ScaleType::None => 0,
            ScaleType::F32 => 4,
            ScaleType::E4m3 | ScaleType::E8m0 => 1,
        }
    }

    /// Whether each projection has one more f32 scale (NVFP4's `weight_scale_2`).
    pub fn tensor_scale(self) -> bool {
        matches!(self, Self::Nvfp4)
    }

    /// Shape of the block scales of a `[rows, cols]` matrix.
    pub fn scale_shape(self, rows: usize, cols: usize) -> (usize, usize) {
        match self.block() {
            (0, _) | (_, 0) => (0, 0),
            (br, bc) => (rows.div_ceil(br), cols.div_ceil(bc)),
        }
    }

    /// Checks that H and I split into whole blocks (and whole bytes for 4-bit weights).
    pub fn check_shape(self, hidden: usize, inter: usize) -> Result<(), PoolError> {
        let (br, bc) = self.block();
        for (size, what) in [(inter, "intermediate_size"), (hidden, "hidden_size")] {
            if (self.weight_bits() == 4 && size % 2 != 0)
                || (br > 0 && (size % br != 0 || size % bc != 0))
            {
                return Err(PoolError::Config(format!(
                    "{what} {size} does not split into whole {} blocks of {br} x {bc}",
                    self.name()
                )));
            }
        }
        Ok(())
    }

    /// The layout of one expert of hidden size `hidden` and intermediate size `inter`.
    pub fn layout(self, hidden: usize, inter: usize) -> ExpertLayout {
        let weight = |r: usize, c: usize| r * c * self.weight_bits() / 8;
        let scales = |r: usize, c: usize| {
            let (a, b) = self.scale_shape(r, c);
            a * b * self.scale_bytes()
        };
        let sizes = [
            weight(2 * inter, hidden),
            weight(hidden, inter),
            scales(2 * inter, hidden),
            scales(hidden, inter),
            if self.tensor_scale() { 12 } else { 0 },
        ];
        let mut sections = [(0usize, 0usize); 5];
        let (mut at, mut end) = (0usize, 0usize);
        for (k, (s, &n)) in sections.iter_mut().zip(&sizes).enumerate() {
            // The two weight matrices back to back (bf16 keeps its historical layout); each scale
            // section from a cache-line boundary.
            if k >= 2 && n > 0 {
                at = at.next_multiple_of(SECTION_ALIGN);
            }
            *s = (at, n);
            at += n;
            if n > 0 {
                end = at;
            }
        }
        ExpertLayout {
            format: self,
            hidden,
            inter,
            gate_up: sections[0],
            down: sections[1],
            gate_up_scale: sections[2],
            down_scale: sections[3],
            tensor_scale: sections[4],
            expert_nbytes: end,
        }
    }
}

/// e4m3 magnitudes `0..=0x7E` and the sign as f32 (OCP OFP8 rev. 1.0: bias 7, exponent 0
/// subnormal `m/8 · 2^-6`); `0x7F` / `0xFF` are NaN.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

const fn e4m3_bits(code: u8) -> u32 {
    let sign = ((code as u32) & 0x80) << 24;
    let exp = ((code >> 3) & 0xF) as u32;
    let man = (code & 7) as u32;
    if code & 0x7F == 0x7F {
        return 0x7FC0_0000 | sign;
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // m · 2^-9, normalised: the leading one of m at bit p gives 2^(p - 9).
        let p = 31 - man.leading_zeros();
        let frac = (man - (1 << p)) << (23 - p);
        return sign | ((p + 127 - 9) << 23) | frac;
    }
    sign | ((exp + 120) << 23) | (man << 20)
}

/// Every e4m3 code's f32 value (built at compile time from [`e4m3_bits`]).
pub static E4M3_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = f32::from_bits(e4m3_bits(i as u8));
        i += 1;
    }
    t
};

/// e2m1 values by 4-bit code, sign in bit 3 (OCP MX v1.0 table 5).
pub const E2M1_TABLE: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// e8m0 value `2^(code - 127)` (OCP MX v1.0 5.4.1); NaN for 0xFF.
#[inline]
pub fn e8m0_to_f32(code: u8) -> f32 {
    match code {
        0xFF => f32::NAN,
        // 2^-127 is an f32 subnormal: bit 22 of the mantissa.
        0 => f32::from_bits(0x0040_0000),
        c => f32::from_bits((c as u32) << 23),
    }
}

/// One quantized matrix `[rows, cols]`: weights, block scales, tensor scale, as stored.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    /// The format (not bf16).
    pub format: ExpertFormat,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// `rows * cols * bits / 8` bytes, row-major.
    pub weight: &'a [u8],
    /// Block scales, row-major over blocks, `scale_bytes` each.
    pub scales: &'a [u8],
    /// The tensor scale (1.0 for formats without one).
    pub tensor_scale: f32,
}

impl QMatrix<'_> {
    /// The multiplier of block `(rb, cb)` (scale row, scale column): f32 scale, e4m3 scale times
    /// the tensor scale (in that order, as the reference), or 2^(e8m0 - 127).
    #[inline]
    pub fn block_scale(&self, rb: usize, cb: usize) -> f32 {
        let (_, ncb) = self.format.scale_shape(self.rows, self.cols);
        let i = rb * ncb + cb;
        match self.format.scale_type() {
            ScaleType::F32 => {
                let b = &self.scales[4 * i..4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            ScaleType::E4m3 => e4m3_to_f32(self.scales[i]) * self.tensor_scale,
            ScaleType::E8m0 => e8m0_to_f32(self.scales[i]),
            ScaleType::None => 1.0,
        }
    }

    /// Element `(r, c)` dequantized (f32).
    #[inline]
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let (br, bc) = self.format.block();
        let value = match self.format.weight_bits() {
            8 => e4m3_to_f32(self.weight[r * self.cols + c]),
            _ => {
                let byte = self.weight[(r * self.cols + c) / 2];
                E2M1_TABLE[((byte >> (4 * (c & 1))) & 0xF) as usize]
            }
        };
        value * self.block_scale(r / br, c / bc)
    }
}

/// Read-only views of one expert's three matrices.
#[derive(Clone, Copy)]
pub struct QExpert<'a> {
    /// gate_proj `[I, H]`.
    pub gate: QMatrix<'a>,
    /// up_proj `[I, H]`.
    pub up: QMatrix<'a>,
    /// down_proj `[H, I]`.
    pub down: QMatrix<'a>,
}

impl ExpertLayout {
    /// Views of the expert in `bytes` (at least `expert_nbytes`). Errors for bf16 (not a
    /// quantized format) or too few bytes.
    pub fn expert<'a>(&self, bytes: &'a [u8]) -> Result<QExpert<'a>, PoolError> {
        if self.format == ExpertFormat::Bf16 || bytes.len() < self.expert_nbytes {
            return Err(PoolError::Config(format!(
                "a quantized {} expert of H={} I={} takes {} bytes, got {}",
                self.format.name(),
                self.hidden,
                self.inter,
                self.expert_nbytes,
                bytes.len()
            )));
        }
        let (h, i) = (self.hidden, self.inter);
        let sec = |(o, n): (usize, usize)| &bytes[o..o + n];
        let ts = |k: usize| {
            if self.tensor_scale.1 == 0 {
                return 1.0;
            }
            let b = &bytes[self.tensor_scale.0 + 4 * k..self.tensor_scale.0 + 4 * k + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        let (gu, gus) = (sec(self.gate_up), sec(self.gate_up_scale));
        let (half_w, half_s) = (gu.len() / 2, gus.len() / 2);
        let m = |rows, cols, weight, scales, tensor_scale| QMatrix {
            format: self.format,
            rows,
            cols,
            weight,
            scales,
            tensor_scale,
        };
        Ok(QExpert {
            gate: m(i, h, &gu[..half_w], &gus[..half_s], ts(0)),
            up: m(i, h, &gu[half_w..], &gus[half_s..], ts(1)),
            down: m(h, i, sec(self.down), sec(self.down_scale), ts(2)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xC0), -2.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(130), 8.0);
    }

    #[test]
    fn layouts_of_real_shapes() {
        let (h, i) = (2048, 768);
        let fp8 = ExpertFormat::Fp8Block {
            block_rows: 128,
            block_cols: 128,
        }
        .layout(h, i);
        assert_eq!(fp8.gate_up_scale, (3 * h * i, 2 * 6 * 16 * 4));
        assert_eq!(fp8.expert_nbytes, 3 * h * i + 768 + 384);
        let nv = ExpertFormat::Nvfp4.layout(h, i);
        assert_eq!(nv.expert_nbytes, 3 * h * i / 2 + 3 * h * i / 16 + 12);
        assert_eq!(ExpertFormat::Bf16.layout(h, i).expert_nbytes, 3 * h * i * 2);
        assert!(ExpertFormat::Fp8Block {
            block_rows: 128,
            block_cols: 128
        }
        .check_shape(2048, 96)
        .is_err());
        assert!(ExpertFormat::from_name("int4", (0, 0)).is_err());
    }
}
