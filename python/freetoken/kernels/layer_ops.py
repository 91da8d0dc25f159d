"""The small ops of a decoder layer, fused into few Triton kernels: the residual add with RMSNorm, the per-head
q/k RMSNorm with RoPE and the KV-cache write, and the router's softmax + top-k.

At decode batch sizes these ops move a few KB each, so their cost is kernel count: torch runs an RMSNorm as ~8
elementwise and reduction kernels, RoPE on q and k as 10 (negate, concatenate, two products and a sum, each), the
KV-cache write as 2 and a softmax router's top-k and renormalisation as ~6 (torch profiler of a decode step,
benches/moe_backends.py --profile). Here each group is one kernel that repeats the torch modules' roundings in
`freetoken.models.qwen3_moe` (which follow transformers' Qwen3-MoE) one by one, so the result is bit for bit
torch's on the GPU (checked in bfloat16 on the H200, tests/engine/test_gpu.py): RMSNorm statistics in float32 and the
normalised value rounded to the input dtype before the weight multiplies it (as `Qwen3MoeRMSNorm`), the residual
sum rounded before it is normalised, RoPE's two products and their sum each rounded (three bf16 ops in torch:
where the compiled kernel skipped one of those roundings, the last bit of ~20% of q/k elements moved, and bf16
greedy decoding left transformers' tokens at more near-ties, 2 of 8 sequences whole against 6 of 8;
`_round_to`), the router softmax in float32.

Shapes: T tokens, H hidden, D head dim, E experts, k top-k, Nq / Nkv query / KV heads, S KV-cache slots.
Test: python -m pytest tests/kernels/test_kernels.py (interpreted on the CPU in CI, compiled on CUDA in
tests/engine/test_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_rms_norm(x, w_ptr, out_row_ptr, offs, ok, n, eps):
    """Normalise float32 row `x` (masked lanes 0) and store `weight * normed` at `out_row_ptr`, in its dtype."""
    dt = out_row_ptr.dtype.element_ty
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * r).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row_ptr + offs, (w * y).to(dt), mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, inner, stride_xa, stride_xb, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + (row // inner) * stride_xa + (row % inner) * stride_xb + offs, mask=ok, other=0.0)
    _store_rms_norm(x.to(tl.float32), w_ptr, out_ptr + row * stride_out, offs, ok, n, eps)


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
        _rms_norm_kernel[(out.shape[0],)](
            x3, weight, out, n, inner, x3.stride(0), x3.stride(1), out.stride(0), eps, BLOCK=triton.next_power_of_2(n)
        )
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, n, stride_x, stride_r, stride_sum, stride_out, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    s = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + offs, s, mask=ok)  # may be r's memory: this program read its row already
    _store_rms_norm(s.to(tl.float32), w_ptr, out_ptr + row * stride_out, offs, ok, n, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out_sum: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add and the next RMSNorm in one kernel: `s = x + residual` (rounded to the
    dtype, as torch's add), then `rms_norm(s)`.

    Args:
        x, residual: [T, n], the last dim contiguous, same dtype.
        weight: [n].
        eps: added to the mean square.
        out_sum: [T, n] where the sum goes (may be `residual` itself: in place); None allocates.

    Returns:
        (normed [T, n], s [T, n]), both in x's dtype.
    """
    tensors = (x, residual) if out_sum is None else (x, residual, out_sum)
    if (
        x.dim() != 2
        or any(t.shape != x.shape or t.dtype != x.dtype or t.stride(-1) != 1 for t in tensors)
        or weight.shape != (x.shape[1],)
        or not weight.is_contiguous()
    ):
        raise ValueError(
            "add_rms_norm: needs [T, n] tensors of one dtype with a contiguous last dim and a [n] weight, "
            f"got {[(tuple(t.shape), t.stride(), t.dtype) for t in tensors]} and {tuple(weight.shape)}"
        )
    s = torch.empty_like(x) if out_sum is None else out_sum
    out = torch.empty_like(x)
    tokens, n = x.shape
    if tokens:
        _add_rms_norm_kernel[(tokens,)](
            x,
            residual,
            weight,
            s,
            out,
            n,
            x.stride(0),
            residual.stride(0),
            s.stride(0),
            out.stride(0),
            eps,
            BLOCK=triton.next_power_of_2(n),
        )
    return out, s


