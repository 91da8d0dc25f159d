"""A tiny Qwen3.5-MoE checkpoint in the real on-disk layout, made without network (the Qwen3.5 counterpart of
`freetoken.models.demo`).

`build_qwen3_5_demo_checkpoint` writes a directory laid out as Qwen/Qwen3.5-35B-A3B is: `config.json` is the real
config (the shipped preset `qwen3.5-35b-a3b`, `Qwen3_5MoeForConditionalGeneration` with a nested `text_config`) with
the text sizes scaled down and its layer pattern kept (`full_attention_interval`), random weights under the text
model's exact tensor names (`model.language_model.layers.L.linear_attn.in_proj_qkv.weight`, `...self_attn.q_proj`
with the output gate's rows, `...mlp.shared_expert_gate.weight` ...), Qwen's BPE tokenizer and chat template from
the Qwen3 demo (Qwen3.5's own 248k-token vocabulary is not available offline; the config's vocab_size covers the
tokenizer's ids, and its eos is the tokenizer's `<|im_end|>`). No vision tower tensors are written (serving is
text-only; the loader skips `model.visual.*` where a real checkpoint has them).

Expert layouts (``expert_layout``):
- ``"fused"`` (the released Qwen3.5 checkpoints): ``model.language_model.layers.{L}.mlp.experts.gate_up_proj``
  [E, 2*I, H] (gate rows, then up rows) and ``...experts.down_proj`` [E, H, I];
- ``"per_expert"`` (what transformers' save_pretrained and derived checkpoints write):
  ``...experts.{e}.{gate_proj,up_proj,down_proj}.weight``.
Both layouts hold the same numbers for the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken.models.demo import DEMO_CONTEXT_TOKENS, write_demo_dir
from freetoken.models.presets import preset_config_path
from freetoken.paths import atomic_build, cache_root

PRESET = "qwen3.5-35b-a3b"
DEMO_NAME = "demo-qwen3.5-v1"
PREFIX = "model.language_model."
IM_END = 151645  # the Qwen tokenizer's <|im_end|>

# The text sizes that differ from Qwen3.5-35B-A3B's; every other key keeps its real value. float32 for the CPU
# comparisons, as the Qwen3 demo.
_DEMO_TEXT_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "vocab_size": 151936,
    "dtype": "float32",
    "eos_token_id": IM_END,
    "mtp_num_hidden_layers": 0,
}


def qwen3_5_demo_config(**overrides) -> dict:
    """The demo's config.json: the real Qwen3.5-35B-A3B config with `text_config` scaled down, then `overrides`
    (text_config keys), `layer_types` recomputed from `full_attention_interval` for the new depth.

    Raises:
        ValueError: an override names a key the real text_config does not have.
    """
    config = json.loads(preset_config_path(PRESET).read_text())
    text = config["text_config"]
    unknown = sorted(set(overrides) - set(text))
    if unknown:
        raise ValueError(f"unknown Qwen3.5 text_config keys {unknown}; known: {sorted(text)}")
    text.update(_DEMO_TEXT_SIZES)
    text.update(overrides)
    interval = text["full_attention_interval"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(text["num_hidden_layers"])
    ]
    config["tie_word_embeddings"] = text.get("tie_word_embeddings", config["tie_word_embeddings"])
    return config


def random_qwen3_5_weights(config: dict, seed: int, expert_layout: str) -> dict[str, torch.Tensor]:
    """Random float32 weights under the real Qwen3.5 tensor names (`model.language_model.*`, `lm_head.weight`),
    deterministic in `seed`: matrices and conv taps N(0, initializer_range), one-centred norms 0.1 N(0, 1), the
    DeltaNet output norm and dt_bias 1 + 0.1 N(0, 1), A_log log U(1, 16)."""
    text = config["text_config"]
    gen = torch.Generator().manual_seed(seed)
    std = text["initializer_range"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * std

    def near(value: float, size: int) -> torch.Tensor:
        return value + 0.1 * torch.randn(size, generator=gen)

    hidden, vocab, head_dim = text["hidden_size"], text["vocab_size"], text["head_dim"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_heads = text["linear_num_value_heads"]
    value_dim = value_heads * text["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    experts, inter, shared = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    weights = {PREFIX + "embed_tokens.weight": linear(vocab, hidden)}
    for layer, kind in enumerate(text["layer_types"]):
        p = f"{PREFIX}layers.{layer}."
        weights[p + "input_layernorm.weight"] = near(0.0, hidden)
        weights[p + "post_attention_layernorm.weight"] = near(0.0, hidden)
        if kind == "linear_attention":
            a = p + "linear_attn."
            weights[a + "in_proj_qkv.weight"] = linear(conv_dim, hidden)
            weights[a + "in_proj_z.weight"] = linear(value_dim, hidden)
            weights[a + "in_proj_b.weight"] = linear(value_heads, hidden)
            weights[a + "in_proj_a.weight"] = linear(value_heads, hidden)
            weights[a + "conv1d.weight"] = torch.randn(conv_dim, 1, text["linear_conv_kernel_dim"], generator=gen) * std
            weights[a + "dt_bias"] = near(1.0, value_heads)
            weights[a + "A_log"] = (1.0 + 15.0 * torch.rand(value_heads, generator=gen)).log()
            weights[a + "norm.weight"] = near(1.0, text["linear_value_head_dim"])
            weights[a + "out_proj.weight"] = linear(hidden, value_dim)
        else:
            a = p + "self_attn."
            weights[a + "q_proj.weight"] = linear(heads * head_dim * (2 if text["attn_output_gate"] else 1), hidden)
            weights[a + "k_proj.weight"] = linear(kv_heads * head_dim, hidden)
            weights[a + "v_proj.weight"] = linear(kv_heads * head_dim, hidden)
            weights[a + "o_proj.weight"] = linear(hidden, heads * head_dim)
            weights[a + "q_norm.weight"] = near(0.0, head_dim)
            weights[a + "k_norm.weight"] = near(0.0, head_dim)
        m = p + "mlp."
        weights[m + "gate.weight"] = linear(experts, hidden)
        weights[m + "shared_expert.gate_proj.weight"] = linear(shared, hidden)
        weights[m + "shared_expert.up_proj.weight"] = linear(shared, hidden)
        weights[m + "shared_expert.down_proj.weight"] = linear(hidden, shared)
        weights[m + "shared_expert_gate.weight"] = linear(1, hidden)
        gate = torch.stack([linear(inter, hidden) for _ in range(experts)])
        up = torch.stack([linear(inter, hidden) for _ in range(experts)])
        down = torch.stack([linear(hidden, inter) for _ in range(experts)])
        if expert_layout == "fused":
            weights[m + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
            weights[m + "experts.down_proj"] = down  # [E, H, I]
        else:
            for e in range(experts):
                weights[m + f"experts.{e}.gate_proj.weight"] = gate[e]
                weights[m + f"experts.{e}.up_proj.weight"] = up[e]
                weights[m + f"experts.{e}.down_proj.weight"] = down[e]
    weights[PREFIX + "norm.weight"] = near(0.0, hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    return weights


def build_qwen3_5_demo_checkpoint(
    dest: str | Path, *, seed: int = 0, num_shards: int = 1, expert_layout: str = "fused", **overrides
) -> Path:
    """Write a tiny random-weight Qwen3.5-MoE checkpoint in the released layout into `dest` (see the module docstring).

    Args:
        dest: directory to write (created; files of the same names are overwritten).
        seed: seed of the weights; the same seed gives the same numbers in either layout.
        num_shards: 1 writes model.safetensors; more writes shards and model.safetensors.index.json.
        expert_layout: "fused" (the released checkpoints) or "per_expert".
        **overrides: text_config values replacing the demo's (e.g. num_hidden_layers=8, tie_word_embeddings=True).

    Returns:
        `dest` as a Path.
    """
    return write_demo_dir(
        dest, qwen3_5_demo_config(**overrides), random_qwen3_5_weights, seed, expert_layout, num_shards
    )


def qwen3_5_demo_checkpoint_dir() -> Path:
    """The Qwen3.5 demo checkpoint that `ft serve --model demo-qwen3.5` serves (seed 0, fused experts, a
    `DEMO_CONTEXT_TOKENS` context as the Qwen3 demo's), built once into the cache beside it
    (`freetoken.models.demo.demo_checkpoint_dir`: same location rules, same atomic build)."""
    return atomic_build(
        cache_root() / "models" / DEMO_NAME,
        lambda dest: build_qwen3_5_demo_checkpoint(dest, max_position_embeddings=DEMO_CONTEXT_TOKENS),
    )
