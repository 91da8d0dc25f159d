"""The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh, ICLR 2025, arXiv:2412.06464), the token mixer of
Qwen3.5's linear-attention layers: per value head a state S [Dk, Dv] (float32) that each token decays and corrects,

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,      o_t = S_t^T q_t,

with q and k L2-normalised per head (q then scaled by Dk ** -0.5), beta in (0, 1) and g <= 0 (log decay). Key heads
are shared by `Hv // Hk` consecutive value heads (grouped value attention, as transformers' `repeat_interleave`).

Variants:
  - `recurrent_gated_delta_rule`: one token per sequence (decode), the states gathered from and written back to a
    state pool by slot, in place; torch on any device (`recurrent_gated_delta_rule_torch`), on CUDA the Triton kernel
    `_recurrent_kernel` (one program per (sequence, value head, block of Dv columns): the state block stays in
    registers while the token's decay, delta and output are applied).
  - `chunk_gated_delta_rule`: a prefill span of one sequence, from its state in the pool, writing the final state
    back. Chunked form (the UT/WY transform of DeltaNet, Yang et al. NeurIPS 2024, arXiv:2406.06484, extended with
    gates in the Gated DeltaNet paper, sec. 3.3; the kernel split of flash-linear-attention's `chunk_gated_delta_rule`):
    per chunk of C tokens, with G the in-chunk cumulative log decay and A the strictly lower [C, C] matrix
    A_ij = beta_i exp(G_i - G_j) k_i . k_j, T = (I + A)^-1 gives W = T (beta exp(G) k) and U = T (beta v); across
    chunks, V' = U - W S, O = (exp(G) q) S + (mask(q k^T exp(G_i - G_j))) V', S <- exp(G_C) S + (exp(G_C - G) k)^T V'.
    torch (`chunk_gated_delta_rule_torch`, the CPU path and the reference); on CUDA three Triton kernels, split as
    flash-linear-attention splits its own (`_chunk_prepare_kernel`: cumulative decay, A, its inverse by forward
    substitution, W and U per chunk, all chunks in parallel; `_chunk_state_kernel`: the sequential pass over chunks
    per (value head, block of Dv columns), the state block in registers, storing each chunk's starting state h and
    V'; `_chunk_output_kernel`: every chunk's outputs from its h and V', all chunks in parallel). The dots run on
    the tensor cores at float32 accuracy (`DOT_PRECISION`). The single scan kernel they replace computed the outputs
    inside the sequential pass, on 128 programs (32 value heads x 4 column blocks) with IEEE float32 dots that
    compiled to 32 registers and 11.7 KB of stack per thread: 112 ms per 8192-token span of one layer, 10.1 of 13.7 s
    of an 18,944-token Qwen3.5-35B-A3B prefill on the H200 (`benches/engine_prefill.py --profile`).

Shapes: q, k [L, Hk, Dk]; v [L, Hv, Dv]; g, beta [L, Hv] (float32 g); states [num_slots, Hv, Dk, Dv] float32.
Tests: python -m pytest tests/models/test_qwen3_5.py -q (torch paths; the Triton kernels in Triton's interpreter);
on a GPU: python -m pytest tests/models/test_qwen3_5.py -q -m gpu
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CHUNK_SIZE = 64
L2_EPS = 1e-6  # as transformers' and flash-linear-attention's l2norm: x * rsqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x / sqrt(sum(x^2) + 1e-6) over the last dim, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """float32 [Hv, L, D] q (normalised and scaled), k (normalised), v; [Hv, L] g and beta. Key heads are repeated
    to the value heads (head h reads key head h // (Hv // Hk))."""
    num_v_heads = v.shape[1]
    group = num_v_heads // k.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1) if group > 1 else x.float() for x in (q, k))
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    return (
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.float().transpose(0, 1),
        g.float().transpose(0, 1),
        beta.float().transpose(0, 1),
    )


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over one sequence's span, in torch (see the module docstring).

    Args:
        q, k: [L, Hk, Dk] (any float dtype; not yet normalised); v: [L, Hv, Dv]; g: [L, Hv] log decay (<= 0);
            beta: [L, Hv].
        state: [Hv, Dk, Dv] float32, the state before the span (not written).

    Returns:
        (o [L, Hv, Dv] in v's dtype, the state after the span [Hv, Dk, Dv] float32).
    """
    length = q.shape[0]
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta)  # [Hv, L, D], [Hv, L]
    pad = (-length) % chunk_size
    if pad:
        qh, kh, vh = (F.pad(x, (0, 0, 0, pad)) for x in (qh, kh, vh))
        gh, bh = (F.pad(x, (0, pad)) for x in (gh, bh))
    heads, total = gh.shape
    n = total // chunk_size
    # (Hv, n, C, D): chunks as a batch dimension.
    qc, kc, vc = (x.reshape(heads, n, chunk_size, -1) for x in (qh, kh, vh))
    gc = gh.reshape(heads, n, chunk_size).cumsum(-1)  # in-chunk cumulative log decay G
    bc = bh.reshape(heads, n, chunk_size)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: G_i - G_j > 0 there).
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kbeta = kc * bc[..., None]
    # I + A with A strictly lower, A_ij = beta_i exp(G_i - G_j) k_i . k_j (the solver takes the diagonal as ones).
    system = (kbeta @ kc.transpose(-1, -2)) * decay
    w = torch.linalg.solve_triangular(system, kbeta * gc.exp()[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # causal in-chunk scores, diagonal included
    q_decayed = qc * gc.exp()[..., None]
    k_decayed = kc * (gc[..., -1:] - gc).exp()[..., None]
    last = gc[..., -1].exp()  # (Hv, n)
    s = state.float().clone()
    out = torch.empty_like(vc)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * last[:, i, None, None] + k_decayed[:, i].transpose(-1, -2) @ v_new
    o = out.reshape(heads, total, -1)[:, :length].transpose(0, 1)
    return o.to(v.dtype), s


def recurrent_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token of each of B sequences, their states read from and written back to `states` at `slots`.

    Args:
        q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv].
        states: [num_slots, Hv, Dk, Dv] float32, written in place at `slots`.
        slots: [B] int64, distinct except for padding rows that all name one scratch slot.

    Returns:
        o [B, Hv, Dv] in v's dtype.
    """
    qh, kh, vh, gh, bh = (x.transpose(0, 1) for x in _heads_first(q, k, v, g, beta))  # back to [B, Hv, ...]
    s = states[slots] * gh.exp()[..., None, None]  # (B, Hv, Dk, Dv)
    kv_mem = (s * kh[..., None]).sum(dim=-2)  # (B, Hv, Dv)
    delta = (vh - kv_mem) * bh[..., None]
    s = s + kh[..., None] * delta[..., None, :]
    o = (s * qh[..., None]).sum(dim=-2)
    states[slots] = s
    return o.to(v.dtype)


@triton.jit
def _head_columns(
    head_axis: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr
):
    """The value head on grid axis `head_axis` and the state column block on the next one: (value head, its key head,
    key dims [DK], value columns [BLOCK_V], which of those are < DV)."""
    h = tl.program_id(head_axis)
    dv = tl.program_id(head_axis + 1) * BLOCK_V + tl.arange(0, BLOCK_V)
    return h, h // GROUP, tl.arange(0, DK), dv, dv < DV


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    o_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_bb,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ob,
    stride_oh,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One token of sequence `pid(0)`, value head `pid(1)`, state columns [pid(2) * BLOCK_V, +BLOCK_V)."""
    b = tl.program_id(0)
    h, kh, dk, dv, v_ok = _head_columns(1, GROUP, DK, DV, BLOCK_V)
    slot = tl.load(slot_ptr + b)
    q = tl.load(q_ptr + b * stride_qb + kh * stride_qh + dk).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + kh * stride_kh + dk).to(tl.float32)
    q = _l2norm(q, 0) * scale
    k = _l2norm(k, 0)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bb + h).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s = tl.load(s_ptrs, mask=v_ok[None, :], other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=v_ok[None, :])
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule_torch` as one Triton kernel (on CUDA, or in Triton's interpreter on the CPU); same
    arguments and result. No host sync: graph-capturable. Dk must be a power of two; `states` contiguous."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    batch, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(batch, num_v_heads, dv, dtype=v.dtype, device=v.device)
    block_v = min(32, triton.next_power_of_2(dv))  # a [Dk, 32] float32 state block: 32 registers a thread at Dk 128
    grid = (batch, num_v_heads, triton.cdiv(dv, block_v))
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        states,
        slots,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        out.stride(0),
        out.stride(1),
        dk**-0.5,
        GROUP=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        BLOCK_V=block_v,
    )
    return out


@triton.jit
def _l2norm(x, AXIS: tl.constexpr):
    """x (float32) over sqrt(sum(x^2) + 1e-6) along `AXIS`, as `l2norm`: a vector, or a tile's rows (AXIS 1) or
    columns (AXIS 0)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) + 1e-6)