@triton.jit
def _round_to(v, dt: tl.constexpr):
    """float32 `v` rounded to `dt` (to nearest, ties to even) and widened back. For bfloat16 by integer ops on the
    bits (NaN kept as is): `v.to(dt).to(tl.float32)` there left RoPE's sum of two rounded products off torch's in
    the last bit for ~21% of elements on the H200 (each product alone was exact), so the compiled code did not round
    where written."""
    if dt == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, rounded)
    else:
        return v.to(dt).to(tl.float32)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    head_dim,
    num_q_heads,
    num_kv_heads,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_q,
    stride_cache,
    eps,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)  # query heads first, then KV heads
    offs = tl.arange(0, BLOCK)
    ok = offs < head_dim
    half = head_dim // 2
    partner = tl.where(offs < half, offs + half, offs - half)  # rotate-half: out = x cos + [-x2, x1] sin
    sign = tl.where(offs < half, -1.0, 1.0)
    src = qkv_ptr + t * stride_qkv + head * head_dim
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
    is_q = head < num_q_heads
    if is_q:
        w = tl.load(q_w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(q_w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.load(k_w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(k_w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
    dt = q_ptr.dtype.element_ty
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    y = _round_to(w * _round_to(x * inv, dt), dt)
    yp = _round_to(wp * _round_to(xp * inv, dt), dt) * sign
    c = tl.load(cos_ptr + t * stride_cos + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + offs, mask=ok, other=0.0).to(tl.float32)
    out = _round_to(_round_to(y * c, dt) + _round_to(yp * s, dt), dt).to(dt)
    if is_q:
        tl.store(q_ptr + t * stride_q + head * head_dim + offs, out, mask=ok)
    else:
        kv_head = head - num_q_heads
        dst = tl.load(slot_ptr + t) * stride_cache + kv_head * head_dim
        tl.store(k_cache_ptr + dst + offs, out, mask=ok)
        v = tl.load(src + num_kv_heads * head_dim + offs, mask=ok)
        tl.store(v_cache_ptr + dst + offs, v, mask=ok)


def qk_norm_rope(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Qwen3 attention's input side in one kernel: per-head RMSNorm of q and k, RoPE (rotate-half layout, Su et al.
    2021) on both, and this step's K and V written into the paged KV cache.

    Args:
        qkv: [T, (Nq + 2 Nkv) D], the stacked q/k/v projection (q heads, then k heads, then v heads), the last dim
            contiguous.
        num_q_heads, num_kv_heads: Nq and Nkv; D is the norm weights' length (even).
        q_weight, k_weight: [D] the q and k RMSNorm weights.
        eps: added to the mean square (both norms).
        cos, sin: [T, D] the rotary tables of the tokens' positions, in qkv's dtype.
        k_cache, v_cache: [S, Nkv, D], contiguous; row `slot_mapping[t]` takes token t's K and V.
        slot_mapping: [T] int64 KV-cache slots.

    Returns:
        q [T, Nq, D] with RoPE applied, in qkv's dtype.
    """
    tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    if (
        qkv.dim() != 2
        or qkv.stride(-1) != 1
        or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim
        or head_dim % 2
        or k_weight.shape != q_weight.shape
        or not (q_weight.is_contiguous() and k_weight.is_contiguous())
        or any(t.shape != (tokens, head_dim) or t.stride(-1) != 1 for t in (cos, sin))
        or slot_mapping.shape != (tokens,)
        or k_cache.shape[1:] != (num_kv_heads, head_dim)
        or any(t.shape != k_cache.shape or not t.is_contiguous() or t.dtype != qkv.dtype for t in (k_cache, v_cache))
    ):
        raise ValueError(
            f"qk_norm_rope: qkv {tuple(qkv.shape)} for {num_q_heads} + 2 x {num_kv_heads} heads of "
            f"{head_dim}, norm weights {tuple(q_weight.shape)} and {tuple(k_weight.shape)}, cos/sin "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}, slots {tuple(slot_mapping.shape)}, caches "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    q = torch.empty(tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, num_q_heads + num_kv_heads)](
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            q,
            k_cache,
            v_cache,
            slot_mapping,
            head_dim,
            num_q_heads,
            num_kv_heads,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            q.stride(0),
            k_cache.stride(0),
            eps,
            BLOCK=triton.next_power_of_2(head_dim),
        )
    return q


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    ids_ptr,
    w_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORM: tl.constexpr,
):
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
            logits,
            ids,
            weights,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(num_experts),
            RENORM=renormalize,
        )
    return ids, weights
