"""Quantized checkpoints: reading them (linears dequantized, experts packed in the pool layout) and building small
ones in the real layouts from random weights.

Tensor names read, for a quantized linear module `m` (e.g. `model.layers.0.self_attn.q_proj`):
- FP8 block (Qwen3 / Qwen3.5 FP8, DeepSeek-V3): `m.weight` F8_E4M3 [out, in] and `m.weight_scale_inv` F32
  (BF16 or F16 in some Qwen FP8 releases, widened to F32) [out / 128, in / 128]. Routed experts per expert
  (`...mlp.experts.E.{gate,up,down}_proj.weight` and `.weight_scale_inv`), or fused 3-D as transformers'
  `FP8Experts` names them: `...mlp.experts.gate_up_proj` [E, 2I, H] with `gate_up_proj_scale_inv`
  [E, 2I / 128, H / 128], and `down_proj` / `down_proj_scale_inv`.
- NVFP4 (ModelOpt export): `m.weight` U8 [out, in / 2], `m.weight_scale` F8_E4M3 [out, in / 16],
  `m.weight_scale_2` F32 [] (and `m.input_scale`, read by nobody: weight-only compute). Experts per expert only
  (ModelOpt exports no fused 3-D experts); a fused NVFP4 checkpoint is refused by name.
- MXFP4 (`quant_method: mxfp4`, the layout of openai/gpt-oss-20b and -120b): only the routed experts are
  quantized, fused 3-D: `...mlp.experts.gate_up_proj_blocks` U8 [E, 2I, H / 32, 16] (each row's 32-element blocks
  of 16 bytes, two e2m1 per byte, element 2j in the low nibble) with `gate_up_proj_scales` U8 [E, 2I, H / 32] (e8m0
  codes, 2^(code - 127)), and `down_proj_blocks` [E, H, I / 32, 16] / `down_proj_scales` [E, H, I / 32]. Rows are
  output features and blocks run along the input, as OCP MX v1.0 section 6.3 blocks the dot product's dimension;
  gpt-oss-20b's gate_up_proj_blocks is [32, 5760, 90, 16] for H 2880. transformers 5.24
  (`integrations/mxfp4.py`, `_convert_moe_packed_tensors`) decodes the same way: `lut[blk & 0x0F]` to the even
  element, `lut[blk >> 4]` to the odd one, `ldexp(value, scales - 127)`, rows kept in order. The row order of
  gate_up is the model's, not the format's: gpt-oss interleaves gate and up rows (its `GptOssExperts._apply_gate`
  reads `gate_up[..., ::2]` and `[..., 1::2]`), Qwen3-MoE stacks gate's I rows then up's (`Qwen3MoeExperts.forward`
  chunks the product in two), which is what is read here for the Qwen3-MoE family.
"""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken.models.loader import CheckpointError, CheckpointReader
from freetoken.quant import reference
from freetoken.quant.formats import ExpertFormat, ExpertLayout, QuantSpec

# safetensors dtype names of each part, per format.
_WEIGHT_DTYPE = {"fp8_block": "F8_E4M3", "nvfp4": "U8"}
# FP8 block scales: float32 as DeepSeek-V3 and most Qwen FP8 releases store them; some Qwen FP8 releases store
# bf16 or float16 (widened to float32 on read, exactly).
_SCALE_DTYPES = {"fp8_block": ("F32", "BF16", "F16"), "nvfp4": ("F8_E4M3",), "mxfp4": ("U8",)}
_SCALE_SUFFIX = {"fp8_block": ".weight_scale_inv", "nvfp4": ".weight_scale"}
# Suffixes of the weight and the scales of a fused 3-D expert tensor (`...mlp.experts.gate_up_proj`), per format.
_FUSED_SUFFIXES = {"fp8_block": ("", "_scale_inv"), "mxfp4": ("_blocks", "_scales")}
_WEIGHT_SUFFIXES = (
    ".weight_scale_inv",
    ".weight_scale_2",
    ".weight_scale",
    ".input_scale",
)


def is_scale_tensor(name: str) -> bool:
    """Whether a checkpoint tensor is a quantization scale (read with its weight, never as a parameter)."""
    return name.endswith(_WEIGHT_SUFFIXES)


