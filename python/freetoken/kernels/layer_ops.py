"""The small ops of a decoder layer, each fused into one Triton kernel: RMSNorm, q/k RMSNorm + RoPE, router top-k.

At decode batch sizes these ops move a few KB each, so their cost is kernel count: torch runs an RMSNorm as ~8
elementwise and reduction kernels, a rotate-half RoPE as ~5, a softmax router's top-k and renormalisation as ~6,
about 45 kernels of a Qwen3-MoE layer's ~75 (torch profiler of a decode step, benches/moe_backends.py --profile).
Here each is one kernel, with the same maths as the torch modules in `freetoken.models.qwen3_moe` (which follow
transformers' Qwen3-MoE): statistics in float32, the normalised value rounded to the input dtype before the weight
multiplies it (as `Qwen3MoeRMSNorm`), RoPE in float32 on the normed values with one rounding at the end (torch
rounds each product; the difference is within bf16 rounding), router softmax in float32.

Shapes: T tokens, H hidden, D head dim (even), E experts, k top-k.
Test: python -m pytest tests/test_kernels.py (interpreted on the CPU in CI, compiled on CUDA in tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`.

    Args:
        x: [..., n], rows contiguous in the last dim.
        weight: [n].
        eps: added to the mean square.

    Returns:
        [..., n] in x's dtype, a new tensor.
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, half,
                      stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t, h = pid // heads, pid % heads
    offs = tl.arange(0, BLOCK)
    ok = offs < half
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
    dt = out_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + offs, mask=ok, other=0.0).to(tl.float32)
    n1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # the norm's output, in x's dtype
    n2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + offs, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + offs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + half + offs, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + offs, (n1 * c1 - n2 * s1).to(dt), mask=ok)
    tl.store(out + half + offs, (n2 * c2 + n1 * s2).to(dt), mask=ok)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE (Su et al. 2021, the Hugging Face Llama/Qwen layout), as Qwen3's
    q_norm/k_norm followed by `apply_rotary_pos_emb`.

    Args:
        x: [T, heads, D], the last dim contiguous.
        weight: [D], the norm's weight.
        cos, sin: [T, D] (each half repeated), rows contiguous, same stride.
        eps: the norm's eps.

    Returns:
        [T, heads, D] in x's dtype, a new contiguous tensor.
    """
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"norm_rope: needs an even, contiguous last dim and cos/sin of one layout, got x {x.shape} "
                         f"strides {x.stride()}, cos {cos.stride()}, sin {sin.stride()}")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        half = dim // 2
        _norm_rope_kernel[(tokens * heads,)](
            x, weight, cos, sin, out, heads, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos.stride(0), eps, BLOCK=triton.next_power_of_2(half),
        )
    return out


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
        pick = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest index among ties
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        vals = tl.where(kk == j, best, vals)
        p = tl.where(offs == pick, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    keep = kk < TOP_K
    tl.store(ids_ptr + row * TOP_K + kk, ids, mask=keep)
    tl.store(w_ptr + row * TOP_K + kk, vals.to(w_ptr.dtype.element_ty), mask=keep)


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, the top-k, optionally renormalised to sum 1 (Qwen3-MoE's `norm_topk_prob`).

    Args:
        logits: [T, E] router logits, the last dim contiguous.
        top_k: experts per token (<= E).
        renormalize: divide the k weights by their sum.
        dtype: dtype of the returned weights.

    Returns:
        (ids [T, k] int64, highest probability first; weights [T, k] in `dtype`). Ties go to the lower expert id.
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
