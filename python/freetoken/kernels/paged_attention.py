"""Decode attention over the paged KV cache, in Triton: one query token per sequence, GQA.

Variants:
  - `paged_decode_attention`, split-K (the default when the block tables span more than one partition): one
    program per (sequence, KV head, partition of PARTITION_SIZE tokens) walks its part of the block table in tiles
    of BLOCK_N tokens with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), all query
    heads of the KV head's group at once, and writes a partial; a reduce kernel combines them (Flash-Decoding, Dao,
    Haziza, Massa & Sizov 2023). Without the split a 4-KV-head model at batch 1 runs 4 programs over the whole
    context, leaving the GPU's other SMs idle as the context grows.
  - single pass: one program per (sequence, KV head) over the whole context, where one partition covers it.
  Sequence lengths and block tables are read from device memory, so a launch's shape depends only on the batch
  size and the block-table width, and a decode step can be captured in a CUDA graph.
  - `paged_decode_attention_reference`: plain torch gather + softmax, the correctness reference.

Layout: k_cache, v_cache [num_slots, num_kv_heads, head_dim], slot = block * block_size + offset (see
freetoken.models.attention).
Test: python -m pytest tests/kernels/test_kernels.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per partition of the split-K decode kernel. Each partition is one program per (sequence, KV head) and one
# online-softmax partial; 512 tokens is 8 tiles of BLOCK_N, long enough that the partials (and the reduce) stay a
# small fraction of the KV bytes read, short enough that a 4-KV-head model at batch 1 fills the GPU from ~16k tokens
# on (benches/decode_attention.py measures 256 / 512 / 1024).
PARTITION_SIZE = 512
_BLOCK_N = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    max_ptr,
    sum_ptr,
    acc_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
):
    # PARTITION == 0: single pass, the program of (seq, kv_head) attends over the whole context and writes `out`.
    # Else program (seq, kv_head, part) attends over tokens [part * PARTITION, (part + 1) * PARTITION) and writes its
    # partial (running max, softmax denominator, un-normalised sum of V) for `_paged_decode_reduce_kernel`.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = part * PARTITION
    last = seq_len
    if PARTITION > 0:
        last = tl.minimum(first + PARTITION, seq_len)
    if first < last:  # the grid covers the longest context the launch serves; later partitions have no tokens
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        head_ok = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
        m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        denom = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
        for start in range(first, last, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = pos < last
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
        if PARTITION > 0:
            ml_off = seq * stride_mb + heads * stride_mh + part
            tl.store(max_ptr + ml_off, m, mask=head_ok)
            tl.store(sum_ptr + ml_off, denom, mask=head_ok)
            tl.store(
                acc_ptr + seq * stride_ab + heads[:, None] * stride_ah + part * stride_ap + d[None, :],
                acc,
                mask=head_ok[:, None],
            )
        else:
            out = acc / denom[:, None]
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=head_ok[:, None],
            )


@triton.jit
def _paged_decode_reduce_kernel(
    seq_lens_ptr,
    max_ptr,
    sum_ptr,
    acc_ptr,
    out_ptr,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p over the sequence's partitions p (M = max_p m_p):
    # the online-softmax rescaling, applied once across partitions (Flash-Decoding, Dao et al. 2023).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION)
    p_all = tl.arange(0, PARTS_PAD)
    ml_off = seq * stride_mb + head * stride_mh
    m_all = tl.load(max_ptr + ml_off + p_all, mask=p_all < num_parts, other=float("-inf"))
    m_top = tl.max(m_all, 0)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, CHUNK)
    total = tl.zeros((CHUNK,), dtype=tl.float32)
    acc = tl.zeros((CHUNK, HEAD_DIM), dtype=tl.float32)
    for first in range(0, num_parts, CHUNK):
        p = first + c
        ok = p < num_parts
        w = tl.exp(tl.load(max_ptr + ml_off + p, mask=ok, other=float("-inf")) - m_top)
        total += w * tl.load(sum_ptr + ml_off + p, mask=ok, other=0.0)
        a = tl.load(
            acc_ptr + seq * stride_ab + head * stride_ah + p[:, None] * stride_ap + d[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        acc += w[:, None] * a
    out = tl.sum(acc, 0) / tl.sum(total, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# Partial buffers of the split kernel, per (device, num_heads, partitions, head_dim): allocated once, at the largest
# batch asked for, and sliced for smaller batches. A larger batch appends a new buffer and keeps the old ones alive,
# since captured CUDA graphs hold their addresses (cuda_graph.py captures the largest batch first, warming up outside
# the capture, so in practice one buffer per shape is allocated, outside any capture).
_PARTIALS: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _partials(
    device: torch.device, batch: int, num_heads: int, num_parts: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 scratch (max [B, H, P], sum [B, H, P], acc [B, H, P, D]) of the split kernel, reused across calls."""
    buffers = _PARTIALS.setdefault((device, num_heads, num_parts, head_dim), [])
    if not buffers or buffers[-1][0].shape[0] < batch:
        buffers.append(
            (
                torch.empty(batch, num_heads, num_parts, dtype=torch.float32, device=device),
                torch.empty(batch, num_heads, num_parts, dtype=torch.float32, device=device),
                torch.empty(batch, num_heads, num_parts, head_dim, dtype=torch.float32, device=device),
            )
        )
    m, l, acc = buffers[-1]
    return m[:batch], l[:batch], acc[:batch]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_block_size: int,
    scale: float,
    partition_size: int | None = PARTITION_SIZE,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole cached context.

    Split-K (Flash-Decoding, Dao, Haziza, Massa & Sizov 2023; the partitions of vLLM's PagedAttention v2): the
    context is cut in partitions of `partition_size` tokens, one program per (sequence, KV head, partition) writes
    its online-softmax partial to float32 scratch, and a second kernel combines the partials per (sequence, head).
    The partition count comes from the block-table width (the longest context the launch can serve, e.g.
    max_model_len in a captured decode graph), so the launch shape does not depend on the lengths in `seq_lens`;
    partitions past a sequence's length exit at once. When that width fits in one partition, or `partition_size`
    is None, one program per (sequence, KV head) walks the whole context instead (single pass, no scratch).

    Args:
        q: [B, num_heads, head_dim] queries (RoPE applied).
        k_cache, v_cache: [num_slots, num_kv_heads, head_dim]; this step's K/V already written.
        block_tables: [B, max_blocks] int32 KV block ids per sequence (entries past the context are not read).
        seq_lens: [B] int32 context length of each sequence, this token included (>= 1, <= max_blocks *
            kv_block_size).
        kv_block_size: tokens per KV block.
        scale: softmax scale.
        partition_size: tokens per partition (a multiple of 64), or None for the single-pass kernel.

    Returns:
        [B, num_heads, head_dim], q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    out = torch.empty_like(q)
    num_parts = 0 if partition_size is None else triton.cdiv(block_tables.shape[1] * kv_block_size, partition_size)
    split = num_parts > 1
    if split and partition_size % _BLOCK_N:
        raise ValueError(f"partition_size {partition_size} is not a multiple of {_BLOCK_N}")
    # The single pass takes no scratch: `out` stands in for the partial pointers it never writes.
    m, l, acc = _partials(q.device, batch, num_heads, num_parts, head_dim) if split else (out, out, out[:, :, None])
    _paged_decode_kernel[(batch, num_kv_heads, max(num_parts, 1))](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        m,
        l,
        acc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        m.stride(0),
        m.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=kv_block_size,
        BLOCK_N=_BLOCK_N,
        PARTITION=partition_size if split else 0,
        num_warps=4,
    )
    if not split:
        return out
    parts_pad = triton.next_power_of_2(num_parts)
    _paged_decode_reduce_kernel[(batch, num_heads)](
        seq_lens,
        m,
        l,
        acc,
        out,
        m.stride(0),
        m.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        PARTITION=partition_size,
        PARTS_PAD=parts_pad,
        CHUNK=min(16, parts_pad),
        num_warps=4,
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
