"""Qwen3-MoE (`Qwen3MoeForCausalLM`) in torch, over a paged KV cache and a pluggable expert backend.

Follows the reference implementation in transformers (`models/qwen3_moe/modeling_qwen3_moe.py`): pre-norm
decoder layers; GQA attention with RMSNorm on q and k per head before RoPE; a softmax router over
`num_experts`, top-k, renormalised when `norm_topk_prob`; SwiGLU experts; dense SwiGLU MLP on the layers listed
in `mlp_only_layers` or off the `decoder_sparse_step` grid. Tensor names of the submodules match the checkpoint's
(`model.layers.L.self_attn.q_proj.weight` …) so the loader maps names one to one; routed experts are not
parameters of this module but live in the `ExpertBackend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.config import ModelConfig
from freetoken.kernels.layer_ops import add_rms_norm, qk_norm_rope, rms_norm, router_topk
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.moe.backend import ExpertBackend

# Devices whose tensors take the fused Triton kernels (`freetoken.kernels.layer_ops`, one GEMM for q/k/v); elsewhere
# the torch ops that follow transformers run. Tests add "cpu" to run the kernels in Triton's interpreter.
KERNEL_DEVICES = {"cuda"}


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 and cast back, as transformers' Qwen3MoeRMSNorm; on CUDA
    one fused kernel (`freetoken.kernels.layer_ops`), the torch ops below elsewhere."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, out_sum: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., n] -> normed x. With `residual` ([T, n], as x): the pre-norm block's residual add first, as
        vLLM's fused add-norm: (normed s, s) with s = residual + x (rounded as torch's add), written into `out_sum`
        when given (may be `residual`: in place)."""
        if residual is not None:
            if x.device.type in KERNEL_DEVICES:
                return add_rms_norm(x, residual, self.weight, self.eps, out_sum)
            s = torch.add(residual, x, out=out_sum)
            return self(s), s
        if x.device.type in KERNEL_DEVICES:
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE (Su et al. 2021) in the rotate-half layout of the Hugging Face Llama/Qwen family."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] int64 positions -> (cos, sin), each [T, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with cos/sin [T, D] -> rotated x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm, reading and writing the paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see `fuse_qkv`

    def fuse_qkv(self) -> None:
        """Re-seat q_proj, k_proj and v_proj's weights (and biases) as row views of one stacked tensor, so that on
        CUDA one GEMM projects all three (two kernel launches fewer per layer at decode). Call before the weights
        are loaded or after: the values are kept, and loading copies into the views in place."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projs])
        bias = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
        self.qkv = (weight, bias)

    def _stacked(self) -> bool:
        """Whether every q/k/v weight and bias is still its row view of the `fuse_qkv` tensors."""
        start = 0
        for p in (self.q_proj, self.k_proj, self.v_proj):
            for param, stacked in ((p.weight, self.qkv[0]), (p.bias, self.qkv[1])):
                if (param is None) != (stacked is None):
                    return False
                if param is not None:
                    offset = start * stacked.stride(0) * stacked.element_size()
                    if param.data_ptr() != stacked.data_ptr() + offset:
                        return False
            start += p.weight.shape[0]
        return True

    def _stacked_on(self, device: torch.device) -> bool:
        """Whether this step takes the fused path: a kernel device, and the weights still views of the stacked
        tensors of `fuse_qkv` (a `.to()` or an assignment since replaces them, and the stale copy is dropped)."""
        if device.type not in KERNEL_DEVICES or self.qkv is None:
            return False
        if not self._stacked():
            self.qkv = None
            return False
        return True

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D], by three GEMMs."""
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's K/V into `kv` (each [num_slots, num_kv_heads, head_dim]). On CUDA,
        while q/k/v are stacked (`fuse_qkv`), the q/k norms, RoPE and the KV write are one kernel
        (`freetoken.kernels.layer_ops.qk_norm_rope`)."""
        num_tokens = x.shape[0]
        cos, sin = rope
        if self._stacked_on(x.device):
            qkv = F.linear(x, *self.qkv)
            q = qk_norm_rope(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                cos,
                sin,
                kv[0],
                kv[1],
                meta.slot_mapping,
            )
            out = paged_attention(q, None, None, kv[0], kv[1], meta, self.scale)
        else:
            q, k, v = self._project(x)
            q, k = _apply_rope(self.q_norm(q), cos, sin), _apply_rope(self.k_norm(k), cos, sin)
            out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(gate x) * up x)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], in x's dtype and device."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax router: logits = x W^T ([T, E]), softmax in float32, top-k, optional renormalisation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in x's dtype). On CUDA the softmax, top-k and
        renormalisation are one kernel (`freetoken.kernels.layer_ops.router_topk`)."""
        if x.device.type in KERNEL_DEVICES:
            return router_topk(F.linear(x, self.weight), self.top_k, self.norm_topk_prob, x.dtype)
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router on the compute device; the routed experts are computed by the shared `ExpertBackend`."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg)
        self.experts: ExpertBackend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the routed experts' weighted sum [T, H]; raises RuntimeError without an expert backend."""
        if self.experts is None:
            raise RuntimeError(f"layer {self.layer}: no expert backend attached (Model.attach_experts)")
        ids, weights = self.gate(x)
        return self.experts.forward(self.layer, x, ids, weights)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); each residual add is fused into the norm after it
    (vLLM's convention): a layer takes and returns (branch output, residual stream), whose sum is the hidden state.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = (
            SparseMoeBlock(cfg, layer) if cfg.is_moe_layer(layer) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]: the last layer's branch output (the embeddings for the first layer, with `residual` None).
        Returns (this layer's MLP output, the residual stream before it)."""
        h, residual = self.attend(x, residual, rope, kv, meta)
        return self.mlp(h), residual

    def attend(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out_residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half of the block and the MLP's norm: (post_attention_layernorm(s), s), with s = the
        residual stream after attention, written into `out_residual` when given."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), residual, out_residual)


class Qwen3MoeModel(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class Qwen3MoeForCausalLM(nn.Module):
    """The causal LM: `forward` runs one step's tokens, `compute_logits` the LM head on selected rows.

    The routed experts come from the backend given to `attach_experts`; everything else is a parameter of this
    module, named as in the checkpoint.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attach_experts(self, backend: ExpertBackend) -> None:
        """Route every MoE layer's expert computation to `backend`."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts = backend

    @property
    def experts(self) -> ExpertBackend | None:
        """The attached expert backend (None before `attach_experts` or without MoE layers)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                return layer.mlp.experts
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: [T] int64, the step's tokens (sequences concatenated, see AttentionMetadata).
            meta: positions, KV slots and per-sequence spans of the step.
            kv_caches: per decoder layer (k_cache, v_cache), each [num_slots, num_kv_heads, head_dim],
                written in place.

        Returns:
            [T, H] final hidden states (after the last RMSNorm).
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(meta.positions, x.dtype)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv, meta)
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
        """Run decoder layers from `start` up to the next MoE layer's routed experts (for piecewise CUDA graphs:
        everything but the experts can be captured). x and residual as `DecoderLayer.forward` takes them.

        Returns:
            (that MoE layer's normed expert input, its residual stream (in `out_residual` when given), its index),
            or (the final norm's output, the residual stream, -1) after the last layer.
        """
        for i in range(start, len(self.model.layers)):
            layer = self.model.layers[i]
            if isinstance(layer.mlp, SparseMoeBlock):
                h, residual = layer.attend(x, residual, rope, kv_caches[i], meta, out_residual)
                return h, residual, i
            x, residual = layer(x, residual, rope, kv_caches[i], meta)
        h, residual = self.model.norm(x, residual)
        return h, residual, -1

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] hidden -> [N, vocab_size] float32 logits."""
        return self.lm_head(hidden).float()
