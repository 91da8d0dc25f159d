"""Decode attention over the paged KV cache, in Triton: one query token per sequence, GQA.

Variants:
  - `paged_decode_attention`: one program per (sequence, KV head) walks the sequence's block table in tiles of
    BLOCK_N tokens with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), all query
    heads of the KV head's group at once. Sequence lengths and block tables are read from device memory, so the
    launch has a fixed shape and a decode step can be captured in a CUDA graph.
  - `paged_decode_attention_reference`: plain torch gather + softmax, the correctness reference.

Layout: k_cache, v_cache [num_slots, num_kv_heads, head_dim], slot = block * block_size + offset (see
freetoken.models.attention).
Test: python -m pytest tests/test_kernels.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, out_ptr,
    scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    head_ok = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < seq_len
        block = tl.load(block_table_ptr + seq * stride_bt + pos // KV_BLOCK_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE
        kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole cached context.

    Args:
        q: [B, num_heads, head_dim] queries (RoPE applied).
        k_cache, v_cache: [num_slots, num_kv_heads, head_dim]; this step's K/V already written.
        block_tables: [B, max_blocks] int32 KV block ids per sequence (entries past the context are not read).
        seq_lens: [B] int32 context length of each sequence, this token included (>= 1).
        kv_block_size: tokens per KV block.
        scale: softmax scale.

    Returns:
        [B, num_heads, head_dim], q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=kv_block_size, BLOCK_N=64, num_warps=4,
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_block_size: int,
    scale: float,
) -> torch.Tensor:
    """`paged_decode_attention` in plain torch, float32 (the reference of the kernel tests)."""
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b].long()[pos // kv_block_size] * kv_block_size + pos % kv_block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # (n, nh, D)
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out
