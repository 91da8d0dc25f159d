"""Build a model from a checkpoint directory in the Hugging Face layout, or with seeded random weights.

Reads safetensors through the `safetensors` library (mmap): `model.safetensors`, or the shards listed in
`model.safetensors.index.json`. Routed experts are accepted in both layouts the Qwen3-MoE family is saved in:
one tensor per expert (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, the released checkpoints) or
fused 3-D tensors (`model.layers.L.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I], as
transformers 5 saves them). Every parameter must come from the checkpoint: a tensor that is missing, or of the
wrong shape or dtype, is an error naming the file and the tensor, never a silently uninitialised weight.

Qwen3.5-MoE (`freetoken.models.qwen3_5_moe`): the same two expert layouts, under the text model's prefix, which is
`model.language_model.` in the released `Qwen3_5MoeForConditionalGeneration` checkpoints and `model.` where
transformers saves a `Qwen3_5MoeForCausalLM` (either is accepted for either architecture). The vision tower
(`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped with a log line: serving is text-only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken import _core
from freetoken.config import DTYPES, ModelConfig
from freetoken.models import qwen3_5_moe
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM, RotaryEmbedding
from freetoken.moe.backend import ExpertBackend
from freetoken.quant.formats import quant_spec

log = logging.getLogger(__name__)

FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


# A checkpoint that cannot be loaded; the message names the file and tensor and what is wrong. One class for the
# Python loader and the Rust pool (`FreetokenError` and `ValueError` both), so `except CheckpointError` sees both.
CheckpointError = _core.CheckpointError


@dataclass
class TensorIndex:
    """Where each tensor of a checkpoint lives: name -> safetensors file, plus each tensor's shape and dtype."""

    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @classmethod
    def scan(cls, model_dir: Path) -> TensorIndex:
        """Index `model_dir`'s safetensors. Raises FileNotFoundError for a missing file or shard."""
        index_path = model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index with a weight_map ({e})") from e
            shard_names = sorted(set(weight_map.values()))
        elif (model_dir / "model.safetensors").is_file():
            weight_map, shard_names = {}, ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"{model_dir}: neither model.safetensors nor model.safetensors.index.json found "
                "(pass --dummy-weights to run the config with random weights)"
            )
        files: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        for shard in shard_names:
            path = model_dir / shard
            if not path.is_file():
                listed = f" (listed in {index_path.name})" if weight_map else ""
                raise FileNotFoundError(f"{path}: shard missing on disk{listed}")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        meta = f.get_slice(name)
                        files[name] = path
                        shapes[name] = tuple(meta.get_shape())
                        dtypes[name] = meta.get_dtype()
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: cannot read safetensors header ({e})") from e
        for name, shard in weight_map.items():
            if name not in files:
                raise CheckpointError(f"{model_dir / shard}: tensor {name!r} listed in the index is not in the file")
        return cls(files, shapes, dtypes)


