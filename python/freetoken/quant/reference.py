"""Reference codecs of the expert formats in torch, written from the published definitions, used to build test
checkpoints and to check every kernel (Rust CPU, Triton) against.

Element types:
- float8 e4m3 ("E4M3FN"): OCP 8-bit Floating Point Specification (OFP8) rev. 1.0 (2023), table 1: 1 sign bit,
  4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; no
  infinities; largest finite 448.
- e2m1 (FP4): OCP Microscaling Formats (MX) Specification v1.0 (2023), section 5.3.3: 1 sign bit, 2 exponent bits
  of bias 1, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN or infinity.
- e8m0: OCP MX v1.0 section 5.4.1: an unsigned power of two 2^(e - 127); 0xFF is NaN.

Block quantizers:
- FP8 block (`fp8_block`): DeepSeek-V3 Technical Report (arXiv:2412.19437) section 3.3.2, "fine-grained
  quantization": weights scaled per 128 x 128 block by its absolute maximum over 448, the largest e4m3; the
  checkpoint stores that per-block multiplier as `weight_scale_inv` (float32), so w = float(q) * weight_scale_inv
  (DeepSeek-V3 `inference/kernel.py` `weight_dequant`; the Qwen3 FP8 releases use the same layout).
- NVFP4 (`nvfp4`): NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference" (2025) and
  TensorRT Model Optimizer's `NVFP4QTensor`: 16-element blocks along the input dimension, each with an e4m3 scale,
  and one float32 scale per tensor (`weight_scale_2` = amax / (6 * 448)); the block scale is
  amax_block / 6 / weight_scale_2 rounded to e4m3, and w = e2m1 * (float(weight_scale) * weight_scale_2).
- MXFP4 (`mxfp4`): OCP MX v1.0 section 6.3: 32-element blocks, shared scale X = 2^(floor(log2(amax)) - 2) (2 is
  e2m1's largest exponent) stored as e8m0, elements v / X rounded to e2m1 with saturation at 6.

Rounding is to nearest, ties to even, everywhere. Dequantization multiplies in float32 in the order written above;
the kernels use the same order, so their dequantized weights equal these bit for bit.
"""

from __future__ import annotations

import torch

