"""Attention over a paged KV cache, in plain torch (CPU and CUDA through the same code).

The KV cache of one layer is two flat tensors `[num_slots, num_kv_heads, head_dim]` (slot = block * block_size +
offset, vLLM's PagedAttention layout flattened). A step's tokens write their K/V at `slot_mapping`; each sequence
then reads its whole context back through `gather_index`, built once per step from the block tables and shared
by all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, CausalVariant, causal_lower_right

# cuDNN attention rebuilds an execution plan per masked call (~1 ms of CPU each on an H200 host, measured with
# benches/decode_fused.py --profile), which would dominate an eager decode step; the other backends do not.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Prefill spans leave cuDNN out too: torch picks it for a cold prompt's causal attention on the H200 box, and it
# builds a graph for every new sequence length (hundreds of ms; a cold prompt has a new length every time): an
# 18.8k-token first turn's forward measured ~1.87 s through `ft serve` where its streamed copies take ~1.0 s. Flash
# takes 8.7 ms per layer there against cuDNN's 4.6 (benches/prefill_compute.py), under the ~21 ms of a layer's
# streamed copies; an extend's lower-right mask was on flash already (`CausalBias`).
PREFILL_SDPA_BACKENDS = _SDPA_BACKENDS
# Devices where the decode rows of a step that also prefills read the paged cache in place with the Triton decode
# kernel (`freetoken.kernels.paged_attention`, as decode-only steps do): gathering their contexts padded to the longest
# one would take [decodes, longest context, kv_heads, head_dim] for K and for V on the device (1.3 GB for 15 decodes
# at Qwen3-30B-A3B's 40960-token context, 8 GB at Qwen3.5's 262144; `freetoken.models.activations`). Tests add "cpu"
# (Triton's interpreter).
KERNEL_DEVICES = {"cuda"}


def lower_right_causal_bias(q_len: int, kv_len: int) -> CausalBias:
    """The lower-right causal mask of a `q_len`-query extend over `kv_len` keys, as SDPA's `CausalBias` (flash and
    memory-efficient attention take it without a materialised mask), built without its storage.

    `causal_lower_right` makes a `CausalBias`, a Tensor subclass that torch 2.15 sizes by its arguments: an
    uninitialised float32 [2, q_len, kv_len] host tensor (1.3 GB of address space at 4096 x 40960, 68.7 GB for a
    32768-token extend at Qwen3.5's 262144-token context), made per span per layer and never read. Where the OS does
    not overcommit that much the allocation fails with ENOMEM. The bias is dispatched on its variant and lengths
    only, so this builds it over an empty meta tensor; if a torch release changes that, the public constructor is used.
    Callers keep q_len <= kv_len (an extend's queries are the last of its context).
    """
    try:
        bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0, device="meta"))
        bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, q_len, kv_len
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - a torch without these internals
        return causal_lower_right(q_len, kv_len)
    return bias


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in their sequences and in the KV cache.

    The step's `T` tokens are the concatenation of `B` sequences' query spans (prefill chunks or single decode
    tokens), in order.

    Attributes:
        positions: [T] int64, position of each token in its sequence (RoPE and causality).
        slot_mapping: [T] int64, KV-cache slot each token's K/V is written to.
        query_lens: per sequence, tokens in this step.
        context_lens: per sequence, tokens in the KV cache after this step (earlier context + query).
        decode_gather: [Bd, Cd] int64 KV slots of the decode sequences (query length 1), right-padded with 0;
            None when the step has no decode sequence or reads them with the kernel (`decode_block_tables`).
        decode_mask: [Bd, 1, 1, Cd] bool, True where `decode_gather` is a real slot.
        decode_rows: [Bd] int64, token index of each decode sequence's query in the step.
        decode_block_tables: [Bd, max blocks] int32 KV blocks of the decode sequences, right-padded with 0, and
            decode_seq_lens: [Bd] int32 their context lengths, instead of `decode_gather` on `KERNEL_DEVICES`
            (the Triton decode kernel reads the cache through them; `kv_block_size` is then the block size).
        prefill_spans: per prefill sequence (query length > 1): (first token index, query length,
            [context] int64 KV slots of its whole context).
        block_tables: [B, max_blocks] int32 and seq_lens: [B] int32, set instead of the fields above for a
            decode-only step on CUDA: the Triton kernel reads the block tables itself (fixed shapes, so the step
            can be captured in a CUDA graph); kv_block_size is then the cache's block size.
        state_slots: [B] int64, per sequence its slot in the recurrent-state pool (`freetoken.engine.state_pool`);
            None for models without linear-attention layers.
        state_splits: per sequence, offsets inside its query span (ascending, 0 < offset < query length) after
            which the linear layers call `state_capture(layer, seq index, offset, conv row, ssm row)` with the
            sequence's state at that point (snapshots at marks, `freetoken.engine.state_checkpoints`); None when
            the step takes none.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    decode_gather: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_rows: torch.Tensor | None
    prefill_spans: list[tuple[int, int, torch.Tensor]]
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    kv_block_size: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    state_splits: list[list[int]] | None = None
    state_capture: Callable[[int, int, int, torch.Tensor, torch.Tensor], None] | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Build the metadata of one step from per-sequence lengths and block tables (KV block ids). On
        `KERNEL_DEVICES` the decode sequences get block tables for the Triton kernel, elsewhere padded gathers."""
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decode: list[tuple[int, torch.Tensor]] = []
        prefill: list[tuple[int, int, torch.Tensor]] = []
        kernel = device.type in KERNEL_DEVICES
        row = 0
        for q, c, blocks in zip(query_lens, context_lens, block_tables, strict=True):
            # A decode read by the kernel needs only its new token's slot; the others their whole context's.
            pos = torch.arange(c - 1, c) if q == 1 and kernel else torch.arange(c)
            ctx_slots = torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
            positions.append(pos[pos.numel() - q :])
            slots.append(ctx_slots[ctx_slots.numel() - q :])
            if q == 1:
                decode.append((row, ctx_slots))
            else:
                prefill.append((row, q, ctx_slots.to(device)))
            row += q
        meta = cls(
            positions=torch.cat(positions).to(device),
            slot_mapping=torch.cat(slots).to(device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            decode_gather=None,
            decode_mask=None,
            decode_rows=None,
            prefill_spans=prefill,
        )
        if not decode:
            return meta
        meta.decode_rows = torch.tensor([r for r, _ in decode], dtype=torch.int64, device=device)
        if kernel:
            decodes = [
                (blocks[: -(-c // block_size)], c)
                for q, c, blocks in zip(query_lens, context_lens, block_tables, strict=True)
                if q == 1
            ]
            tables = torch.zeros(len(decodes), max(len(b) for b, _ in decodes), dtype=torch.int32)
            for j, (blocks, _) in enumerate(decodes):
                tables[j, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            meta.decode_block_tables = tables.to(device)
            meta.decode_seq_lens = torch.tensor([c for _, c in decodes], dtype=torch.int32, device=device)
            meta.kv_block_size = block_size
            return meta
        width = max(s.numel() for _, s in decode)
        gather = torch.zeros(len(decode), width, dtype=torch.int64)
        mask = torch.zeros(len(decode), width, dtype=torch.bool)
        for j, (_, ctx_slots) in enumerate(decode):
            gather[j, : ctx_slots.numel()] = ctx_slots
            mask[j, : ctx_slots.numel()] = True
        meta.decode_gather = gather.to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)
        return meta


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of a step's tokens over their sequences' paged KV cache.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied).
        k, v: [T, num_kv_heads, head_dim] this step's keys (RoPE applied) and values, written into the cache; None
            where the caller wrote them already (`freetoken.kernels.layer_ops.qk_norm_rope`).
        k_cache, v_cache: [num_slots, num_kv_heads, head_dim], written in place at `meta.slot_mapping`.
        meta: the step's metadata.
        scale: softmax scale, head_dim ** -0.5 for Qwen3.

    Returns:
        [T, num_heads, head_dim] attention output, dtype of q.
    """
    if k is not None:
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
    if meta.block_tables is not None:
        from freetoken.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.kv_block_size, scale)
    out = torch.empty_like(q)
    if meta.decode_block_tables is not None:
        from freetoken.kernels.paged_attention import paged_decode_attention

        out[meta.decode_rows] = paged_decode_attention(
            q[meta.decode_rows],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.kv_block_size,
            scale,
            # One pass per sequence: the split kernel's scratch is kept per partition count, and these tables' width
            # (the step's longest decode) varies from step to step; the prefill chunk beside them dominates the step.
            partition_size=None,
        )
    elif meta.decode_gather is not None:
        # (Bd, Cd, nkv, D) -> (Bd, nkv, Cd, D)
        kd = k_cache[meta.decode_gather].transpose(1, 2)
        vd = v_cache[meta.decode_gather].transpose(1, 2)
        qd = q[meta.decode_rows].unsqueeze(2)  # (Bd, nh, 1, D)
        with sdpa_kernel(_SDPA_BACKENDS):
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = od.squeeze(2)
    for row, qlen, ctx_slots in meta.prefill_spans:
        ctx = ctx_slots.numel()
        qp = q[row : row + qlen].transpose(0, 1).unsqueeze(0)  # (1, nh, q, D)
        kp = k_cache[ctx_slots].transpose(0, 1).unsqueeze(0)  # (1, nkv, ctx, D)
        vp = v_cache[ctx_slots].transpose(0, 1).unsqueeze(0)
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            if ctx == qlen:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # Query i sits at position ctx - qlen + i and sees keys 0..that position: the causal mask aligned to
                # the lower right, which flash attention takes without materialising a [qlen, ctx] mask (long
                # prefixes).
                mask = lower_right_causal_bias(qlen, ctx)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row : row + qlen] = op.squeeze(0).transpose(0, 1)
    return out