# One compiled kernel for every span length (Triton would specialise `length` on divisibility by 16 and on 1,
# a compile of tens of seconds each for the float32 dots on the GPU box's CPU).
@triton.jit(do_not_specialize=["length"])
def _chunk_prepare_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    w_ptr,
    u_ptr,
    gcum_ptr,
    length,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ct,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Chunk `pid(0)` of value head `pid(1)`: G = in-chunk cumsum of g; T = (I + A)^-1 with A_ij = beta_i
    exp(G_i - G_j) k_i . k_j (i > j) by forward substitution; W = T (beta exp(G) k), U = T (beta v) (float32)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    ok = rows < length
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV_PAD)
    k = tl.load(
        k_ptr + rows[:, None] * stride_kt + (h // GROUP) * stride_kh + dk[None, :], mask=ok[:, None], other=0.0
    ).to(tl.float32)
    k = _l2norm(k, 1)
    v = tl.load(
        v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
        mask=ok[:, None] & (dv < DV)[None, :],
        other=0.0,
    ).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0)
    i = tl.arange(0, CHUNK)
    lower = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    kb = k * beta[:, None]
    a = tl.dot(kb, tl.trans(k), input_precision=PRECISION) * decay  # strictly lower
    # Forward substitution, row by row: T_i = e_i - sum_{j<i} A_ij T_j (rows j < i of T are final).
    t = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for r in range(1, CHUNK):
        a_row = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)  # A[r, :]
        t_row = tl.sum(a_row[:, None] * t, axis=0)  # (A[r, :] T)
        t = tl.where(i[:, None] == r, t - t_row[None, :], t)
    w = tl.dot(t, kb * tl.exp(gc)[:, None], input_precision=PRECISION)
    u = tl.dot(t, v * beta[:, None], input_precision=PRECISION)
    tl.store(w_ptr + rows[:, None] * stride_wt + h * stride_wh + dk[None, :], w, mask=ok[:, None])
    tl.store(u_ptr + rows[:, None] * stride_ut + h * stride_uh + dv[None, :], u, mask=ok[:, None] & (dv < DV)[None, :])
    tl.store(gcum_ptr + rows * stride_ct + h, gc, mask=ok)