class CheckpointReader:
    """Reads tensors by name with shape and dtype checks; keeps one open handle per shard."""

    def __init__(self, index: TensorIndex) -> None:
        self.index = index
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called `name`."""
        return name in self.index.files

    def get(self, name: str, shape: tuple[int, ...], dtypes: Iterable[str] = FLOAT_DTYPES) -> torch.Tensor:
        """Return tensor `name` (CPU, checkpoint dtype), whose safetensors dtype must be one of `dtypes`.
        Raises CheckpointError when missing, mis-shaped or of another dtype."""
        path = self.index.files.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} missing from the checkpoint (expected shape {list(shape)})")
        # dtype first: a packed format's shapes follow from its dtype (an NVFP4 expert left in bf16 is [I, H], not
        # [I, H / 2]), so a wrong dtype is the cause to name
        dtype = self.index.dtypes[name]
        if dtype not in dtypes:
            raise CheckpointError(
                f"{path.name}: tensor {name!r} has dtype {dtype}; expected one of {', '.join(dtypes)}"
            )
        got = self.index.shapes[name]
        if got != tuple(shape):
            raise CheckpointError(f"{path.name}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Drop the open safetensors files (tensors already read stay valid)."""
        self._handles.clear()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype` value -> torch dtype; "auto" is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    """The torch model class of `cfg.architecture`."""
    return qwen3_5_moe.Qwen3_5MoeForCausalLM if cfg.is_qwen3_5 else Qwen3MoeForCausalLM


def _empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty replaces each module's parameters one by one, which unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).to(device)  # float32 buffer, not a weight
    if not cfg.is_qwen3_5:
        for layer in model.model.layers:
            layer.self_attn.fuse_qkv()
    return model.eval().requires_grad_(False)


def text_prefix(reader: CheckpointReader, cfg: ModelConfig) -> str:
    """The checkpoint's prefix of the text model's tensors ("model." or "model.language_model."): `cfg`'s when the
    checkpoint has its embeddings there, else the other one that has them (else `cfg`'s, and the first missing
    tensor is reported)."""
    for prefix in (cfg.weight_prefix, "model.language_model.", "model."):
        if reader.has(prefix + "embed_tokens.weight"):
            return prefix
    return cfg.weight_prefix


def _checkpoint_name(name: str, prefix: str) -> str:
    """A parameter name of our modules (`model.layers...`, `lm_head.weight`) -> the checkpoint's."""
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def _expert_names(layer: int, expert: int, prefix: str = "model.") -> tuple[str, str, str]:
    base = f"{prefix}layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def read_float_experts(
    reader: CheckpointReader,
    num_experts: int,
    hidden: int,
    inter: int,
    layer: int,
    device: torch.device,
    dtype: torch.dtype,
    prefix: str = "model.",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s unquantized experts as (gate_up [E, 2I, H], down [E, H, I]) on `device` in `dtype`, from
    per-expert tensors or the fused 3-D layout; `prefix` is the text model's tensor-name prefix (`text_prefix`).
    The float half of the one expert reader (`freetoken.quant.checkpoint.read_experts` reads every format, this
    among them), used by the `fused` backend and the host pool alike.

    Raises:
        CheckpointError: an expert tensor is missing or mis-shaped (names it).
    """
    fused = f"{prefix}layers.{layer}.mlp.experts.gate_up_proj"
    if reader.has(fused):
        gate_up = reader.get(fused, (num_experts, 2 * inter, hidden)).to(device=device, dtype=dtype)
        down = reader.get(f"{prefix}layers.{layer}.mlp.experts.down_proj", (num_experts, hidden, inter))
        return gate_up, down.to(device=device, dtype=dtype)
    gate_up = torch.empty(num_experts, 2 * inter, hidden, device=device, dtype=dtype)
    down = torch.empty(num_experts, hidden, inter, device=device, dtype=dtype)
    for expert in range(num_experts):
        gate_name, up_name, down_name = _expert_names(layer, expert, prefix)
        gate_up[expert, :inter] = reader.get(gate_name, (inter, hidden))
        gate_up[expert, inter:] = reader.get(up_name, (inter, hidden))
        down[expert] = reader.get(down_name, (hidden, inter))
    return gate_up, down


def load_checkpoint(
    model_dir: str | Path,
    experts: ExpertBackend,
    device: torch.device,
    dtype: torch.dtype,
    cfg: ModelConfig | None = None,
    index: TensorIndex | None = None,
) -> torch.nn.Module:
    """Load `model_dir` into a new model on `device`; routed experts go to `experts`. `index` is the directory's
    `TensorIndex.scan`, when the caller already has it.

    Raises:
        FileNotFoundError: config.json, the safetensors file or a shard of the index is missing.
        CheckpointError: a tensor or a quantization scale is missing, mis-shaped or of an unexpected dtype.
        ConfigError: config.json is unsupported (QuantConfigError: its quantization_config).
    """
    from freetoken.quant import checkpoint as quantized

    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_dir(model_dir)
    spec = quant_spec(cfg.raw, model_dir, str(model_dir / "config.json"))
    if spec.format.quantized:
        spec.format.check_shape(cfg.hidden_size, cfg.moe_intermediate_size, str(model_dir / "config.json"))
    reader = CheckpointReader(index or TensorIndex.scan(model_dir))
    model = _empty_model(cfg, device, dtype)
    prefix = text_prefix(reader, cfg)
    expected = set()
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "lm_head.weight" and not reader.has(name) and reader.has(prefix + "embed_tokens.weight"):
            raise CheckpointError(
                "tensor 'lm_head.weight' missing and config.json has tie_word_embeddings=false; "
                "set tie_word_embeddings=true if the model ties its embeddings"
            )
        stored = _checkpoint_name(name, prefix)
        module = stored.removesuffix(".weight")
        if spec.format.quantized and quantized.is_quantized_linear(reader, spec, module):
            # Non-expert linears are dequantized once here; only the routed experts stay quantized.
            param.copy_(quantized.read_linear(reader, spec, module, tuple(param.shape)))
        else:
            param.copy_(reader.get(stored, tuple(param.shape)))
        expected.add(stored)
    for layer in cfg.moe_layers if experts.wants_weights else ():
        if spec.format.quantized:
            layout = spec.format.layout(cfg.hidden_size, cfg.moe_intermediate_size)
            packed = quantized.read_experts(reader, spec, layout, cfg.num_experts, layer, prefix)
            experts.load_layer_quantized(layer, layout, packed.to(device))
        else:
            sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            experts.load_layer(layer, *read_float_experts(reader, *sizes, layer, device, dtype, prefix))
    expert_prefixes = tuple(f"{prefix}layers.{layer}.mlp.experts." for layer in cfg.moe_layers)
    unused = [
        n
        for n in reader.index.files
        if n not in expected and not n.startswith(expert_prefixes) and not quantized.is_scale_tensor(n)
    ]
    if cfg.tie_word_embeddings:
        unused = [n for n in unused if n != "lm_head.weight"]
    if cfg.is_qwen3_5:
        for part, what in (("model.visual.", "vision tower"), ("mtp.", "multi-token-prediction head")):
            skipped = [n for n in unused if n.startswith(part)]
            if skipped:
                log.info("%s: %d tensors (%s*) skipped: text-only serving", what, len(skipped), part)
                unused = [n for n in unused if not n.startswith(part)]
    if unused:
        log.warning("%d checkpoint tensors not used by %s, e.g. %s", len(unused), cfg.architecture, unused[:3])
    reader.close()
    model.attach_experts(experts)
    return model


def init_dummy_weights(
    cfg: ModelConfig, experts: ExpertBackend, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """A model of `cfg` with random weights: N(0, initializer_range) matrices, unit norms; seeded, so the same
    seed on the same device gives the same weights. Routed experts go to `experts`, built on `device`."""
    std = float(cfg.raw.get("initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    model = _empty_model(cfg, device, dtype)
    if cfg.is_qwen3_5:
        qwen3_5_moe.init_dummy_(model, gen, std)
    else:
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers if experts.wants_weights else ():
        gate_up = torch.empty(num_experts, 2 * inter, hidden, device=device, dtype=dtype).normal_(0, std, generator=gen)
        down = torch.empty(num_experts, hidden, inter, device=device, dtype=dtype).normal_(0, std, generator=gen)
        experts.load_layer(layer, gate_up, down)
    model.attach_experts(experts)
    return model


# Values sampled per weight tensor and per routed expert by `check_finite_weights`: evenly strided, so a tensor
# that is NaN or inf throughout (or in any large block) is caught while a 30B model's check reads a few MB.
FINITE_SAMPLES_PER_TENSOR = 4096
FINITE_SAMPLES_PER_EXPERT = 256


def check_finite_weights(model: torch.nn.Module, experts: ExpertBackend) -> None:
    """Refuse weights with NaN or inf values, from an evenly strided sample of every tensor of `model` and of
    every routed expert in `experts`' host pool (an `ExpertCacheBackend`'s ``pool_experts``), when it has one.

    A checkpoint full of NaN otherwise serves (every output token the same, "!!!!"). Sampled: a few stray
    non-finite values may pass; the cost is a few reads per tensor and per expert.

    Raises:
        CheckpointError: naming the first tensor (or pool layer and expert) with a non-finite sample and the flag
            that serves it anyway (--allow-nonfinite).
    """
    fix = "the checkpoint is corrupt or was saved in a dtype that overflowed; --allow-nonfinite serves it anyway"
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINITE_SAMPLES_PER_TENSOR)]
        if not bool(torch.isfinite(sample).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or inf values; {fix}")
    from freetoken.moe.expert_cache import ExpertCacheBackend

    if not isinstance(experts, ExpertCacheBackend):
        return
    pool, pool_experts = experts.pool, experts.pool_experts
    if pool.format == "bf16":
        values = pool_experts[:, : pool.expert_nbytes].view(torch.bfloat16)  # [experts, 3*I*H] bf16, zero-copy
        sample = values[:, :: max(1, values.shape[1] // FINITE_SAMPLES_PER_EXPERT)]
        bad = (~torch.isfinite(sample)).any(dim=1).nonzero()
    else:
        from freetoken.quant.formats import format_named
        from freetoken.quant.reference import nonfinite_experts

        layout = format_named(pool.format, pool.block).layout(pool.hidden_size, pool.intermediate_size)
        bad = nonfinite_experts(layout, pool_experts, FINITE_SAMPLES_PER_EXPERT).nonzero()
    if len(bad):
        layer, expert = divmod(int(bad[0]), pool.num_experts)
        raise CheckpointError(
            f"routed expert {expert} of model layer {pool.moe_layers[layer]} holds NaN or inf values; {fix}"
        )
