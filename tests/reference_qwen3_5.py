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


# The bfloat16 check's prompts: one short, one of 85 tokens (two delta-rule chunks).
BF16_PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 5]


def check_bfloat16_against_transformers(tmp_path: Path, device: str, seeds: int = 4, steps: int = 16) -> str:
    """The engine in bfloat16 on `device` against transformers' `qwen3_5_moe` on scaled-down checkpoints (one per
    seed, `lm_head_std` 0.6 for well-separated logits); raises AssertionError unless both hold:

    - precision: teacher-forced, the engine's bfloat16 logits lie no further from exact compute (the reference in
      float32 with bfloat16-rounded weights) than transformers' own bfloat16 logits do (`greedy.bf16_logit_errors`,
      summed over seeds; 10% slack for another rounding order: on the CPU the engine's figure is 0.97x
      transformers', and a decay g rounded to bfloat16 makes it 1.27x);
    - tokens: `steps` greedy tokens equal transformers' bfloat16 ones except from a near-tie within the
      reference's own bfloat16 error (`greedy.follows_reference_bf16`). How many sequences match all the way is
      reported, not asserted: transformers' bfloat16 tokens follow its own float32 ones all 16 steps in 0 of the
      8 sequences (CPU), so any other rounding order parts from them at such ties early.

    Returns the line of figures (for the test's output)."""
    import copy

    from freetoken.config import EngineConfig
    from freetoken.engine.llm_engine import LLMEngine
    from greedy import bf16_logit_errors, follows_reference_bf16, greedy_tokens

    ours = theirs = 0.0
    full = total = 0
    for seed in range(seeds):
        ref32 = make_reference_checkpoint(tmp_path / f"ref{seed}", seed=seed, lm_head_std=0.6).to(device)
        cfg = EngineConfig(device=device, dtype="bfloat16", moe_backend="fused", kv_cache_gb=0.5)
        engine = LLMEngine.from_dir(tmp_path / f"ref{seed}", cfg)
        got = greedy_tokens(engine, BF16_PROMPTS, steps)
        full += follows_reference_bf16(
            copy.deepcopy(ref32).to(torch.bfloat16), BF16_PROMPTS, got, steps, f"seed {seed}", ref32=ref32
        )
        total += len(BF16_PROMPTS)
        engine = LLMEngine.from_dir(tmp_path / f"ref{seed}", cfg)  # a fresh one: no prefix cache hits
        a, b = bf16_logit_errors(engine, ref32, BF16_PROMPTS, steps)
        ours, theirs = ours + a, theirs + b
    line = (
        f"bf16 logit error vs exact compute (mean over steps of max |err|): engine {ours / seeds:.3f}, transformers "
        f"{theirs / seeds:.3f}; {full} of {total} sequences equal transformers' bf16 for all {steps} steps"
    )
    assert ours <= 1.1 * theirs, line
    return line