# Not specialised on `length`, as `_chunk_prepare_kernel`.
@triton.jit(do_not_specialize=["length"])
def _chunk_state_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    gcum_ptr,
    state_ptr,
    h_ptr,
    length,
    stride_kt,
    stride_kh,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ct,
    stride_sh,
    stride_sk,
    stride_hc,
    stride_hh,
    stride_hk,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Value head `pid(0)`, state columns block `pid(1)`: the chunks in order, the state block S [DK, BLOCK_V] in
    registers (float32): h[c] = S (the state the chunk starts from), U <- V' = U - W S in place, then
    S <- exp(G_C) S + (exp(G_C - G) k)^T V'; the last S written back to the pool row. Only the two products that
    carry the state are sequential; `_chunk_output_kernel` computes the outputs of all chunks in parallel."""
    h, kh, dk, dv, v_ok = _head_columns(0, GROUP, DK, DV, BLOCK_V)
    i = tl.arange(0, CHUNK)
    s_ptrs = state_ptr + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s = tl.load(s_ptrs, mask=v_ok[None, :], other=0.0)
    h_ptrs = h_ptr + h * stride_hh + dk[:, None] * stride_hk + dv[None, :]
    for c in range(tl.cdiv(length, CHUNK)):
        tl.store(h_ptrs + c * stride_hc, s.to(h_ptr.dtype.element_ty), mask=v_ok[None, :])
        rows = c * CHUNK + i
        ok = rows < length
        # k loaded as [DK, CHUNK] (the update's left operand, transposed by the addressing rather than in
        # registers) and normalised per column
        k_t = tl.load(k_ptr + rows[None, :] * stride_kt + kh * stride_kh + dk[:, None], mask=ok[None, :], other=0.0).to(
            tl.float32
        )
        k_t = _l2norm(k_t, 0)
        w = tl.load(w_ptr + rows[:, None] * stride_wt + h * stride_wh + dk[None, :], mask=ok[:, None], other=0.0)
        u_ptrs = u_ptr + rows[:, None] * stride_ut + h * stride_uh + dv[None, :]
        u = tl.load(u_ptrs, mask=ok[:, None] & v_ok[None, :], other=0.0)
        # Rows past the span repeat the last cumulative decay (their g is 0): G_C is the span's.
        gc = tl.load(gcum_ptr + tl.minimum(rows, length - 1) * stride_ct + h)
        g_last = tl.load(gcum_ptr + tl.minimum(c * CHUNK + CHUNK - 1, length - 1) * stride_ct + h)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        tl.store(u_ptrs, v_new, mask=ok[:, None] & v_ok[None, :])
        k_decayed = k_t * tl.exp(g_last - gc)[None, :]
        s = s * tl.exp(g_last) + tl.dot(k_decayed, v_new, input_precision=PRECISION)
    tl.store(s_ptrs, s, mask=v_ok[None, :])


# Not specialised on `length`, as `_chunk_prepare_kernel`.
@triton.jit(do_not_specialize=["length"])
def _chunk_output_kernel(
    q_ptr,
    k_ptr,
    u_ptr,
    gcum_ptr,
    h_ptr,
    o_ptr,
    length,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ut,
    stride_uh,
    stride_ct,
    stride_hc,
    stride_hh,
    stride_hk,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Chunk `pid(0)`, value head `pid(1)`, output columns block `pid(2)`: O = (exp(G) q) h[c] + mask(q k^T
    exp(G_i - G_j)) V', from the state the chunk starts from (h[c]) and V' (in U's buffer), both written by
    `_chunk_state_kernel`."""
    c = tl.program_id(0)
    h, kh, dk, dv, v_ok = _head_columns(1, GROUP, DK, DV, BLOCK_V)
    i = tl.arange(0, CHUNK)
    rows = c * CHUNK + i
    ok = rows < length
    q = tl.load(q_ptr + rows[:, None] * stride_qt + kh * stride_qh + dk[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + rows[:, None] * stride_kt + kh * stride_kh + dk[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    q = _l2norm(q, 1) * scale
    k = _l2norm(k, 1)
    gc = tl.load(gcum_ptr + tl.minimum(rows, length - 1) * stride_ct + h)
    s = tl.load(
        h_ptr + c * stride_hc + h * stride_hh + dk[:, None] * stride_hk + dv[None, :], mask=v_ok[None, :], other=0.0
    ).to(tl.float32)
    v_new = tl.load(
        u_ptr + rows[:, None] * stride_ut + h * stride_uh + dv[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0
    )
    causal = i[:, None] >= i[None, :]
    attn = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    attn = tl.where(causal, attn * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision=PRECISION)
    o = o + tl.dot(attn, v_new, input_precision=PRECISION)
    tl.store(
        o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=ok[:, None] & v_ok[None, :],
    )


# Per kernel (num_warps, num_stages, BLOCK_V), timed on the H200 at Qwen3.5-35B-A3B's heads (Dk = Dv = 128, bfloat16
# inputs, an 8192-token span; `benches/gated_delta.py --sweep`, ms): prepare 2.11 at 8 warps (2.55 at 4, 2.58 at 16);
# state 1.13 at (4 warps, 32 columns) against 1.31-2.35 for (4, 16), (8, 32), (8, 16) and two stages; output 1.02
# at (8 warps, 64 columns) against 1.28-3.29 for (4, 32), (8, 32), (4, 16), (8, 16), (16, 64). 4.3 ms per span
# of one layer in all.
LAUNCH = {
    "prepare": (8, 1, 0),
    "state": (4, 1, 32),
    "output": (8, 1, 64),
}
# Most tokens `chunk_gated_delta_rule` runs in one pass of its kernels (a multiple of CHUNK_SIZE): 8192 tokens of
# Qwen3.5-35B-A3B's heads take 4.3 ms and 0.54 GB of float32 scratch (h half of it), so a 32768-token prefill chunk
# runs four passes instead of holding 2.15 GB, which pushed the second prefill layer buffer out of a 24 GB budget
# with state checkpoints on (`freetoken.moe.budget.plan_expert_slots`).
PASS_TOKENS = 8192

# The dots' precision on the GPU: three TF32 tensor-core products per dot (Triton's "tf32x3": the operands split
# into TF32 hi + lo parts, lo * lo dropped), float32 accuracy to ~1e-6 relative at tensor-core speed. IEEE float32
# dots run on the FMA pipes and compile to register-starved code at these tiles (32 registers, 11.7 KB of stack per
# thread for the old single scan kernel: 112 ms per 8192-token span of one layer on the H200, 74 % of Qwen3.5's
# prefill); plain TF32 (10-bit mantissa) moves float32 states by ~1e-3 relative, past what the tests against the
# torch form allow.
DOT_PRECISION = "tf32x3"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """`chunk_gated_delta_rule_torch` in three Triton kernels (on CUDA, or in Triton's interpreter on the CPU), the
    state advanced in place: `_chunk_prepare_kernel` (W, U, G of every chunk, in parallel), `_chunk_state_kernel`
    (the state at each chunk's start, h, and V' = U - W S: the only sequential pass), `_chunk_output_kernel` (every
    chunk's outputs from h and V', in parallel), as flash-linear-attention splits its `chunk_gated_delta_rule`.

    Args:
        q, k: [L, Hk, Dk]; v: [L, Hv, Dv]; g: [L, Hv] float32; beta: [L, Hv].
        state: [Hv, Dk, Dv] float32, contiguous (a pool row), read and written in place.

    Returns:
        o [L, Hv, Dv] in v's dtype. Dk must be a power of two >= 16, Dv >= 16. Spans past `PASS_TOKENS` run in
        passes of that many tokens (a multiple of the chunk size, so the chunks and the result are the same), the
        state carried from one to the next, so the float32 scratch beside the output is bounded whatever the
        prefill chunk: W [L', Hv, Dk], U [L', Hv, Dv], G [L', Hv] and h [L' / 64, Hv, Dk, Dv] for L' = min(L,
        PASS_TOKENS) (`chunk_scratch_nbytes`; h in float32, not in the inputs' dtype as flash-linear-attention keeps
        it: a bfloat16 h moved a quarter of the bfloat16 outputs off torch's rounding).
    """
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for start in range(0, q.shape[0], PASS_TOKENS):
        rows = slice(start, start + PASS_TOKENS)
        _chunk_pass(q[rows], k[rows], v[rows], g[rows], beta[rows], state, out[rows])
    return out


def _chunk_pass(q, k, v, g, beta, state: torch.Tensor, out: torch.Tensor) -> None:
    """One pass of `chunk_gated_delta_rule` over a span of at most `PASS_TOKENS`, its outputs written into `out`."""
    length, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    group = num_v_heads // num_k_heads
    chunks = triton.cdiv(length, CHUNK_SIZE)
    w = torch.empty(length, num_v_heads, dk, dtype=torch.float32, device=q.device)
    u = torch.empty(length, num_v_heads, dv, dtype=torch.float32, device=q.device)
    gcum = torch.empty(length, num_v_heads, dtype=torch.float32, device=q.device)
    h = torch.empty(chunks, num_v_heads, dk, dv, dtype=torch.float32, device=q.device)
    interpret = q.device.type != "cuda"
    precision = "ieee" if interpret else DOT_PRECISION
    warps, stages, _ = LAUNCH["prepare"]
    _chunk_prepare_kernel[(chunks, num_v_heads)](
        k, v, g, beta, w, u, gcum, length,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), gcum.stride(0),
        GROUP=group, CHUNK=CHUNK_SIZE, DK=dk, DV=dv, DV_PAD=max(16, triton.next_power_of_2(dv)),
        PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    warps, stages, block_v = LAUNCH["state"]
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _chunk_state_kernel[(num_v_heads, triton.cdiv(dv, block_v))](
        k, w, u, gcum, state, h, length,
        k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), gcum.stride(0),
        state.stride(0), state.stride(1), h.stride(0), h.stride(1), h.stride(2),
        GROUP=group, CHUNK=CHUNK_SIZE, DK=dk, DV=dv, BLOCK_V=block_v, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    warps, stages, block_v = LAUNCH["output"]
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _chunk_output_kernel[(chunks, num_v_heads, triton.cdiv(dv, block_v))](
        q, k, u, gcum, h, out, length, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), u.stride(0), u.stride(1), gcum.stride(0),
        h.stride(0), h.stride(1), h.stride(2), out.stride(0), out.stride(1),
        GROUP=group, CHUNK=CHUNK_SIZE, DK=dk, DV=dv, BLOCK_V=block_v, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def chunk_scratch_nbytes(length: int, num_v_heads: int, dk: int, dv: int) -> int:
    """Device bytes `chunk_gated_delta_rule` allocates beside its output for a `length`-token span (one pass of at
    most `PASS_TOKENS`): W, U, G and h ([chunks, Hv, Dk, Dv]), all float32."""
    length = min(length, PASS_TOKENS)
    chunks = -(-length // CHUNK_SIZE)
    return 4 * (length * num_v_heads * (dk + dv + 1) + chunks * num_v_heads * dk * dv)
