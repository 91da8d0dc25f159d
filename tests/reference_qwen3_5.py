"""Small Qwen3.5-MoE checkpoints made by the reference implementation (transformers' `qwen3_5_moe`), for exactness
tests.

Each is the real Qwen3.5-35B-A3B config (the preset shipped in `freetoken.models.presets`, a byte-exact copy of
`shared/models/qwen3.5-35b-a3b/config.json`) scaled down: same keys and structure (Gated DeltaNet layers with one
full-attention layer every `full_attention_interval`, partial rotary, gated attention output, shared expert), fewer
layers and experts, smaller sizes; saved by `save_pretrained` in the real on-disk layout
(`Qwen3_5MoeForConditionalGeneration`: `model.language_model.*` and a tiny vision tower; `Qwen3_5MoeForCausalLM`:
`model.*`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken.models.presets import preset_config_path

TEXT_SCALED_DOWN = dict(
    hidden_size=64,
    num_hidden_layers=4,  # one period of the real layer pattern (3 Gated DeltaNet, 1 full attention)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # rotary_dim 8 with the real partial_rotary_factor 0.25
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    vocab_size=512,
    max_position_embeddings=1024,
    dtype="float32",
    eos_token_id=511,
    mtp_num_hidden_layers=0,
)
VISION_SCALED_DOWN = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def real_config() -> dict:
    """The real Qwen3.5-35B-A3B config.json."""
    return json.loads(preset_config_path("qwen3.5-35b-a3b").read_text())


def scaled_text_config(**overrides) -> dict:
    """The real text_config scaled down, its layer_types recomputed with the real full_attention_interval."""
    text = real_config()["text_config"]
    text.update(TEXT_SCALED_DOWN)
    text.update(overrides)
    interval = text["full_attention_interval"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(text["num_hidden_layers"])
    ]
    return text


def make_reference_checkpoint(
    dest: Path, seed: int = 0, causal_lm: bool = False, lm_head_std: float = 0.15, **overrides
) -> torch.nn.Module:
    """Save a random scaled-down Qwen3.5-MoE with transformers into `dest`; return the transformers model (eval).

    Matrices are N(0, 0.15), norms 0.1 N(0, 1) around their identity, A_log and dt_bias as transformers draws them;
    `causal_lm` saves a `Qwen3_5MoeForCausalLM` (flat config, `model.*` names) instead of the
    conditional-generation checkpoint the released models are.
    """
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    text = scaled_text_config(**overrides)
    torch.manual_seed(seed)
    if causal_lm:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    else:
        raw = real_config()
        raw.pop("transformers_version", None)
        raw["text_config"] = text
        raw["tie_word_embeddings"] = text.get("tie_word_embeddings", raw["tie_word_embeddings"])  # the outer one ties
        raw["vision_config"].update(VISION_SCALED_DOWN)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**raw))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, lm_head_std if name == "lm_head.weight" else 0.15)
    model.save_pretrained(dest)
    return model