from freetoken.quant.formats import ExpertFormat, ExpertLayout

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 magnitudes by code (bits 0-2; bit 3 is the sign): OCP MX v1.0 table 5.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 bit patterns -> float32, by the OFP8 formula (not torch's cast, which the tests check it against).

    Args:
        codes: uint8 tensor (or float8_e4m3fn, read as its bytes), any shape.

    Returns:
        float32 tensor of the same shape; NaN for the NaN patterns 0x7F and 0xFF.
    """
    c = codes.view(torch.uint8).to(torch.int32)
    sign = torch.where(c & 0x80 != 0, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    man = (c & 0x7).to(torch.float32)
    normal = (1.0 + man / 8.0) * torch.exp2((exp - 7).to(torch.float32))
    value = torch.where(exp == 0, man / 8.0 * 2.0**-6, normal)
    return torch.where((c & 0x7F) == 0x7F, torch.nan, sign * value)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8 values 0..15, sign in bit 3) -> float32 of the same shape."""
    table = torch.tensor(
        E2M1_VALUES + tuple(-v for v in E2M1_VALUES),
        dtype=torch.float32,
        device=codes.device,
    )
    return table[codes.to(torch.int64)]


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 bit patterns (uint8 or float8_e8m0fnu) -> float32 2^(e - 127); NaN for 0xFF."""
    e = codes.view(torch.uint8).to(torch.int32)
    return torch.where(e == 0xFF, torch.nan, torch.exp2((e - 127).to(torch.float32)))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to e2m1 codes (uint8 0..15), nearest with ties to the even code, saturating at +-6."""
    a = x.abs().to(torch.float32).clamp(max=E2M1_MAX)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mids = (values[1:] + values[:-1]) / 2
    code = torch.searchsorted(mids, a.contiguous(), right=False)  # first code whose upper midpoint >= a
    tie = (code < len(mids)) & (a == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)
    return (code | torch.where(torch.signbit(x), 8, 0)).to(torch.uint8)  # -0 keeps its sign, as float8 casts do


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> bytes [..., n]: element 2j in the low nibble, 2j+1 in the high one."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> uint8 codes [..., 2n] (inverse of `pack_nibbles`)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _blocks(w: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """[..., R, C] -> [..., R / br, C / bc, br, bc] (R, C multiples of the block)."""
    *lead, rows, cols = w.shape
    return w.reshape(*lead, rows // block_rows, block_rows, cols // block_cols, block_cols).transpose(-3, -2)


def _unblocks(b: torch.Tensor) -> torch.Tensor:
    *lead, nr, nc, br, bc = b.shape
    return b.transpose(-3, -2).reshape(*lead, nr * br, nc * bc)


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad [..., R, C] up to whole blocks (the last block of a row or column may be partial)."""
    rows, cols = w.shape[-2:]
    return torch.nn.functional.pad(w, (0, -cols % block[1], 0, -rows % block[0]))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block quantization (DeepSeek-V3 section 3.3.2).

    Args:
        w: [..., R, C] float weights; a partial last block takes the scale of its own values.
        block: (rows, cols) of one scale block.

    Returns:
        (weight [..., R, C] float8_e4m3fn, weight_scale_inv [..., ceil(R / block[0]), ceil(C / block[1])] float32),
        with float(weight) * weight_scale_inv ~ w.
    """
    rows, cols = w.shape[-2:]
    b = _blocks(_pad_to_blocks(w.to(torch.float32), block), *block)
    amax = b.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return _unblocks(q)[..., :rows, :cols].contiguous(), scale[..., 0, 0]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """float(weight) * weight_scale_inv per block, float32 [..., R, C] (inverse of `quantize_fp8_block`)."""
    rows, cols = weight.shape[-2:]
    values = _pad_to_blocks(decode_e4m3(weight), block)
    b = _blocks(values, *block) * scale_inv[..., None, None]
    return _unblocks(b)[..., :rows, :cols]


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 quantization (NVIDIA's NVFP4 description; ModelOpt `NVFP4QTensor`).

    Args:
        w: [R, C] float weights, C a multiple of 16 (one tensor: `weight_scale_2` is per tensor).

    Returns:
        (weight [R, C / 2] uint8 packed e2m1, weight_scale [R, C / 16] float8_e4m3fn, weight_scale_2 [] float32).
    """
    w = w.to(torch.float32)
    amax = w.abs().amax()
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)
    b = _blocks(w, 1, 16)
    block_scale = (b.abs().amax(dim=(-2, -1)) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = decode_e4m3(block_scale) * scale_2
    codes = encode_e2m1(torch.where(step[..., None, None] > 0, b / step[..., None, None], 0.0))
    return pack_nibbles(_unblocks(codes)), block_scale, scale_2.reshape(())


def dequantize_nvfp4(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """e2m1 * (float(weight_scale) * weight_scale_2), float32 [..., R, C]; `scale_2` is [] or [...] per leading
    index."""
    step = decode_e4m3(scale) * scale_2.to(torch.float32).reshape(*scale_2.shape, 1, 1)
    values = _blocks(decode_e2m1(unpack_nibbles(weight)), 1, 16)
    return _unblocks(values * step[..., None, None])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantization (OCP MX v1.0 section 6.3).

    Args:
        w: [..., R, C] float weights, C a multiple of 32.

    Returns:
        (weight [..., R, C / 2] uint8 packed e2m1, scale [..., R, C / 32] uint8 e8m0 codes).
    """
    b = _blocks(w.to(torch.float32), 1, 32)
    amax = b.abs().amax(dim=(-2, -1))
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, 0.0).clamp(-127, 127)
    codes = encode_e2m1(b / torch.exp2(exp)[..., None, None])
    return pack_nibbles(_unblocks(codes)), (exp + 127).to(torch.uint8)


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 * 2^(scale - 127), float32 [..., R, C]."""
    values = _blocks(decode_e2m1(unpack_nibbles(weight)), 1, 32)
    return _unblocks(values * decode_e8m0(scale)[..., None, None])


def quantize_matrix(fmt: ExpertFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize one [R, C] matrix to `fmt`; returns its parts by pool section role: "weight", and "scale" and
    "tensor_scale" where the format has them (bytes as uint8, tensor scale float32 [])."""
    if fmt.name == "fp8_block":
        q, s = quantize_fp8_block(w, (fmt.block_rows, fmt.block_cols))
        return {"weight": q.view(torch.uint8), "scale": s}
    if fmt.name == "nvfp4":
        q, s, s2 = quantize_nvfp4(w)
        return {"weight": q, "scale": s.view(torch.uint8), "tensor_scale": s2}
    if fmt.name == "mxfp4":
        q, s = quantize_mxfp4(w)
        return {"weight": q, "scale": s}
    raise ValueError(f"format {fmt.name!r} is not a quantized format")


def dequantize_matrix(fmt: ExpertFormat, weight: torch.Tensor, scale: torch.Tensor, tensor_scale=None) -> torch.Tensor:
    """The float32 [..., R, C] weights of one format's parts (`quantize_matrix`'s, or a checkpoint's)."""
    if fmt.name == "fp8_block":
        return dequantize_fp8_block(weight, scale.view(torch.float32), (fmt.block_rows, fmt.block_cols))
    if fmt.name == "nvfp4":
        return dequantize_nvfp4(weight.view(torch.uint8), scale, tensor_scale)
    if fmt.name == "mxfp4":
        return dequantize_mxfp4(weight.view(torch.uint8), scale)
    raise ValueError(f"format {fmt.name!r} is not a quantized format")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack_expert(
    layout: ExpertLayout,
    gate: dict[str, torch.Tensor],
    up: dict[str, torch.Tensor],
    down: dict[str, torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's bytes in the pool layout (`freetoken.quant.formats`), from each projection's quantized parts.

    Args:
        layout: the expert layout.
        gate, up, down: the parts of gate_proj [I, H], up_proj [I, H] and down_proj [H, I]: "weight" (quantized
            bytes, any byte dtype), "scale" (block scales) and, for formats with one, "tensor_scale" (float32 []).
        out: [expert_nbytes] uint8 to write into (a pool view); a new zeroed tensor when None.

    Returns:
        `out`, [expert_nbytes] uint8.
    """
    if out is None:
        out = torch.zeros(layout.expert_nbytes, dtype=torch.uint8)
    parts = {
        "gate_up": torch.cat((_bytes(gate["weight"]), _bytes(up["weight"]))),
        "down": _bytes(down["weight"]),
        "gate_up_scale": torch.cat((_bytes(gate["scale"]), _bytes(up["scale"]))) if "scale" in gate else None,
        "down_scale": _bytes(down["scale"]) if "scale" in down else None,
        "tensor_scale": (
            _bytes(torch.stack([p["tensor_scale"].reshape(()).to(torch.float32) for p in (gate, up, down)]))
            if layout.format.tensor_scale
            else None
        ),
    }
    for name, (offset, nbytes) in layout.sections.items():
        data = parts[name]
        if nbytes == 0:
            continue
        if data is None or data.numel() != nbytes:
            got = "nothing" if data is None else f"{data.numel()} bytes"
            raise ValueError(f"{layout.format.name} expert section {name!r} takes {nbytes} bytes, got {got}")
        out[offset : offset + nbytes] = data
    return out


def dequantize_experts(layout: ExpertLayout, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 weights of packed experts (the reference every kernel is checked against).

    Args:
        layout: the experts' layout.
        experts: [E, stride >= expert_nbytes] uint8 rows in the pool layout, any device.

    Returns:
        (gate_up [E, 2I, H], down [E, H, I]) float32.
    """
    fmt, h, i = layout.format, layout.hidden, layout.inter
    n = experts.shape[0]

    def section(name: str) -> torch.Tensor:
        offset, nbytes = layout.sections[name]
        return experts[:, offset : offset + nbytes]

    if not fmt.quantized:
        return (
            section("gate_up").contiguous().view(torch.bfloat16).view(n, 2 * i, h).float(),
            section("down").contiguous().view(torch.bfloat16).view(n, h, i).float(),
        )
    cols = 8 // fmt.weight_bits  # elements per byte
    gu_w = section("gate_up").reshape(n, 2 * i, h // cols)
    dn_w = section("down").reshape(n, h, i // cols)
    gu_s = section("gate_up_scale").contiguous().view(_SCALE_DTYPES[fmt.scale_dtype])
    dn_s = section("down_scale").contiguous().view(_SCALE_DTYPES[fmt.scale_dtype])
    gu_s, dn_s = (
        gu_s.reshape(n, *fmt.scale_shape(2 * i, h)),
        dn_s.reshape(n, *fmt.scale_shape(h, i)),
    )
    if not fmt.tensor_scale:
        return dequantize_matrix(fmt, gu_w, gu_s), dequantize_matrix(fmt, dn_w, dn_s)
    ts = section("tensor_scale").contiguous().view(torch.float32).reshape(n, 3)
    gu_w, gu_s = gu_w.reshape(n, 2, i, h // cols), gu_s.reshape(n, 2, i, -1)
    gate_up = dequantize_matrix(fmt, gu_w, gu_s, ts[:, :2]).reshape(n, 2 * i, h)
    return gate_up, dequantize_matrix(fmt, dn_w, dn_s, ts[:, 2])


def nonfinite_experts(layout: ExpertLayout, experts: torch.Tensor, samples: int) -> torch.Tensor:
    """Which packed experts hold a NaN or inf, from an evenly strided sample of about `samples` codes per section
    (weights, block scales) and every tensor scale: e4m3 NaN codes (S.1111.111) among FP8 weights and NVFP4 scales,
    e8m0's 0xFF, non-finite float32 scales. e2m1 weights have no such codes.

    Args:
        layout: the experts' layout (a quantized format).
        experts: [E, stride >= expert_nbytes] uint8 rows in the pool layout.
        samples: codes sampled per section.

    Returns:
        [E] bool.
    """
    fmt = layout.format
    bad = torch.zeros(experts.shape[0], dtype=torch.bool)
    for name, code_bytes in (
        ("gate_up", 1 if fmt.weight_bits == 8 else 0),
        ("down", 1 if fmt.weight_bits == 8 else 0),
        ("gate_up_scale", fmt.scale_bytes),
        ("down_scale", fmt.scale_bytes),
        ("tensor_scale", 4),
    ):
        offset, nbytes = layout.sections[name]
        if not nbytes or not code_bytes:
            continue
        codes = experts[:, offset : offset + nbytes]
        if code_bytes == 4:
            values = codes.contiguous().view(torch.float32)
            step = 1 if name == "tensor_scale" else max(1, values.shape[1] // samples)
            bad |= (~torch.isfinite(values[:, ::step])).any(dim=1)
            continue
        sample = codes[:, :: max(1, nbytes // samples)]
        e8m0 = fmt.scale_dtype == "float8_e8m0fnu" and name.endswith("scale")
        nan = sample == 0xFF if e8m0 else sample & 0x7F == 0x7F
        bad |= nan.any(dim=1)
    return bad


_SCALE_DTYPES = {
    "float32": torch.float32,
    "float8_e4m3fn": torch.uint8,
    "float8_e8m0fnu": torch.uint8,
}
