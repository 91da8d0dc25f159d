"""Typed configuration: the model's `config.json` and the engine's settings.

`ModelConfig` reads a Hugging Face `config.json` for the families freetoken runs; `EngineConfig` holds the
serving knobs that `ft serve` exposes as flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken.errors import FreetokenError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# The Qwen3.5/3.6-MoE family (`model_type: qwen3_5_moe`): Gated DeltaNet and gated full-attention layers, each with a
# routed MoE plus a gated shared expert. The conditional-generation checkpoints keep the text model under
# `model.language_model.` (vision tower under `model.visual.`, skipped) and its config under `text_config`.
QWEN3_5_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LAYER_TYPES = ("full_attention", "linear_attention")
# `--dtype` values: "auto" (bfloat16 on CUDA, float32 on the CPU), then torch dtypes by their torch names.
DTYPES = ("auto", "float32", "bfloat16", "float16")
MOE_BACKENDS = ("auto", "fused", "offload", "cpu", "hybrid")
EXPERT_CACHE_POLICIES = ("lru", "layer_lru", "lfu")
PREFILL_STRATEGIES = ("auto", "stream", "fill", "cpu", "hybrid")
STATE_CHECKPOINT_MODES = ("marks", "chunk", "off")


class ConfigError(FreetokenError, ValueError):
    """A config.json that freetoken cannot run: names the file, the key and what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3-MoE or Qwen3.5-MoE model, as in the Hugging Face `config.json` (`model_type:
    qwen3_moe`, `qwen3_5_moe`; for `Qwen3_5MoeForConditionalGeneration` the keys of `text_config`).

    Sizes are in elements. Layer `L` is a MoE layer when `L not in mlp_only_layers`, `num_experts > 0` and
    `(L + 1) % decoder_sparse_step == 0` (transformers' `Qwen3MoeDecoderLayer`); the other layers use a dense
    SwiGLU MLP of `intermediate_size`. Qwen3.5 (transformers' `Qwen3_5MoeDecoderLayer`) has a MoE on every layer.

    Qwen3.5 fields (defaults describe Qwen3-MoE): `layer_types` per layer "full_attention" or "linear_attention"
    (Gated DeltaNet, `linear_*` sizes; empty: all full attention); `partial_rotary_factor`, the share of each head's
    dims that RoPE rotates; `attn_output_gate`, q_proj also emits a per-head sigmoid gate on the attention output;
    `shared_expert_intermediate_size` (0: none); `weight_prefix`, the tensor-name prefix of the text model.
    `model_dir`: the checkpoint's directory when read from one (`from_dir`), where `hf_quant_config.json` may
    describe its quantization (`expert_nbytes`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    weight_prefix: str = "model."
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    model_dir: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `model_dir/config.json`. Raises FileNotFoundError or ConfigError naming the file."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path), model_dir=str(model_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json", model_dir: str | None = None) -> ModelConfig:
        """Build from a parsed config dict (read from `model_dir`, if given). Raises ConfigError for an unsupported
        architecture or bad values."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: architectures {archs} not supported; freetoken runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        qwen3_5 = arch in QWEN3_5_ARCHITECTURES
        if qwen3_5 and isinstance(raw.get("text_config"), dict):
            # The released checkpoints nest the text model's keys; derived ones (REAP) write them at the top.
            # The outer model ties (or not) its LM head to the text embeddings: transformers reads the top level's
            # tie_word_embeddings there, whatever text_config says.
            top = {k: v for k, v in raw.items() if k != "text_config"}
            raw = {**top, **raw["text_config"], **{k: top[k] for k in ("tie_word_embeddings",) if k in top}}

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            if key in raw and raw[key] is not None:
                return raw[key]
            if required and default is None:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return default

        def num(convert: type, key: str, default: Any = None, required: bool = True) -> Any:
            """`get`, converted by `convert`; a value that does not convert is a ConfigError naming the key."""
            value = get(key, default, required)
            try:
                return convert(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: {key} must be {convert.__name__}, got {value!r}") from None

        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        rope_theta = raw.get("rope_theta")
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only the default RoPE)")
        # Qwen3.5's multimodal RoPE (`mrope_section`) gives a text token the same position on its three axes, which
        # is the default RoPE: text-only serving needs no more.
        partial_rotary = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        hidden = num(int, "hidden_size")
        heads = num(int, "num_attention_heads")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        cfg = cls(
            architecture=arch,
            vocab_size=num(int, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=num(int, "intermediate_size", 0 if qwen3_5 else None),
            moe_intermediate_size=num(int, "moe_intermediate_size"),
            num_hidden_layers=num(int, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=num(int, "num_key_value_heads", heads),
            head_dim=num(int, "head_dim", hidden // heads if heads else 0),
            # transformers >= 5 writes num_local_experts, the released checkpoints num_experts.
            num_experts=num(int, "num_experts" if "num_experts" in raw else "num_local_experts"),
            num_experts_per_tok=num(int, "num_experts_per_tok"),
            # Qwen3.5's router always renormalises its top-k (transformers' Qwen3_5MoeTopKRouter).
            norm_topk_prob=qwen3_5 or bool(get("norm_topk_prob", False, required=False)),
            decoder_sparse_step=num(int, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(int(x) for x in num(tuple, "mlp_only_layers", [], required=False)),
            rms_norm_eps=num(float, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=num(int, "max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False, required=False)),
            attention_bias=bool(get("attention_bias", False, required=False)),
            torch_dtype=str(get("torch_dtype", raw.get("dtype", "bfloat16"))),
            eos_token_ids=eos_ids,
            layer_types=tuple(str(t) for t in num(tuple, "layer_types", [], required=False)),
            linear_num_key_heads=num(int, "linear_num_key_heads", 0),
            linear_num_value_heads=num(int, "linear_num_value_heads", 0),
            linear_key_head_dim=num(int, "linear_key_head_dim", 0),
            linear_value_head_dim=num(int, "linear_value_head_dim", 0),
            linear_conv_kernel_dim=num(int, "linear_conv_kernel_dim", 0),
            partial_rotary_factor=num(float, "partial_rotary_factor", partial_rotary),
            attn_output_gate=bool(get("attn_output_gate", False, required=False)),
            shared_expert_intermediate_size=num(int, "shared_expert_intermediate_size", 0),
            weight_prefix=("model.language_model." if arch == "Qwen3_5MoeForConditionalGeneration" else "model."),
            raw=raw,
            model_dir=model_dir,
        )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"{source}: {key} must be >= 1, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.num_experts_per_tok <= max(self.num_experts, 1):
            raise ConfigError(
                f"{source}: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..num_experts ({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"{source}: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.architecture not in QWEN3_5_ARCHITECTURES:
            return
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ConfigError(
                f"{source}: layer_types must list {self.num_hidden_layers} entries (num_hidden_layers), each one of "
                f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)}"
            )
        if self.linear_layers:
            for key in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ):
                if getattr(self, key) < 1:
                    raise ConfigError(
                        f"{source}: {key} must be >= 1 with linear_attention layers, got {getattr(self, key)}"
                    )
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(
                    f"{source}: linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                    f"linear_num_key_heads ({self.linear_num_key_heads})"
                )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"{source}: partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} gives "
                f"{self.rotary_dim} rotary dims; need an even number in 2..head_dim"
            )

    @property
    def is_qwen3_5(self) -> bool:
        """True for the Qwen3.5/3.6-MoE family (Gated DeltaNet hybrid)."""
        return self.architecture in QWEN3_5_ARCHITECTURES

    @property
    def full_attention_layers(self) -> list[int]:
        """The decoder layers with softmax attention over the paged KV cache, ascending (all, for Qwen3-MoE)."""
        if not self.layer_types:
            return list(range(self.num_hidden_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """The decoder layers with Gated DeltaNet linear attention (a recurrent state per sequence), ascending."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the paged KV cache."""
        return len(self.full_attention_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's short causal conv: q and k (Hk * Dk each) then v (Hv * Dv), the order
        of `in_proj_qkv`'s rows (transformers' `qwen3_5_moe`)."""
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * keys + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates (head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer `layer` (0-based) has routed experts rather than a dense MLP."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """The decoder layers with routed experts, ascending."""
        return [layer for layer in range(self.num_hidden_layers) if self.is_moe_layer(layer)]

    @property
    def expert_numel(self) -> int:
        """Elements in one routed expert: gate and up [I, H] each, down [H, I]."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert as the checkpoint stores it, weights and scales (`freetoken.quant.formats`;
        bf16 checkpoints: 2 * expert_numel), its quantization read as the loader reads it: config.json's
        `quantization_config`, else `model_dir/hf_quant_config.json` (ModelOpt). Raises QuantConfigError for an
        unsupported one, naming the file."""
        from freetoken.quant.formats import quant_spec

        source = str(Path(self.model_dir) / "config.json") if self.model_dir else "config.json"
        spec = quant_spec(self.raw, self.model_dir, source=source)
        return spec.format.layout(self.hidden_size, self.moe_intermediate_size).expert_nbytes


def parse_device(spec: str) -> torch.device:
    """The torch device of a ``--device`` value (cpu, cuda or cuda:N), one this machine has (`ft serve`,
    `ft bench bw`).

    Raises:
        ValueError: naming --device: not a device, neither cpu nor cuda, or a CUDA device torch does not see here
            (none at all, or an index past the last one).
    """
    import torch

    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: torch sees no CUDA device here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: freetoken runs on cpu or cuda")
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        raise ValueError(f"--device {spec}: torch sees {count} CUDA device(s) here, cuda:0 to cuda:{count - 1}")
    return device


@dataclass
class EngineConfig:
    """Serving settings (the flags of `ft serve`).

    Attributes:
        device: "cpu" or "cuda" (or "cuda:N").
        dtype: compute and weight dtype: "float32", "bfloat16" or "float16"; "auto" takes bfloat16 on CUDA and
            float32 on the CPU.
        max_num_seqs: most requests decoding in one batch.
        max_prefill_tokens: most prompt tokens prefilled in one step (a chunk); longer prompts take several.
        max_model_len: context length in tokens (prompt + output); 0 means the model's max_position_embeddings.
        kv_block_size: tokens per KV-cache block.
        kv_cache_tokens: KV-cache capacity in tokens over all requests; 0 sizes it to hold max_num_seqs full
            contexts, capped by kv_cache_gb.
        kv_cache_gb: most memory the KV cache may take, in GB (1e9 bytes).
        moe_backend: where routed experts run: "fused" (all on the compute device; only when asked),
            "offload" (host pool + device slot cache; every miss is copied in), "cpu" (every miss runs on the
            host), "hybrid" (misses split by q*; needs the `ft bench bw` profile of this GPU and expert shape),
            "auto" ("cpu" on a CPU device; on CUDA "hybrid" when that profile says so, else "offload").
        gpu_memory_gb: the device memory budget in GB: non-expert weights, KV cache, then expert slots;
            0 means 90 % of the free memory.
        activation_reserve_gb: device memory the budget keeps for one step's activations and what no tensor
            accounts for (CUDA context, workspaces, fragmentation), in GB; 0 means the peak of the largest step the
            settings allow by `freetoken.models.activations` plus `freetoken.moe.budget.RESERVE_BYTES`.
        expert_slots: expert slots in the cache; 0 sizes them from the budget.
        expert_cache_policy: slot replacement policy: "lfu" (per-layer quotas with aged frequencies; the best
            hit rate of the three on routing traces at small caches, `cargo bench --bench policies`), "lru" or
            "layer_lru" (per-layer quotas).
        cpu_threads: threads of the host expert kernels; 0 means all CPUs, one fewer on CUDA
            (`freetoken.moe.expert_cache.default_cpu_threads`).
        dummy_weights: random weights (seeded) instead of reading safetensors.
        seed: seed of the dummy weights and the default sampling RNG.
        enforce_eager: no CUDA graphs (decode steps launch their kernels one by one).
        prefill_strategy: how prefill chunks reach experts that are not in the cache: "auto" (the cheapest by the
            cost model of `freetoken.moe.prefill`), "stream" (whole layers into double buffers, overlapped with
            compute), "fill" (copy the routed misses into slots), "cpu" (run them on the host), "hybrid" (q*).
        no_prefill_overlap: one layer buffer instead of two: each layer's copy waits for the previous layer's
            compute (for comparison).
        no_prefix_cache: prefill every prompt in full instead of reusing the K/V blocks of a cached prefix
            (`freetoken.engine.prefix_cache`; for comparison and debugging).
        state_checkpoints: hybrid models' recurrent-state snapshots (`freetoken.engine.state_checkpoints`), which
            let them reuse a cached prefix: "marks" (after the special tokens harnesses cut history at, and each
            prompt's end), "chunk" (at the end of every prefill chunk, upstream's scheme, for comparison) or "off"
            (every hybrid prompt prefilled in full).
        state_checkpoint_gb: the snapshots' memory budget on the compute device, in GB, evicted least recently
            used; 0 sizes it to 64 snapshots, at most 10 % of the device budget.
        state_checkpoint_host_gb: on CUDA, host memory (pinned) for snapshots evicted from the device, in GB; 0:
            none (evicted snapshots are dropped).
        kv_host_gb: host RAM for the prefix cache's blocks evicted from the device KV cache, in GB
            (`freetoken.engine.kv_host`); copied back on a prefix hit when cheaper than prefilling them again. -1
            (default): on CUDA, the free RAM after the expert pool less a safety margin, on a CPU device none; 0:
            none.
        state_checkpoint_spacing: "marks": tokens between the marks kept deep in a prompt (its last marks and its
            end are always kept).
        replay_routing: benchmarks only, with `dummy_weights`: the MoE routers replay a routing trace instead of
            routing ("synthetic": the calibrated synthetic trace of `benches/moe_backends.py`; or a `.fttrace`
            file), so the expert cache sees a real model's misses (`freetoken.moe.routing_replay`); "" is off.
        max_seqs_per_request: most choices (sequences) of one request running at once; 0 means the whole batch.
            Beside other requests, a request runs at most an equal split of the batch, and one of its sequences is
            preempted for a request that waits within its split (`freetoken.engine.admission`).
        max_request_output_tokens: most tokens one request may ask for over all its choices (n x max_tokens); a
            request over it is refused, naming the field, and one without max_tokens gets its share of it.
        stream_buffer_chunks: most output chunks (one token each) buffered for a client that is not reading; past
            it the request is paused (out of the batch, its KV blocks kept) until the client has read half.
        stream_pause_timeout_s: a request paused this long (its client read nothing) is aborted and freed.
        allow_nonfinite: serve weights with NaN or inf values (a sampled check at load refuses them otherwise,
            `freetoken.models.loader.check_finite_weights`).
        no_auto_profile: on CUDA without a bandwidth profile of this GPU and expert shape, do not measure one at
            start (`freetoken.bench.box.measure_profile`, ~10 s, written for later starts): `auto` then runs
            `offload`.
    """

    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_prefill_tokens: int = 8192
    max_model_len: int = 0
    kv_block_size: int = 16
    kv_cache_tokens: int = 0
    kv_cache_gb: float = 4.0
    moe_backend: str = "auto"
    gpu_memory_gb: float = 0.0
    activation_reserve_gb: float = 0.0
    expert_slots: int = 0
    expert_cache_policy: str = "lfu"
    cpu_threads: int = 0
    dummy_weights: bool = False
    seed: int = 0
    enforce_eager: bool = False
    prefill_strategy: str = "auto"
    no_prefill_overlap: bool = False
    no_prefix_cache: bool = False
    state_checkpoints: str = "marks"
    state_checkpoint_gb: float = 0.0
    state_checkpoint_host_gb: float = 8.0
    state_checkpoint_spacing: int = 1024
    kv_host_gb: float = -1.0
    replay_routing: str = ""
    max_seqs_per_request: int = 0
    max_request_output_tokens: int = 262144
    stream_buffer_chunks: int = 64
    stream_pause_timeout_s: float = 30.0
    allow_nonfinite: bool = False
    no_auto_profile: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the flag when a setting is out of range (a zero `max_num_seqs` would hang) or
        `device` is not a torch device this machine has."""
        parse_device(self.device)
        if self.dtype not in DTYPES:  # answered before the weights load, not after
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in (
            "max_num_seqs",
            "max_prefill_tokens",
            "kv_block_size",
            "stream_buffer_chunks",
            "max_request_output_tokens",
            "state_checkpoint_spacing",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "kv_cache_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: automatic), got {getattr(self, name)}")
        if not self.stream_pause_timeout_s > 0:
            raise ValueError(f"--stream-pause-timeout-s must be > 0, got {self.stream_pause_timeout_s}")
        if self.state_checkpoints not in STATE_CHECKPOINT_MODES:
            raise ValueError(
                f"--state-checkpoints {self.state_checkpoints!r}: choose from {', '.join(STATE_CHECKPOINT_MODES)}"
            )
        if self.state_checkpoint_gb < 0:
            raise ValueError(f"--state-checkpoint-gb must be >= 0 (0: automatic), got {self.state_checkpoint_gb}")
        if self.kv_host_gb < 0 and self.kv_host_gb != -1:
            raise ValueError(f"--kv-host-gb must be >= 0 (0: none) or -1 (default size), got {self.kv_host_gb}")
        if self.state_checkpoint_host_gb < 0:
            raise ValueError(f"--state-checkpoint-host-gb must be >= 0 (0: none), got {self.state_checkpoint_host_gb}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"--moe-backend {self.moe_backend!r}: choose from {', '.join(MOE_BACKENDS)}")
        if self.expert_cache_policy not in EXPERT_CACHE_POLICIES:
            raise ValueError(
                f"--expert-cache-policy {self.expert_cache_policy!r}: choose from {', '.join(EXPERT_CACHE_POLICIES)}"
            )
        if self.prefill_strategy not in PREFILL_STRATEGIES:
            raise ValueError(
                f"--prefill-strategy {self.prefill_strategy!r}: choose from {', '.join(PREFILL_STRATEGIES)}"
            )
        if self.replay_routing and not self.dummy_weights:
            raise ValueError(
                f"--replay-routing {self.replay_routing}: replaying a routing trace is for benchmarks on dummy weights "
                "(a real model's routers must route); add --dummy-weights or drop --replay-routing"
            )
        for name in ("gpu_memory_gb", "activation_reserve_gb", "expert_slots", "cpu_threads", "max_seqs_per_request"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: automatic), got {getattr(self, name)}")
