"""Expert weight formats: one table says how each format stores a routed expert, and how a checkpoint names it.

A format is a weight element type, a block of weights sharing one scale, the scale's type, and whether each
projection has one more float32 scale for the whole tensor. Everything else (bytes per expert, where each part of
an expert sits in the host pool and the GPU slots, what the checkpoint's `quantization_config` says) follows from
those fields, so MXFP4 is one more row of `FORMATS`. The Rust core mirrors the table
(`rust/freetoken-core/src/quant/mod.rs`); `tests/test_quant_formats.py` checks the two agree.

Formats (definitions cited where the codecs are, `freetoken.quant.reference`):

| name       | weight        | scale block (out x in) | scale        | per-tensor scale | checkpoint             |
|------------|---------------|------------------------|--------------|------------------|------------------------|
| bf16       | bf16          | none                   | none         | no               | unquantized            |
| fp8_block  | float8 e4m3   | 128 x 128 (config)     | float32      | no               | `quant_method: fp8`    |
| nvfp4      | e2m1, 2/byte  | 1 x 16                 | float8 e4m3  | float32          | ModelOpt `NVFP4`       |
| mxfp4      | e2m1, 2/byte  | 1 x 32                 | e8m0         | no               | `quant_method: mxfp4`  |

One expert in the pool, contiguous so one copy moves it; the two weight matrices back to back (as bf16 has always
been stored), each scale section from a multiple of `SECTION_ALIGN` bytes:

    gate_up weight [2I, H] | down weight [H, I] | gate_up scales | down scales | tensor scales f32 [3]

`gate_up` is gate_proj's rows then up_proj's (as for bf16). Scales are row-major over blocks:
[ceil(rows / block_rows), ceil(cols / block_cols)]. The FP8 block rows must divide I, so the blocks of the stacked
gate_up are exactly gate_proj's blocks then up_proj's. Tensor scales are (gate, up, down), NVFP4's `weight_scale_2`.
Packed 4-bit weights hold element 2j in the low nibble and 2j+1 in the high one (ModelOpt and gpt-oss both do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.config import ConfigError

# Alignment of every section of an expert, in bytes: a cache line, so AVX-512 loads and DMA start aligned.
SECTION_ALIGN = 64


class QuantConfigError(ConfigError):
    """A checkpoint's quantization that freetoken cannot serve: names the file, the key and what is supported."""


