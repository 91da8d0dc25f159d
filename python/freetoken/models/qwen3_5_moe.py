"""Qwen3.5/3.6-MoE (`Qwen3_5MoeForCausalLM`, and the text model of `Qwen3_5MoeForConditionalGeneration`) in torch.

Semantics follow transformers' `models/qwen3_5_moe/modeling_qwen3_5_moe.py` (the reference of the exactness tests):
- a hybrid stack: `layer_types[L]` is "linear_attention" (Gated DeltaNet, `GatedDeltaNet`: a short causal conv over
  q/k/v, the gated delta rule of `freetoken.kernels.gated_delta`, a gated RMSNorm by z, out_proj) or
  "full_attention" (`GatedAttention`: GQA over the paged KV cache with per-head q/k RMSNorm, RoPE on the first
  `rotary_dim` dims of each head only, and a sigmoid gate per head on the output, q_proj emitting [q | gate] per
  head);
- every layer's MLP is a MoE: softmax router, top-k renormalised, routed SwiGLU experts through the shared
  `ExpertBackend` (fused / offload / cpu / hybrid, as Qwen3-MoE), plus a shared SwiGLU expert scaled by
  sigmoid(shared_expert_gate x);
- RMSNorms centred on one (`x * (1 + w)`, computed in float32), except the DeltaNet output norm (`x * w`).

A sequence's linear-layer state lives in the `RecurrentStatePool` (`attach_state`), at the slot that
`AttentionMetadata.state_slots` names per sequence of the step. The K/V of the full-attention layers live in the
paged KV cache, one (k, v) pair per full-attention layer in layer order (`kv_caches`).

Module names follow the checkpoint's below the text-model prefix (`model.layers.L.linear_attn.in_proj_qkv.weight`
...; `ModelConfig.weight_prefix` says where the checkpoint keeps them). As in vLLM, a layer takes and returns (branch
output, residual stream); the MoE layer's shared expert is added into the residual stream and its routed experts are
the branch output, so that a CUDA-graph decode step that runs the routed experts between graphs
(`freetoken.engine.cuda_graph`) needs nothing after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.config import ModelConfig
from freetoken.kernels.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_torch,
)
from freetoken.models import qwen3_moe
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.models.qwen3_moe import DenseMLP, RotaryEmbedding, _apply_rope

if TYPE_CHECKING:  # the engine owns the state pool and imports the models: a runtime import here would be circular
    from freetoken.engine.state_pool import RecurrentStatePool
from freetoken.models.qwen3_moe import SparseMoeBlock as _RoutedMoeBlock

# Devices whose tensors take this module's Triton kernels (the gated delta rule); elsewhere the torch reference.
# Tests add "cpu" to run them in Triton's interpreter.
KERNEL_DEVICES = {"cuda"}


class OneCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from one: (x / rms(x)) * (1 + w) in float32, cast back (transformers'
    `Qwen3_5MoeRMSNorm`; the checkpoint's zeros are the identity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, out_sum: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., n] -> normed x. With `residual`: (normed s, s) with s = residual + x, written into `out_sum` when
        given (the fused add-norm convention of `freetoken.models.qwen3_moe.RMSNorm`)."""
        if residual is not None:
            s = torch.add(residual, x, out=out_sum)
            return self(s), s
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: (w * (x / rms(x)).to(dtype)) * silu(z) (transformers' `Qwen3_5MoeRMSNormGated`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [..., n] -> [..., n] in x's dtype."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(z.float())).to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with cos/sin [T, R] (R <= D): rotate-half RoPE on the first R dims, the rest passed through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return _apply_rope(x, cos, sin)
    return torch.cat((_apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class GatedAttention(nn.Module):
    """GQA softmax attention with q/k RMSNorm, partial RoPE and a sigmoid output gate, over the paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.gated = cfg.attn_output_gate
        bias = cfg.attention_bias
        q_out = self.num_heads * self.head_dim * (2 if self.gated else 1)
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OneCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OneCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's K/V into `kv` (each [num_slots, num_kv_heads, head_dim])."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, -1)
        gate = None
        if self.gated:  # per head [q | gate], head_dim each
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(k), cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale).reshape(num_tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def causal_conv_decode(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One new input per sequence through the depthwise causal conv + SiLU, the window read and written at `slots`.

    Args:
        x: [B, C] this step's conv inputs.
        conv: [num_slots, C, K - 1] windows (the previous K - 1 inputs), written in place.
        weight: [C, K] the conv taps.
        slots: [B] int64.

    Returns:
        [B, C] in x's dtype.
    """
    window = torch.cat((conv[slots], x[:, :, None].to(conv.dtype)), dim=-1)  # (B, C, K)
    conv[slots] = window[:, :, 1:]
    # Accumulated in float32 and rounded once to the weights' dtype, as the prefill's F.conv1d (and transformers').
    out = (window.float() * weight.float()).sum(-1).to(weight.dtype)
    return F.silu(out).to(x.dtype)


def causal_conv_span(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
    """A span of L inputs of one sequence through the depthwise causal conv + SiLU, continuing its window at `slot`.

    Args:
        x: [L, C]; conv: [num_slots, C, K - 1] windows, row `slot` written in place; weight: [C, K].

    Returns:
        [L, C] in x's dtype.
    """
    width = conv.shape[-1]
    full = torch.cat((conv[slot], x.t().to(conv.dtype)), dim=-1)  # (C, K - 1 + L)
    conv[slot] = full[:, full.shape[1] - width :]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # (C, L)
    return F.silu(out).t().contiguous().to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer (transformers' `Qwen3_5MoeGatedDeltaNet`), over the state pool."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        channels = cfg.linear_conv_dim
        self.conv1d = nn.Conv1d(channels, channels, cfg.linear_conv_kernel_dim, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]. `state` is this layer's (conv windows, delta-rule states) of the pool; each sequence's
        row (`meta.state_slots`) is read and advanced past its tokens of the step."""
        conv, ssm = state
        num_tokens = x.shape[0]
        mixed = self.in_proj_qkv(x)  # (T, C)
        z = self.in_proj_z(x).view(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # (T, Hv) log decay
        weight = self.conv1d.weight[:, 0, :]
        slots = meta.state_slots
        if all(q == 1 for q in meta.query_lens):  # decode: fixed shapes, no host sync (CUDA-graph capturable)
            mixed = causal_conv_decode(mixed, conv, weight, slots)
            q, k, v = self._split(mixed)
            fn = recurrent_gated_delta_rule if x.device.type in KERNEL_DEVICES else recurrent_gated_delta_rule_torch
            core = fn(q, k, v, g, beta, ssm, slots)
        else:
            core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
            start = 0
            slot_list = slots.tolist()
            for i, length in enumerate(meta.query_lens):
                slot = slot_list[i]
                # Sub-spans end where a snapshot is taken (`AttentionMetadata.state_splits`): the state after each
                # is handed out before the next one advances it.
                splits = meta.state_splits[i] if meta.state_splits is not None else []
                lo = 0
                for hi in [*splits, length]:
                    rows = slice(start + lo, start + hi)
                    q, k, v = self._split(causal_conv_span(mixed[rows], conv, weight, slot))
                    core[rows] = self._chunk(q, k, v, g[rows], beta[rows], ssm[slot])
                    if hi < length and meta.state_capture is not None:
                        meta.state_capture(self.layer, i, hi, conv[slot], ssm[slot])
                    lo = hi
                start += length
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, C] -> q, k [T, Hk, Dk], v [T, Hv, Dv]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        num_tokens = mixed.shape[0]
        return (
            q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(num_tokens, self.num_v_heads, self.head_v_dim),
        )

    def _chunk(self, q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
        """One sequence's span through the chunked rule: o [L, Hv, Dv]; `state` ([Hv, Dk, Dv] float32, a pool row)
        advanced in place."""
        if q.device.type in KERNEL_DEVICES:
            return chunk_gated_delta_rule(q, k, v, g, beta, state)
        out, state[:] = chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
        return out


class SparseMoeBlock(_RoutedMoeBlock):
    """Router + routed experts (through the `ExpertBackend`, as Qwen3-MoE's block) + a shared expert whose output is
    scaled by sigmoid(shared_expert_gate x). `forward` returns the routed experts' sum only; `shared` the rest."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the gated shared expert's output [T, H]."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(qwen3_moe.DecoderLayer):
    """Pre-norm block: token mixer (Gated DeltaNet or gated attention), then the MoE, residual adds fused into the
    next norm; a layer takes and returns (branch output, residual stream). `forward` is Qwen3-MoE's: here the
    branch output is the routed experts' and the residual stream carries the shared expert's (see `attend`)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)  # not Qwen3-MoE's modules: the mixer, norms and MoE differ
        self.layer_type = cfg.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoeBlock(cfg, layer)
        self.input_layernorm = OneCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OneCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attend(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        mixer_state: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out_residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token mixer, the MoE's norm and its shared expert: (post_attention_layernorm(s), s + shared(norm(s)))
        with s the residual stream after the mixer; the second is written into `out_residual` when given.
        `mixer_state` is the layer's (k, v) cache for attention, its (conv, ssm) pool tensors for Gated DeltaNet."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(h, mixer_state, meta)
        else:
            mixed = self.self_attn(h, rope, mixer_state, meta)
        h, residual = self.post_attention_layernorm(mixed, residual, out_residual)
        residual.add_(self.mlp.shared(h))
        return h, residual


class Qwen3_5MoeModel(nn.Module):
    """Embeddings, decoder layers, final norm (the text model: `model.` or `model.language_model.` in checkpoints)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = OneCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)


class Qwen3_5MoeForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """The causal LM with the interface of `freetoken.models.qwen3_moe.Qwen3MoeForCausalLM` (whose attach_experts,
    experts and compute_logits it keeps), plus `attach_state` for the linear layers' recurrent-state pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # Qwen3-MoE's would build its own text model
        self.config = cfg
        self.model = Qwen3_5MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Full-attention layer -> its index in the KV cache's per-layer list.
        self.kv_index = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        self.state_pool: RecurrentStatePool | None = None

    def attach_state(self, pool: RecurrentStatePool) -> None:
        """Read and write the linear layers' recurrent states in `pool` (at `AttentionMetadata.state_slots`)."""
        self.state_pool = pool

    def _mixer_state(self, layer: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        if layer in self.kv_index:
            return kv_caches[self.kv_index[layer]]
        if self.state_pool is None:
            raise RuntimeError("Qwen3.5 linear-attention layers need a recurrent-state pool (attach_state)")
        return self.state_pool.layers[layer]

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: [T] int64, the step's tokens (sequences concatenated, see AttentionMetadata).
            meta: positions, KV slots, per-sequence spans and `state_slots` ([B] int64) of the step.
            kv_caches: per full-attention layer, in layer order, (k_cache, v_cache), written in place.

        Returns:
            [T, H] final hidden states (after the last norm).
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(meta.positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, self._mixer_state(i, kv_caches), meta)
        return self.model.norm(x, residual)[0]

    def run_until_moe(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        start: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        out_residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run layer `start` up to its routed experts (every layer is a MoE layer), as
        `Qwen3MoeForCausalLM.run_until_moe`: (the experts' input, the residual stream, the layer), or (the final
        norm's output, the residual stream, -1) when `start` is past the last layer."""
        if start < len(self.model.layers):
            h, residual = self.model.layers[start].attend(
                x, residual, rope, self._mixer_state(start, kv_caches), meta, out_residual
            )
            return h, residual, start
        h, residual = self.model.norm(x, residual)
        return h, residual, -1


def init_dummy_(model: Qwen3_5MoeForCausalLM, gen: torch.Generator, std: float) -> None:
    """Random weights of the real structure in place: N(0, std) matrices and conv taps, identity norms (0 for the
    one-centred ones, 1 for the DeltaNet output norm), dt_bias 1 and A = 1..16 (log stored), as transformers'
    `_init_weights` draws them."""
    for name, param in model.named_parameters():
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):
            param.fill_(1.0)
        elif name.endswith("norm.weight"):
            param.zero_()
        elif name.endswith("A_log"):
            param.copy_(torch.linspace(1.0, 16.0, param.numel(), device=param.device).log())
        else:
            param.normal_(0.0, std, generator=gen)


__all__ = ["GatedAttention", "GatedDeltaNet", "Qwen3_5MoeForCausalLM", "init_dummy_"]