def _check_supported(fmt: ExpertFormat) -> None:
    if fmt.name not in _WEIGHT_DTYPE:
        raise CheckpointError(
            f"{fmt.name} linears are not read: fp8_block and nvfp4 checkpoints quantize linears, mxfp4 ones only "
            "the fused routed experts"
        )


def _scale_bytes(fmt: ExpertFormat, scale: torch.Tensor) -> torch.Tensor:
    """Block scales as the pool stores them: 4-byte ones (FP8's) as float32, widened from bf16 / float16 exactly;
    1-byte codes as uint8."""
    return scale.float() if fmt.scale_bytes == 4 else scale.view(torch.uint8)


def read_matrix(
    reader: CheckpointReader, fmt: ExpertFormat, module: str, rows: int, cols: int
) -> dict[str, torch.Tensor]:
    """The quantized parts of linear `module` ([rows, cols] = [out, in]) as `reference.quantize_matrix` returns them.

    Raises:
        CheckpointError: the weight or a scale is missing, mis-shaped or of the wrong dtype (names the tensor and
            what is expected).
    """
    _check_supported(fmt)
    per_byte = 8 // fmt.weight_bits
    weight = reader.get(f"{module}.weight", (rows, cols // per_byte), (_WEIGHT_DTYPE[fmt.name],))
    scale = reader.get(module + _SCALE_SUFFIX[fmt.name], fmt.scale_shape(rows, cols), _SCALE_DTYPES[fmt.name])
    parts = {"weight": weight.view(torch.uint8), "scale": _scale_bytes(fmt, scale)}
    if fmt.tensor_scale:
        name = f"{module}.weight_scale_2"
        shape = reader.index.shapes.get(name, ())
        parts["tensor_scale"] = reader.get(name, shape if shape in ((), (1,)) else (), ("F32",)).reshape(())
    return parts


def is_quantized_linear(reader: CheckpointReader, spec: QuantSpec, module: str) -> bool:
    """Whether `module.weight` is stored quantized: the format has quantized linears (MXFP4 checkpoints quantize the
    routed experts only, so any other weight must be a float, and the float reader names one that is not), the spec
    converts the module and the tensor is not a float."""
    name = f"{module}.weight"
    return (
        spec.format.name in _WEIGHT_DTYPE
        and spec.converts(module)
        and reader.has(name)
        and reader.index.dtypes[name] not in ("F32", "BF16", "F16")
    )


def read_linear(reader: CheckpointReader, spec: QuantSpec, module: str, shape: tuple[int, int]) -> torch.Tensor:
    """A quantized linear's weight dequantized to float32 [out, in] (`is_quantized_linear` must hold).

    Raises:
        CheckpointError: see `read_matrix`.
    """
    parts = read_matrix(reader, spec.format, module, *shape)
    return reference.dequantize_matrix(spec.format, parts["weight"], parts["scale"], parts.get("tensor_scale"))


def read_experts(
    reader: CheckpointReader,
    spec: QuantSpec,
    layout: ExpertLayout,
    num_experts: int,
    layer: int,
    prefix: str,
) -> torch.Tensor:
    """Layer `layer`'s routed experts in the pool layout, [E, expert_nbytes] uint8 on the CPU: the one reader of
    checkpoint expert tensors for the host pool and the `fused` backend, every format (bf16 through
    `freetoken.models.loader.read_float_experts`, rounded to bf16 as the pool stores it).

    Args:
        reader: the checkpoint.
        spec: its quantization (`spec.format` is `layout.format`).
        layout: the experts' layout.
        num_experts: E.
        layer: decoder layer index.
        prefix: the text model's tensor-name prefix (`freetoken.models.loader.text_prefix`).

    Raises:
        CheckpointError: an expert tensor or scale is missing, mis-shaped or of the wrong dtype (names it).
    """
    fmt, h, i = layout.format, layout.hidden, layout.inter
    if not fmt.quantized:
        from freetoken.models.loader import read_float_experts

        weights = read_float_experts(reader, num_experts, h, i, layer, torch.device("cpu"), torch.bfloat16, prefix)
        return torch.cat([w.reshape(num_experts, -1) for w in weights], 1).view(torch.uint8)
    base = f"{prefix}layers.{layer}.mlp.experts"
    out = torch.zeros(num_experts, layout.expert_nbytes, dtype=torch.uint8)
    if fmt.name == "mxfp4" or reader.has(f"{base}.gate_up_proj"):
        if fmt.name not in _FUSED_SUFFIXES:
            raise CheckpointError(
                f"tensor {base}.gate_up_proj: fused 3-D {fmt.name} experts are no released layout (fused fp8_block "
                "and mxfp4 experts are read; nvfp4 ones per expert)"
            )
        gate_up = read_matrix_3d(reader, fmt, f"{base}.gate_up_proj", num_experts, 2 * i, h)
        down = read_matrix_3d(reader, fmt, f"{base}.down_proj", num_experts, h, i)
        for e in range(num_experts):
            gate = {k: v[e, :i] for k, v in gate_up.items()}
            up = {k: v[e, i:] for k, v in gate_up.items()}
            # The scales' block rows divide I (`ExpertFormat.check_shape`): the first I / block_rows are gate's
            # (MXFP4's blocks are one row: its first I scale rows).
            half = i // fmt.block_rows
            gate["scale"], up["scale"] = (
                gate_up["scale"][e, :half],
                gate_up["scale"][e, half:],
            )
            reference.pack_expert(layout, gate, up, {k: v[e] for k, v in down.items()}, out=out[e])
        return out
    for e in range(num_experts):
        gate, up, down = (
            read_matrix(reader, fmt, f"{base}.{e}.{proj}", rows, cols)
            for proj, rows, cols in (
                ("gate_proj", i, h),
                ("up_proj", i, h),
                ("down_proj", h, i),
            )
        )
        reference.pack_expert(layout, gate, up, down, out=out[e])
    return out


def read_matrix_3d(
    reader: CheckpointReader,
    fmt: ExpertFormat,
    name: str,
    num_experts: int,
    rows: int,
    cols: int,
) -> dict[str, torch.Tensor]:
    """The parts of fused expert tensor `name` ([E, rows, cols] = [E, out, in]) as `reference.quantize_matrix`
    returns them, with a leading expert dimension: FP8's `name` F8_E4M3 and `name_scale_inv` F32 (or BF16 /
    F16), or MXFP4's `name_blocks` U8 [E, rows, cols / 32, 16] (read as [E, rows, cols / 2]) and `name_scales`
    U8 (module docstring).

    Raises:
        CheckpointError: a tensor is missing, mis-shaped or of the wrong dtype (names it and what is expected);
            an MXFP4 checkpoint without fused blocks (per-expert MXFP4 tensors are no released layout).
    """
    weight_suffix, scale_suffix = _FUSED_SUFFIXES[fmt.name]
    scale_shape = (num_experts, *fmt.scale_shape(rows, cols))
    if fmt.name == "mxfp4":
        if not reader.has(name + weight_suffix):
            raise CheckpointError(
                f"tensor {name + weight_suffix!r} missing from the checkpoint: MXFP4 experts are read in the fused "
                f"3-D layout of the released MXFP4 checkpoints (gpt-oss), {name}_blocks U8 "
                f"{[*scale_shape, fmt.block_cols // 2]} and {name}_scales U8 {list(scale_shape)}"
            )
        blocks = reader.get(name + weight_suffix, (*scale_shape, fmt.block_cols // 2), ("U8",))
        weight = blocks.reshape(num_experts, rows, cols // 2)  # each row's blocks back to back: the pool's bytes
    else:
        weight = reader.get(name + weight_suffix, (num_experts, rows, cols), (_WEIGHT_DTYPE[fmt.name],))
    scale = reader.get(name + scale_suffix, scale_shape, _SCALE_DTYPES[fmt.name])
    return {"weight": weight.view(torch.uint8), "scale": _scale_bytes(fmt, scale)}


def quantize_linear_tensors(fmt: ExpertFormat, module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of linear `module` with float weight `w` [out, in] quantized to `fmt` by the reference
    quantizer, named as the real checkpoints name them (module docstring)."""
    parts = reference.quantize_matrix(fmt, w)
    if fmt.name == "fp8_block":
        return {
            f"{module}.weight": parts["weight"].view(torch.float8_e4m3fn),
            f"{module}.weight_scale_inv": parts["scale"],
        }
    if fmt.name == "nvfp4":
        return {
            f"{module}.weight": parts["weight"],
            f"{module}.weight_scale": parts["scale"].view(torch.float8_e4m3fn),
            f"{module}.weight_scale_2": parts["tensor_scale"],
            f"{module}.input_scale": torch.tensor(1.0),
        }
    raise ValueError(f"writing {fmt.name} checkpoints is not supported")


def quantize_state_dict(
    tensors: dict[str, torch.Tensor], spec: QuantSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Quantize a float checkpoint's linears as a real checkpoint of `spec` stores them.

    Every 3-D fused expert tensor (`experts.gate_up_proj`, `experts.down_proj`; FP8 and MXFP4) and, for formats
    that quantize linears (FP8, NVFP4), every 2-D `*.weight` of a module `spec.converts` (norms are 1-D and stay)
    is quantized by the reference quantizer.

    Args:
        tensors: name -> float tensor, Hugging Face names (`freetoken.models.demo`'s random weights).
        spec: the quantization to write.

    Returns:
        (quantized checkpoint tensors, the same checkpoint with every quantized weight replaced by its float32
        dequantization and no scales): the second loads as a plain float model with exactly the quantized weights.
    """
    fmt = spec.format
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        fused = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        module = name.removesuffix(".weight")
        if fused and fmt.name == "fp8_block":
            q, s = reference.quantize_fp8_block(w, (fmt.block_rows, fmt.block_cols))
            quantized[name], quantized[f"{name}_scale_inv"] = q, s
            dequantized[name] = reference.dequantize_fp8_block(q, s, (fmt.block_rows, fmt.block_cols))
        elif fused and fmt.name == "mxfp4":
            q, s = reference.quantize_mxfp4(w)  # [E, R, C / 2] packed, [E, R, C / 32] e8m0
            quantized[f"{name}_blocks"] = q.reshape(*s.shape, fmt.block_cols // 2)  # [E, R, C / 32, 16]
            quantized[f"{name}_scales"] = s
            dequantized[name] = reference.dequantize_mxfp4(q, s)
        elif fused:
            raise ValueError(
                f"{fmt.name} checkpoints have no fused 3-D experts; build them with expert_layout='per_expert'"
            )
        elif name.endswith(".weight") and w.dim() == 2 and fmt.name in _WEIGHT_DTYPE and spec.converts(module):
            parts = quantize_linear_tensors(fmt, module, w)
            quantized.update(parts)
            p = reference.quantize_matrix(fmt, w)
            dequantized[name] = reference.dequantize_matrix(fmt, p["weight"], p["scale"], p.get("tensor_scale"))
        else:
            quantized[name] = dequantized[name] = w
    return quantized, dequantized


def quantization_config(fmt: ExpertFormat, not_converted: list[str]) -> dict:
    """The `quantization_config` a real checkpoint of `fmt` carries in config.json (Qwen FP8, ModelOpt NVFP4,
    gpt-oss MXFP4)."""
    if fmt.name == "fp8_block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [fmt.block_rows, fmt.block_cols],
            "modules_to_not_convert": not_converted,
        }
    if fmt.name == "nvfp4":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": not_converted,
        }
    if fmt.name == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    raise ValueError(f"no quantization_config for {fmt.name}")


def build_quantized_checkpoint(
    dest: str | Path,
    fmt: ExpertFormat,
    *,
    seed: int = 0,
    expert_layout: str = "per_expert",
    dequantized_dest: str | Path | None = None,
    **overrides,
) -> Path:
    """Write a tiny random-weight Qwen3-MoE checkpoint quantized to `fmt` in the real layout (module docstring).

    The demo model's random weights (`freetoken.models.demo`), every linear quantized by the reference quantizer
    except the embeddings, the LM head and the routers (`modules_to_not_convert` lists them, as Qwen's FP8
    releases do); MXFP4 quantizes the routed experts only, as gpt-oss does.

    Args:
        dest: directory to write.
        fmt: `freetoken.quant.fp8_block(...)`, `NVFP4` or `MXFP4`; the block must divide the demo's sizes
            (override hidden_size / moe_intermediate_size for 128 x 128 blocks).
        seed: seed of the random weights.
        expert_layout: "per_expert" (FP8, NVFP4) or "fused" (FP8, MXFP4).
        dequantized_dest: when given, also write there the float32 checkpoint of the dequantized weights
            (`quantize_state_dict`'s second result), the bf16 model the quantized one must match.
        **overrides: config.json values (see `freetoken.models.demo.demo_config`).

    Returns:
        `dest` as a Path.
    """
    from freetoken.models import demo

    if fmt.name == "mxfp4" and expert_layout != "fused":
        raise ValueError("mxfp4 checkpoints store the routed experts fused 3-D (gpt-oss); use expert_layout='fused'")
    config = demo.demo_config(**overrides)
    fmt.check_shape(config["hidden_size"], config["moe_intermediate_size"])
    not_converted = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{layer}.mlp.gate" for layer in range(config["num_hidden_layers"])
    ]
    spec = QuantSpec(fmt, tuple(not_converted))
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def weights(cfg: dict, seed_: int, layout: str, which: int) -> dict[str, torch.Tensor]:
        if "q" not in cache:
            cache["q"], cache["d"] = quantize_state_dict(demo._random_weights(cfg, seed_, layout), spec)
        return cache["q" if which == 0 else "d"]

    quant_config = {
        **config,
        "quantization_config": quantization_config(fmt, not_converted),
    }
    dest = demo.write_demo_dir(
        dest,
        quant_config,
        lambda c, s, lay: weights(c, s, lay, 0),
        seed,
        expert_layout,
        1,
    )
    if dequantized_dest is not None:
        demo.write_demo_dir(
            dequantized_dest,
            config,
            lambda c, s, lay: weights(c, s, lay, 1),
            seed,
            expert_layout,
            1,
        )
    return dest


def fill_pool(pool, model_dir: str | Path, cfg, spec: QuantSpec, index=None) -> None:
    """Copy the routed experts of checkpoint `model_dir` into `pool`, each in the pool layout of `spec.format`
    (bf16, or quantized weights and scales contiguous), one layer at a time through `expert_view` (`read_experts`:
    any text-model prefix, either expert layout). The Rust reader (`ExpertPool.from_checkpoint`, parallel) takes
    bf16 checkpoints whose tensors are named `model.layers.*`; this takes the rest.

    Args:
        pool: a `freetoken._core.ExpertPool.zeroed(..., format=spec.format.name, block=...)` of `cfg`'s shape.
        model_dir: the checkpoint.
        cfg: its `ModelConfig`.
        spec: its `QuantSpec`.
        index: the directory's `TensorIndex`, when the caller has it.

    Raises:
        ValueError: the pool's format or expert size is not the checkpoint's.
        CheckpointError: an expert tensor or scale is missing, mis-shaped or of the wrong dtype (names it).
    """
    from freetoken.models.loader import TensorIndex, text_prefix

    layout = spec.format.layout(cfg.hidden_size, cfg.moe_intermediate_size)
    if pool.format != spec.format.name or pool.expert_nbytes != layout.expert_nbytes:
        raise ValueError(
            f"the pool holds {pool.format} experts of {pool.expert_nbytes} bytes; the checkpoint's are "
            f"{spec.format.name} of {layout.expert_nbytes} bytes"
        )
    reader = CheckpointReader(index or TensorIndex.scan(Path(model_dir)))
    prefix = text_prefix(reader, cfg)
    for pool_layer, layer in enumerate(cfg.moe_layers):
        packed = read_experts(reader, spec, layout, cfg.num_experts, layer, prefix)
        for expert in range(cfg.num_experts):
            torch.frombuffer(pool.expert_view(pool_layer, expert), dtype=torch.uint8).copy_(packed[expert])
    reader.close()