@dataclass(frozen=True)
class ExpertFormat:
    """How one format stores a weight matrix [rows (out), cols (in)].

    Attributes:
        name: the format's name (`FORMATS` key; the CLI and the bandwidth profile use it).
        weight_bits: bits per weight element (16, 8 or 4).
        block_rows: rows sharing one scale (1 for per-row blocks); 0 when the format has no scales.
        block_cols: columns sharing one scale; 0 when the format has no scales.
        scale_bytes: bytes per block scale (4 float32, 1 e4m3 or e8m0); 0 without scales.
        scale_dtype: "float32", "float8_e4m3fn", "float8_e8m0fnu" or "" (none).
        tensor_scale: True when each projection has one more float32 scale (NVFP4's `weight_scale_2`).
    """

    name: str
    weight_bits: int
    block_rows: int = 0
    block_cols: int = 0
    scale_bytes: int = 0
    scale_dtype: str = ""
    tensor_scale: bool = False

    @property
    def quantized(self) -> bool:
        """False for bf16 (the pool holds plain bf16 weights)."""
        return self.weight_bits != 16

    def weight_nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] weight matrix in this format."""
        return rows * cols * self.weight_bits // 8

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Shape of the block scales of a [rows, cols] matrix: (ceil(rows / block_rows), ceil(cols / block_cols))."""
        if not self.block_rows:
            return (0, 0)
        return (-(-rows // self.block_rows), -(-cols // self.block_cols))

    def scale_nbytes(self, rows: int, cols: int) -> int:
        """Bytes of the block scales of a [rows, cols] matrix."""
        r, c = self.scale_shape(rows, cols)
        return r * c * self.scale_bytes

    def check_shape(self, hidden: int, inter: int, source: str = "config.json") -> None:
        """Refuse expert sizes the format cannot split into whole blocks.

        Raises:
            QuantConfigError: H or I is not a multiple of the block sizes it must be (names them).
        """
        if self.weight_bits == 4 and (hidden % 2 or inter % 2):
            raise QuantConfigError(
                f"{source}: {self.name} packs two weights per byte; H={hidden}, I={inter} must be even"
            )
        if not self.block_rows:
            return
        # gate_up [2I, H] and down [H, I]: block rows tile I (so gate and up blocks stack) and H; block cols tile
        # H and I (a partial last block would be legal, but no released checkpoint has one and kernels skip it).
        for size, what in ((inter, "moe_intermediate_size"), (hidden, "hidden_size")):
            for block, axis in (
                (self.block_rows, "rows"),
                (self.block_cols, "columns"),
            ):
                if size % block:
                    raise QuantConfigError(
                        f"{source}: {what}={size} is not a multiple of the {self.name} block's {block} {axis}"
                    )

    def layout(self, hidden: int, inter: int) -> ExpertLayout:
        """Where each part of one expert sits, for hidden size H and expert intermediate size I."""
        sizes = (
            ("gate_up", self.weight_nbytes(2 * inter, hidden)),
            ("down", self.weight_nbytes(hidden, inter)),
            ("gate_up_scale", self.scale_nbytes(2 * inter, hidden)),
            ("down_scale", self.scale_nbytes(hidden, inter)),
            ("tensor_scale", 12 if self.tensor_scale else 0),
        )
        offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, nbytes in sizes:
            if nbytes and name not in ("gate_up", "down"):  # weights back to back (bf16's layout), scales aligned
                at = -(-at // SECTION_ALIGN) * SECTION_ALIGN
            offsets[name] = (at, nbytes)
            at += nbytes
        # The last section is not padded: `expert_nbytes` is what one copy moves; the pool pads the stride.
        last = max(o + n for o, n in offsets.values() if n)
        return ExpertLayout(self, hidden, inter, offsets, last)


@dataclass(frozen=True)
class ExpertLayout:
    """The byte layout of one expert in one format (see the module docstring).

    Attributes:
        format: the `ExpertFormat`.
        hidden: H.
        inter: I.
        sections: name -> (byte offset, nbytes) for gate_up, down, gate_up_scale, down_scale, tensor_scale
            (nbytes 0 for a part the format does not have).
        expert_nbytes: bytes of one expert, from its first byte to the end of its last section.
    """

    format: ExpertFormat
    hidden: int
    inter: int
    sections: dict[str, tuple[int, int]]
    expert_nbytes: int


def fp8_block(block_rows: int = 128, block_cols: int = 128) -> ExpertFormat:
    """The FP8 block format with `weight_block_size [block_rows, block_cols]` (Qwen, DeepSeek-V3: 128 x 128)."""
    return ExpertFormat("fp8_block", 8, block_rows, block_cols, 4, "float32")


BF16 = ExpertFormat("bf16", 16)
NVFP4 = ExpertFormat("nvfp4", 4, 1, 16, 1, "float8_e4m3fn", tensor_scale=True)
MXFP4 = ExpertFormat("mxfp4", 4, 1, 32, 1, "float8_e8m0fnu")
FORMATS: dict[str, ExpertFormat] = {f.name: f for f in (BF16, fp8_block(), NVFP4, MXFP4)}


def format_named(name: str, block: tuple[int, int] = (0, 0)) -> ExpertFormat:
    """The `ExpertFormat` of `name` (a `FORMATS` key, as `ExpertPool.format` gives it); `block` is FP8's
    `weight_block_size` (`ExpertPool.block`), ignored by the other formats.

    Raises:
        QuantConfigError: an unknown name.
    """
    if name == "fp8_block" and block != (0, 0):
        return fp8_block(*block)
    if name not in FORMATS:
        raise QuantConfigError(f"expert format {name!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization, from its `quantization_config` (or ModelOpt's hf_quant_config.json).

    Attributes:
        format: the experts' (and quantized linears') `ExpertFormat`; `BF16` for an unquantized checkpoint.
        not_converted: module names (or ModelOpt glob patterns) stored unquantized (`modules_to_not_convert`,
            `ignore`, `exclude_modules`).
        source: the file the spec was read from, for messages.
    """

    format: ExpertFormat
    not_converted: tuple[str, ...] = ()
    source: str = ""

    def converts(self, module: str) -> bool:
        """Whether `module` (a checkpoint module name such as `model.layers.0.self_attn.q_proj`) is quantized:
        False when a `not_converted` entry equals it or a dotted prefix of it, or matches either as a glob (gpt-oss
        lists `model.layers.*.self_attn` for every attention projection under it)."""
        from fnmatch import fnmatchcase

        for entry in self.not_converted:
            if module == entry or module.startswith(entry + "."):
                return False
            if "*" in entry and (fnmatchcase(module, entry) or fnmatchcase(module, entry + ".*")):
                return False
        return self.format.quantized


def _names(value: Any, source: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantConfigError(f"{source}: {key} must be a list of module names, got {value!r}")
    return tuple(value)


def _fp8_spec(qc: dict[str, Any], source: str) -> QuantSpec:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"{source}: quantization_config.fmt={fmt!r}; only e4m3 FP8 weights are supported")
    block = qc.get("weight_block_size")
    if block is None:  # no block size: per-tensor or per-channel FP8
        raise QuantConfigError(
            f"{source}: quantization_config.weight_block_size=None; FP8 with per-tensor or per-channel scales is not "
            "supported, expected block scales such as [128, 128]"
        )
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise QuantConfigError(
            f"{source}: quantization_config.weight_block_size={block!r}; expected two positive integers, the block's "
            "rows and columns, such as [128, 128]"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantConfigError(
            f"{source}: quantization_config.activation_scheme={scheme!r}; only 'dynamic' is supported (weight-only "
            "compute: activations stay in the model dtype)"
        )
    return QuantSpec(
        fp8_block(*block),
        _names(qc.get("modules_to_not_convert"), source, "modules_to_not_convert"),
        source,
    )


def _modelopt_spec(qc: dict[str, Any], source: str) -> QuantSpec:
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise QuantConfigError(f"{source}: ModelOpt quant_algo={algo!r}; freetoken serves NVFP4 only")
    group = qc.get("group_size", 16)
    if group != 16:
        raise QuantConfigError(f"{source}: NVFP4 group_size={group!r}; the format's block is 16 elements")
    ignored: tuple[str, ...] = ()
    for key in ("ignore", "exclude_modules", "modules_to_not_convert"):
        ignored += _names(qc.get(key), source, key)
    return QuantSpec(NVFP4, ignored, source)


def _mxfp4_spec(qc: dict[str, Any], source: str) -> QuantSpec:
    # transformers' `Mxfp4Config` (gpt-oss): `modules_to_not_convert` and `dequantize`, a loading option that
    # changes nothing stored; the format itself is fixed (e2m1, e8m0 per 32 elements, OCP MX v1.0 section 6.3).
    return QuantSpec(MXFP4, _names(qc.get("modules_to_not_convert"), source, "modules_to_not_convert"), source)


def quant_spec(
    raw: dict[str, Any],
    model_dir: str | Path | None = None,
    source: str = "config.json",
) -> QuantSpec:
    """The quantization of a checkpoint from its config.json dict `raw` (top level or `text_config`) and, for
    ModelOpt exports that keep it apart, `model_dir/hf_quant_config.json`.

    Accepted: no `quantization_config` (bf16); `quant_method: fp8` with `weight_block_size` and a dynamic
    activation scheme (Qwen, DeepSeek-V3); `quant_method: modelopt` with `quant_algo: NVFP4`, or an
    hf_quant_config.json whose `quantization.quant_algo` is NVFP4; `quant_method: mxfp4` (gpt-oss: routed experts
    in MXFP4, everything else unquantized).

    Raises:
        QuantConfigError: any other method or algorithm, or FP8 without block scales (names the key and value).
    """
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None and model_dir is not None:
        path = Path(model_dir) / "hf_quant_config.json"
        if path.is_file():
            try:
                modelopt = json.loads(path.read_text()).get("quantization")
            except (json.JSONDecodeError, AttributeError) as e:
                raise QuantConfigError(f"{path}: not a ModelOpt hf_quant_config.json ({e})") from e
            if not isinstance(modelopt, dict):
                raise QuantConfigError(f"{path}: no 'quantization' object")
            return _modelopt_spec(modelopt, str(path))
    if qc is None:
        return QuantSpec(BF16, (), source)
    if not isinstance(qc, dict):
        raise QuantConfigError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_spec(qc, source)
    if method == "modelopt" or (method is None and "quant_algo" in qc):
        return _modelopt_spec(qc, source)
    if method == "mxfp4":
        return _mxfp4_spec(qc, source)
    raise QuantConfigError(
        f"{source}: quantization_config.quant_method={method!r} is not supported; freetoken serves bf16, "
        "fp8 (block scales), modelopt NVFP4 and mxfp4 checkpoints"
    )
