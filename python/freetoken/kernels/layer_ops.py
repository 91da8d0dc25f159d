"""The small ops of a decoder layer, each fused into one Triton kernel: RMSNorm and the router's softmax + top-k.

At decode batch sizes these ops move a few KB each, so their cost is kernel count: torch runs an RMSNorm as ~8
elementwise and reduction kernels and a softmax router's top-k and renormalisation as ~6, about 40 kernels of a
Qwen3-MoE layer's ~75 (two hidden-state norms, the per-head q and k norms, the router; torch profiler of a decode
step, benches/moe_backends.py --profile). Here each is one kernel, with the same maths and roundings as the torch
modules in `freetoken.models.qwen3_moe` (which follow transformers' Qwen3-MoE): statistics in float32, the
normalised value rounded to the input dtype before the weight multiplies it (as `Qwen3MoeRMSNorm`; bit for bit
the torch result on the H200), router softmax in float32. RoPE stays in torch: a fused norm + RoPE kernel with the
same formula gave different last bits on ~17% of q/k elements there, and bf16 greedy decoding then left
transformers' tokens at more near-ties (2 of 8 sequences whole against 6 of 8).

Shapes: T tokens, H hidden, D head dim, E experts, k top-k.
Test: python -m pytest tests/test_kernels.py (interpreted on the CPU in CI, compiled on CUDA in tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, inner, stride_xa, stride_xb, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + (row // inner) * stride_xa + (row % inner) * stride_xb + offs, mask=ok, other=0.0)
    x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`.

    Args:
        x: [..., n] with at most 3 dims, the last one contiguous (any strides before it: a per-head norm reads q
            straight out of the stacked q/k/v projection).
        weight: [n].
        eps: added to the mean square.

    Returns:
        [..., n] in x's dtype, a new contiguous tensor.
    """
    if x.dim() > 3 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: needs at most 3 dims and a contiguous last dim, got {x.shape} {x.stride()}")
    x3 = x.view(1, 1, -1) if x.dim() == 1 else x.unsqueeze(1) if x.dim() == 2 else x
    outer, inner, n = x3.shape
    out = torch.empty(outer * inner, n, dtype=x.dtype, device=x.device)
    if out.shape[0]:
        _rms_norm_kernel[(out.shape[0],)](x3, weight, out, n, inner, x3.stride(0), x3.stride(1), out.stride(0), eps,
                                          BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


@triton.jit
def _router_topk_kernel(logits_ptr, ids_ptr, w_ptr, num_experts, stride_l,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < num_experts
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(ok, p / tl.sum(p, axis=0), -1.0)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        # The lowest index among ties; clamped so NaN logits (no lane equals the max) still give a valid id.
        pick = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), axis=0), num_experts - 1)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        vals = tl.where(kk == j, best, vals)
        p = tl.where(offs == pick, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    keep = kk < TOP_K
    tl.store(ids_ptr + row * TOP_K + kk, ids, mask=keep)
    tl.store(w_ptr + row * TOP_K + kk, vals.to(w_ptr.dtype.element_ty), mask=keep)


def router_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, the top-k, optionally renormalised to sum 1 (Qwen3-MoE's `norm_topk_prob`).

    Args:
        logits: [T, E] router logits, the last dim contiguous.
        top_k: experts per token (<= E).
        renormalize: divide the k weights by their sum.
        dtype: dtype of the returned weights.

    Returns:
        (ids [T, k] int64, highest probability first; weights [T, k] in `dtype`). Ties go to the lower expert id;
        a row of NaN logits gets ids in range (and NaN weights), never an id past the experts.
    """
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts or logits.stride(-1) != 1:
        raise ValueError(f"router_topk: top_k {top_k} of {num_experts} experts, logits strides {logits.stride()}")
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    if tokens:
        _router_topk_kernel[(tokens,)](
            logits, ids, weights, num_experts, logits.stride(0), TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts), RENORM=renormalize,
        )
    return ids, weights
