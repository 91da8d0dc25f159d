"""Device memory that one step of the models allocates beyond the weights and caches: the activations of a
prefill chunk, on CUDA, by part of a layer (`step_activation_nbytes`).

Each part's figure is the bytes live at that part's peak, what it allocates and what lives across it, counted from
the code of the CUDA path (the models' torch ops and the launchers of the Triton kernels, which allocate their
outputs in torch). Letters: T tokens in the step (at most `--max-prefill-tokens`), C the longest context a prefill
span attends over (at most `max_model_len`), H hidden, d the dtype's bytes, k top-k, E experts, I the expert
intermediate size.

Across every part live the RoPE tables (cos and sin, [T, rotary_dim] each) and four [T, H] tensors of the residual
stream: the caller's branch output and residual stream (held by the loop over layers while the layer runs), and the
layer's residual stream and normed input (`DecoderLayer.attend`).

`tests/models/test_activations.py` checks every part against the bytes measured live during a whole forward pass of
the real Qwen3-30B-A3B and Qwen3.5-35B-A3B configs (on the "meta" device, through the CUDA code path) and of small
configs with real tensors (Triton's interpreter): the figure must never be below the measured peak, and it is
within a few MB above it. `tests/models/test_activations_gpu.py` checks the whole on the GPU
(`torch.cuda.max_memory_allocated`).
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig
from freetoken.kernels.gated_delta import chunk_scratch_nbytes

# Rows of the grouped expert kernel's M tiles at prefill sizes (`freetoken.kernels.fused_moe.block_m_for`).
PREFILL_BLOCK_M = 64
# Bytes per logit of the sampled rows ([rows, vocab]) beside the LM head's output: the float32 logits and their
# log-softmax (measured: 8.0 bytes per logit for `sample_with_logprobs` and for prompt log-probabilities), and one
# row's sampling at a time (`freetoken.engine.sampler`: scores, probabilities, a sorted copy, its int64 order, the
# cumulative sum and mask of top-p; 8 bytes per entry each, counted generously).
SAMPLER_BYTES_PER_LOGIT = 8
SAMPLER_ROW_VECTORS = 6
# Rows of logits made at once for prompt log-probabilities (`ModelRunner.PROMPT_LOGITS_ROWS`).
PROMPT_LOGITS_ROWS = 128


def expert_kernel_rows(num_tokens: int, top_k: int, num_experts: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Rows of the grouped expert kernel's intermediate `h` (`freetoken.kernels.fused_moe.align_pairs`): the T·k
    (token, expert) pairs, each expert's group padded to a multiple of `block_m`."""
    pairs = num_tokens * top_k
    rows = pairs + min(pairs, num_experts + 1) * (block_m - 1)
    return -(-rows // block_m) * block_m


def step_activation_nbytes(
    cfg: ModelConfig, num_tokens: int, max_context: int, max_num_seqs: int, dtype: torch.dtype
) -> dict[str, int]:
    """Bytes live at the peak of each part of a step of `num_tokens` tokens on CUDA, by part.

    Args:
        cfg: the model.
        num_tokens: T, the step's tokens (prompt chunks and decodes; at most `--max-prefill-tokens`).
        max_context: C, the longest context a sequence of the step attends over (`max_model_len`).
        max_num_seqs: sequences of a step (rows of logits sampled; the decodes beside a prefill chunk).
        dtype: the compute dtype.

    Returns:
        {part: bytes}; the step's peak is the largest. Parts: "embeddings" (and the RoPE tables), "attention" (q/k/v,
        flash attention over the paged cache, its K/V gathered per prefill span, the decodes' beside it),
        "linear_attention" (Qwen3.5's Gated DeltaNet: the conv, the chunked delta rule, the gated norm), "norms" (the
        float32 RMSNorms between them), "moe" (router and grouped expert kernel), "dense_mlp" (layers without routed
        experts), "shared_expert" (Qwen3.5), "logits" (the LM head on the sampled rows and the sampler; prompt
        log-probabilities 128 rows at a time).
    """
    t, h, d = num_tokens, cfg.hidden_size, torch.empty((), dtype=dtype).element_size()
    # The step's metadata (`AttentionMetadata`, made before the forward pass): positions and KV slots int64 [T], each
    # sequence's context slots int64 (at most C), the decodes' block tables int32 [rows, C / block size at least 1].
    metadata = 2 * t * 8 + max_num_seqs * max_context * (8 + 4)
    # RoPE tables and the residual stream (module docstring).
    stream = metadata + 2 * t * cfg.rotary_dim * d + 4 * t * h * d
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = cfg.rotary_dim
    # Before the first layer: the embeddings, and the RoPE tables made in float32 (`RotaryEmbedding`: the angles
    # [T, rot / 2], both halves [T, rot], cos and sin) before their cast.
    parts = {"embeddings": metadata + t * h * d + t * rot * 4 * (1 + 1 + 2) // 2 * 2 + 2 * t * rot * d}
    q_bytes = t * heads * head_dim * d
    gathered_kv = 2 * max_context * kv_heads * head_dim * d  # one prefill span's K and V read from the cache
    flash = q_bytes + t * heads * 4  # its output and float32 log-sum-exp
    # A step that prefills beside up to max_num_seqs - 1 decodes (`paged_attention`): the Triton decode kernel reads
    # their contexts in place (single pass, no scratch); their queries gathered and their outputs.
    num_decodes = max(min(max_num_seqs, t) - 1, 0)
    gathered_kv += num_decodes * 2 * heads * head_dim * d
    if cfg.is_qwen3_5:
        parts.update(_qwen3_5_mixers(cfg, t, d, stream, q_bytes, gathered_kv + flash))
        # OneCenteredRMSNorm: the layer's add-norm allocates s and its normed output beside the mixer's output, and
        # computes in float32 (x / rms(x) and its product with 1 + w).
        parts["norms"] = stream + 3 * t * h * d + 2 * t * h * 4
        inter = cfg.shared_expert_intermediate_size
        # The shared expert runs after the MoE's norm: the mixer's output and the norm's s stay live beside it.
        # DenseMLP: silu(gate), up and their product, then the product and down's output; sigmoid(gate) [T, 1].
        parts["shared_expert"] = stream + t * h * d + t * d + max(3 * t * inter * d, t * inter * d + t * h * d)
    else:
        # Fused q/k/v GEMM [T, (heads + 2 kv_heads) D]; q normed and rotated out of it (`qk_norm_rope`, which writes
        # K/V into the cache); attention's output rows; flash attention.
        qkv = t * (heads + 2 * kv_heads) * head_dim * d
        parts["attention"] = stream + qkv + 2 * q_bytes + gathered_kv + flash
        # `add_rms_norm` (Triton): after attention, o_proj's output, then s and the normed output.
        parts["norms"] = stream + 3 * t * h * d
        if len(cfg.moe_layers) < cfg.num_hidden_layers:
            # DenseMLP: silu(gate), up and their product ([T, intermediate_size] each).
            parts["dense_mlp"] = stream + 3 * t * cfg.intermediate_size * d
    k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    rows = expert_kernel_rows(t, k, cfg.num_experts)
    # Router: ids int64 and weights [T, k]; alignment: sorted pairs int64 [R] and tile experts [R / 64] (the expert
    # cache's on-demand strategies copy its plan to the device: slot ids int64 [T, k] too; `stream` maps the tiles to
    # weight rows: three more [R / 64]); the kernel's gate/up intermediate h [R, I], the per-pair outputs [T·k, H]
    # summed over k into [T, H].
    routing = t * k * (8 + 8 + d) + rows * 8 + 4 * (rows // PREFILL_BLOCK_M) * 8
    parts["moe"] = stream + routing + rows * inter * d + t * k * h * d + t * h * d
    sampled = max(max_num_seqs, PROMPT_LOGITS_ROWS)
    v = cfg.vocab_size
    parts["logits"] = t * h * d + sampled * v * (d + SAMPLER_BYTES_PER_LOGIT) + SAMPLER_ROW_VECTORS * v * 8
    return parts


def _qwen3_5_mixers(cfg: ModelConfig, t: int, d: int, stream: int, q_bytes: int, sdpa: int) -> dict[str, int]:
    """The token mixers of Qwen3.5 (`freetoken.models.qwen3_5_moe`, torch ops on CUDA but for the delta rule)."""
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
    gate = q_bytes if cfg.attn_output_gate else 0
    kv = 2 * t * kv_heads * head_dim * d
    # GatedAttention: q_proj's output [T, heads, 2D] (q and its gate, the gate copied out), k and v; the q norm in
    # float32 (q.float() and x / rms(x), then the cast); later, q rotated, attention's output rows and flash
    # attention beside the gate (partial RoPE's temporaries are fewer than the norm's: rotary_dim <= head_dim).
    norm_stage = stream + (q_bytes + gate) + gate + kv + 2 * 2 * q_bytes + q_bytes
    sdpa_stage = stream + gate + kv + 2 * q_bytes + sdpa
    parts = {"attention": max(norm_stage, sdpa_stage)}
    conv, value_dim = cfg.linear_conv_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    v_heads = cfg.linear_num_value_heads
    # GatedDeltaNet: in_proj_qkv's output [T, conv], z [T, value_dim], beta (d) and the log decay g (float32, and
    # its softplus's float32 temporaries) [T, v_heads], the output rows `core` [T, value_dim]; then, one at a time:
    base = stream + t * conv * d + 2 * t * value_dim * d + t * v_heads * (d + 4 * 4)
    # the conv (`causal_conv_span`): the window and the span concatenated, conv1d's output, SiLU, the transpose;
    conv_stage = base + 4 * t * conv * d
    # the chunked rule (`chunk_gated_delta_rule`): beside the conv's output, its float32 scratch (w, u, the
    # cumulated decay and each 64-token chunk's starting state, `chunk_scratch_nbytes`), the output [T, value_dim];
    scratch = chunk_scratch_nbytes(t, v_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    chunk_stage = base + t * conv * d + scratch + t * value_dim * d
    # the gated norm (`GatedRMSNorm`): x / rms(x) float32, w times it in d, z float32 and silu(z) float32.
    norm_stage = base + t * conv * d + t * value_dim * (4 + d + 4 + 4)
    parts["linear_attention"] = max(conv_stage, chunk_stage, norm_stage)
    return parts
