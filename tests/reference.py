"""Small Qwen3-MoE checkpoints made by the reference implementation (transformers), for exactness tests.

Each is the real Qwen3-30B-A3B config (the preset shipped in `freetoken.models.presets`, a byte-exact copy of
`shared/models/qwen3-30b-a3b/config.json`) scaled down: same keys and
structure, fewer layers and experts, smaller sizes; saved by `save_pretrained`, i.e. in the real on-disk layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken.models.presets import preset_config_path

SCALED_DOWN = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=1024,
    torch_dtype="float32",
    bos_token_id=510,
    eos_token_id=511,
)


def real_config() -> dict:
    """The real Qwen3-30B-A3B config.json."""
    return json.loads(preset_config_path("qwen3-30b-a3b").read_text())


def make_reference_checkpoint(dest: Path, seed: int = 0, lm_head_std: float = 0.15, **overrides) -> torch.nn.Module:
    """Save a random scaled-down Qwen3-MoE with transformers into `dest`; return the transformers model (eval).

    Matrices are N(0, 0.15) (large enough that greedy output does not repeat one token); `lm_head_std` sets the
    LM head's, which scales the gaps between logits (bfloat16 comparisons use a larger one, so that the top-2
    margin stays above bfloat16 rounding).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    raw = real_config()
    raw.pop("transformers_version", None)
    raw.update(SCALED_DOWN)
    raw.update(overrides)
    cfg = Qwen3MoeConfig(**raw)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, lm_head_std if name == "lm_head.weight" else 0.15)
    model.save_pretrained(dest)
    return model
