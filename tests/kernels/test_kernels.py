"""Triton kernels against their torch references.

On a GPU they run compiled (bf16, shape grid with odd sizes); without one, Triton's interpreter
(TRITON_INTERPRET=1, set in conftest before the kernels are defined) runs the same kernels on the CPU in float32,
so CI checks their indexing and masking.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from freetoken._core import InvalidArgumentError, align_slots, aligned_len
from freetoken.kernels import paged_attention
from freetoken.kernels.fused_moe import (
    ALIGN_KERNEL_MAX_BINS,
    ALIGN_KERNEL_MAX_PAIRS,
    align_pairs,
    block_m_for,
    fused_moe,
    fused_moe_reference,
    fused_moe_tiles,
)
from freetoken.kernels.layer_ops import _round_to
from freetoken.kernels.moe_tiles import sum_pairs
from freetoken.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from gpu_marker import GPU_WHEN_AVAILABLE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ATOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
pytestmark = GPU_WHEN_AVAILABLE  # the kernels run on CUDA where there is one


@pytest.mark.parametrize("num_tokens,top_k", [(1, 8), (3, 2), (33, 4)])
def test_align_pairs_groups_by_expert(num_tokens, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(16, generator=gen)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    sorted_pairs, block_expert = align_pairs(ids, 16, 16)
    num_pairs = ids.numel()
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    tiles = sorted_pairs.view(-1, 16)
    for tile, expert in zip(tiles.tolist(), block_expert.tolist(), strict=True):
        pairs = [p for p in tile if p < num_pairs]
        if expert < 0:
            assert not pairs
        assert all(ids.reshape(-1)[p].item() == expert for p in pairs)


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_m",
    [
        (1, 1, 6, 16),
        (1, 8, 128, 16),
        (4, 8, 128, 16),
        (7, 3, 20, 16),
        (64, 8, 128, 16),
        (128, 8, 2000, 16),
        (5, 4, 6, 64),
    ],
)
def test_align_kernel_equals_tensor_ops(num_tokens, top_k, num_experts, block_m):
    """`align_pairs`' Triton program (Triton's interpreter on the CPU) gives its tensor ops' result bit for bit: the
    same rows, padding and tile experts, skipped pairs (negative ids) included, from one pair to 1024 and none,
    int64 or int32 ids, from 6 experts to 2000 slots. An id past the experts is skipped, not read out of bounds;
    past its sizes the program refuses."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    ids[torch.rand(num_tokens, top_k, generator=gen) < 0.1] = -1
    want = align_pairs(ids, num_experts, block_m, kernel=False)
    for dtype in (torch.int64, torch.int32):
        got = align_pairs(ids.to(DEVICE, dtype), num_experts, block_m, kernel=True)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    past = ids.clone()
    past[0, 0] = num_experts + 3
    ids[0, 0] = -1
    got, want = align_pairs(past.to(DEVICE), num_experts, block_m, kernel=True), align_pairs(ids, num_experts, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    empty = torch.zeros(0, top_k, dtype=torch.int64)
    assert [t.numel() for t in align_pairs(empty.to(DEVICE), num_experts, block_m, kernel=True)] == [0, 0]
    too_many = torch.zeros(ALIGN_KERNEL_MAX_PAIRS + 1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="Triton program takes up to"):
        align_pairs(too_many, num_experts, block_m, kernel=True)
    with pytest.raises(ValueError, match="Triton program takes up to"):
        align_pairs(ids, ALIGN_KERNEL_MAX_BINS - 1, block_m, kernel=True)


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 2048), (3, 2, 96), (5, 4, 1500), (70, 2, 96)])
def test_sum_pairs_sums_each_tokens_experts(num_tokens, top_k, hidden):
    """`sum_pairs` (one Triton launch; the interpreter on the CPU) sums each token's k rows into out: exactly where
    the sums are exact (small integers), within float32 sum order of torch.sum otherwise, into a given buffer; it
    refuses a buffer of another shape, dtype or layout, and pairs that are strided or not whole tokens. Hidden sizes
    that are not a power of two mask the last columns; 70 tokens take the programs past SUM_PAIRS_SMALL_TOKENS."""
    gen = torch.Generator().manual_seed(hidden)
    ints = torch.randint(-64, 64, (num_tokens * top_k, hidden), generator=gen).to(DTYPE).to(DEVICE)
    assert torch.equal(sum_pairs(ints, top_k, kernel=True), ints.view(num_tokens, top_k, hidden).sum(dim=1))
    pairs = torch.randn(num_tokens * top_k, hidden, generator=gen).to(DTYPE).to(DEVICE)
    out = torch.full((num_tokens, hidden), 7.0, dtype=DTYPE, device=DEVICE)
    assert sum_pairs(pairs, top_k, out, kernel=True) is out
    want = pairs.double().view(num_tokens, top_k, hidden).sum(dim=1)
    # one rounding of a float32 sum (at most half a unit in the last place of the dtype) and float32 sum order
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=2**-7 if DTYPE == torch.bfloat16 else 1e-6)
    for bad_out in (
        torch.empty(num_tokens, 2 * hidden, dtype=DTYPE, device=DEVICE)[:, ::2],  # strided
        torch.empty(num_tokens + 1, hidden, dtype=DTYPE, device=DEVICE),  # a row too many
        torch.empty(num_tokens, hidden, dtype=torch.float64, device=DEVICE),
    ):
        with pytest.raises(ValueError, match="sum_pairs writes a contiguous"):
            sum_pairs(pairs, top_k, bad_out)
    with pytest.raises(ValueError, match="sum_pairs takes contiguous"):
        sum_pairs(torch.cat([pairs, pairs], dim=1)[:, ::2], top_k)
    with pytest.raises(ValueError, match="sum_pairs takes contiguous"):
        sum_pairs(pairs[1:], top_k)  # not whole tokens


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 8, 16), (7, 3, 16), (40, 8, 64)])
def test_host_alignment_equals_device(num_tokens, top_k, block_m):
    """The Rust alignment the expert cache sends with its slot ids (`freetoken._core.align_slots`) equals the
    device one."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(-1, 20, (num_tokens, top_k), generator=gen)
    expected = align_pairs(ids.to(DEVICE), 20, block_m)
    out = np.full(ids.numel() + 4096, -7, dtype=np.int64)
    rows, tiles = align_slots(ids.numpy().astype(np.int32), 20, block_m, out)
    assert (rows, tiles) == aligned_len(ids.numel(), 20, block_m)
    n = ids.numel()
    assert out[:n].tolist() == ids.reshape(-1).tolist()
    assert out[n : n + rows].tolist() == expected[0].tolist()
    assert out[n + rows : n + rows + tiles].tolist() == expected[1].tolist()
    assert (out[n + rows + tiles :] == -7).all()  # nothing written past the layout
    with pytest.raises(InvalidArgumentError, match="out holds"):
        align_slots(ids.numpy(), 20, block_m, np.zeros(n, dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        align_slots(np.array([[20]]), 20, block_m, out)


@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k",
    [(1, 64, 32, 8, 2), (5, 96, 48, 16, 4), (33, 64, 80, 8, 3)]
    + ([(64, 2048, 768, 128, 8)] if DEVICE == "cuda" else []),
)
def test_fused_moe_matches_reference(num_tokens, hidden, inter, num_experts, top_k):
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, DTYPE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, DTYPE)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE, DTYPE)
    got = fused_moe(x, w13, w2, ids, weights).float()
    expected = fused_moe_reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    # Picks computed elsewhere (negative ids) contribute nothing.
    ids[::2, 0] = -1
    got = fused_moe(x, w13, w2, ids, weights).float()
    expected = fused_moe_reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("config", [(128, 64, 8, 4), (128, 32, 4, 3)])
def test_fused_moe_launch_configs_match_the_reference(config):
    """Another tile shape (`fused_moe(config=...)`, as benches/prefill_compute.py times) computes the same sum,
    masks included (tiles wider than the matrices)."""
    num_tokens, hidden, inter, num_experts, top_k = (300, 2048, 768, 128, 8) if DEVICE == "cuda" else (9, 96, 80, 8, 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, DTYPE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, DTYPE)
    weights, ids = torch.topk(torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1), top_k)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE, DTYPE)
    got = fused_moe(x, w13, w2, ids, weights, config=config).float()
    torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, ids, weights), atol=ATOL, rtol=ATOL)


def test_fused_moe_in_stages_is_fused_moe_bit_for_bit():
    """The decode driver's split: tiles of hits in stage 0, of filled slots in stage 1 (after `before_stage(1)`);
    every tile is in one stage, so the sum is `fused_moe`'s exactly."""
    num_tokens, hidden, inter, num_experts, top_k = 5, 64, 48, 16, 4
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, DTYPE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, DTYPE)
    weights, ids = torch.topk(torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1), top_k)
    ids[::2, 1] = -1  # run elsewhere (the CPU)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE, DTYPE)
    pairs, tiles = align_pairs(ids, num_experts, block_m_for(ids.numel()))
    later = (tiles >= 0) & (tiles % 3 == 0)  # "filled" slots
    stages = torch.stack([torch.where(later, -1, tiles), torch.where(later, tiles, -1)])
    assert (stages[1] >= 0).any() and (stages[0] >= 0).any()
    called = []
    got = fused_moe_tiles(x, w13, w2, weights, pairs, stages, before_stage=called.append)
    assert called == [1]
    assert torch.equal(got, fused_moe(x, w13, w2, ids, weights))
    # A stage left out leaves its picks out.
    only_hits = fused_moe_tiles(x, w13, w2, weights, pairs, stages[:1])
    kept = torch.where(torch.isin(ids, stages[1][stages[1] >= 0]), -1, ids)
    assert torch.equal(only_hits, fused_moe(x, w13, w2, kept, weights))


def _paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block, width=None, dtype=DTYPE):
    """Random q, K/V caches and scattered block tables of `width` blocks (default: the longest sequence's)."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_heads)
    width = width or max(-(-n // block) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 1
    # Scattered, non-contiguous blocks per sequence.
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    k_cache = torch.randn(num_blocks * block, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks * block, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, perm.to(DEVICE, torch.int32), lens


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim", [([1, 17, 70], 4, 2, 16), ([5, 130], 32, 4, 128)])
@pytest.mark.parametrize("partition_size", [None, 64])
def test_paged_decode_attention_matches_reference(seq_lens, num_heads, num_kv_heads, head_dim, partition_size):
    q, k_cache, v_cache, tables, lens = _paged_case(seq_lens, num_heads, num_kv_heads, head_dim, 16)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, scale, partition_size).float()
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 16, scale)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


# Split-K against the reference: lengths 1, odd, exactly on and one past partition boundaries (64 * k, 64 * k + 1),
# several partitions, a mixed batch, GQA groups of 1, 3, 4 and 8 (padded to 16 rows in the kernel). The block tables
# are wider than the longest sequence, as the captured decode graph's (max_model_len) are, so trailing partitions
# have no tokens and must not enter the reduction. Tolerance: 1e-4 in float32 (the CPU interpreter); 2e-2 in
# bfloat16 (inputs and output rounded to bfloat16, float32 accumulation).
@pytest.mark.parametrize(
    "seq_lens,num_heads,num_kv_heads",
    [([1], 8, 1), ([33, 64, 65], 6, 2), ([511, 1], 4, 1), ([1000, 128, 129, 7], 8, 2), ([1089], 3, 1)],
)
def test_split_decode_attention_matches_reference(seq_lens, num_heads, num_kv_heads):
    block, head_dim, partition = 16, 16, 64
    width = max(-(-n // block) for n in seq_lens) + 9  # > 1 spare partition past the longest sequence
    q, k_cache, v_cache, tables, lens = _paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block, width)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, block, head_dim**-0.5)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, head_dim**-0.5, partition).float()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    # The scratch is reused: NaN left in it (from the partitions no sequence reaches) must not be read.
    with torch.inference_mode():  # the engine's tests may have made the scratch as inference tensors
        for buffers in paged_attention._PARTIALS.values():
            for t in (t for bufs in buffers for t in bufs):
                t.fill_(float("nan"))
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, head_dim**-0.5, partition).float()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_split_decode_attention_is_the_default_past_one_partition():
    """Block tables wider than PARTITION_SIZE take the split kernel, and it matches the single pass."""
    seq_lens, block = [1030, 5], 16
    q, k_cache, v_cache, tables, lens = _paged_case(seq_lens, 4, 2, 16, block)
    before = sum(len(v) for v in paged_attention._PARTIALS.values())
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, 0.25).float()
    assert sum(len(v) for v in paged_attention._PARTIALS.values()) == before + 1  # the split kernel's scratch
    single = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, 0.25, None).float()
    torch.testing.assert_close(got, single, atol=ATOL, rtol=ATOL)
    # A smaller batch of the same shape reuses the buffers instead of allocating.
    paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], lens[:1], block, 0.25)
    assert sum(len(v) for v in paged_attention._PARTIALS.values()) == before + 1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("seq_lens", [[65536], [1, 4096, 32769, 60000], [512 * 37]])
def test_split_decode_attention_long_contexts_on_gpu(seq_lens):
    """Qwen3-30B-A3B's attention shape (32 heads, 4 KV heads, head_dim 128) at long contexts, compiled, bfloat16."""
    block = 16
    q, k_cache, v_cache, tables, lens = _paged_case(seq_lens, 32, 4, 128, block, width=65536 // block)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, 128**-0.5).float()
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, block, 128**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_split_decode_attention_rejects_a_partition_off_the_tile():
    q, k_cache, v_cache, tables, lens = _paged_case([100], 2, 1, 16, 16)
    with pytest.raises(ValueError, match="multiple of 64"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 0.25, 96)


def _torch_module(module, device):
    """A copy of `module` on `device`, whose forward runs the torch ops (the fused kernels run only on CUDA)."""
    import copy

    return copy.deepcopy(module).to(device)


@pytest.mark.parametrize("shape", [(1, 2048), (5, 67), (3, 4, 128), (0, 16)])
def test_rms_norm_matches_the_torch_module(shape):
    from freetoken.kernels.layer_ops import rms_norm
    from freetoken.models.qwen3_moe import RMSNorm

    gen = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    x = 3 * torch.randn(*shape, generator=gen)
    got = rms_norm(x.to(DEVICE, DTYPE), norm.weight.to(DEVICE, DTYPE), norm.eps).float().cpu()
    expected = _torch_module(norm, "cpu")(x.to(DTYPE)).float()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    if len(shape) == 3:  # per-head rows read out of a wider row, as q out of the stacked q/k/v projection
        wide = 3 * torch.randn(shape[0], shape[1] * shape[2] + 8, generator=gen).to(DTYPE)
        view = wide[:, : shape[1] * shape[2]].view(shape)
        got = rms_norm(view.to(DEVICE), norm.weight.to(DEVICE, DTYPE), norm.eps).float().cpu()
        torch.testing.assert_close(got, _torch_module(norm, "cpu")(view).float(), atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(x.to(DEVICE, DTYPE).transpose(0, -1), norm.weight.to(DEVICE, DTYPE), norm.eps)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN row below, in Triton's numpy interpreter
@pytest.mark.parametrize("tokens,experts,top_k,renorm", [(1, 128, 8, True), (9, 60, 4, False), (4, 6, 6, True)])
def test_router_topk_matches_softmax_topk(tokens, experts, top_k, renorm):
    from freetoken.kernels.layer_ops import router_topk

    gen = torch.Generator().manual_seed(experts + top_k)
    # Distinct logits even in bf16 (steps of 1/16 up to 8), so the top-k order is defined.
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).to(DTYPE) / 16
    ids, weights = router_topk(logits.to(DEVICE), top_k, renorm, DTYPE)
    probs = torch.softmax(logits.float(), -1)
    want_w, want_ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == DTYPE
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.float().cpu(), want_w, atol=ATOL, rtol=ATOL)
    # Ties go to the lower expert id; every id is picked once.
    flat = torch.zeros(1, experts, dtype=DTYPE, device=DEVICE)
    tie_ids, _ = router_topk(flat, top_k, renorm, DTYPE)
    assert tie_ids.tolist() == [list(range(top_k))]
    with pytest.raises(ValueError, match="top_k"):
        router_topk(logits.to(DEVICE), experts + 1, renorm, DTYPE)
    # A diverged row (NaN logits) must not send the expert kernels out of bounds.
    nan_ids, _ = router_topk(torch.full((2, experts), float("nan"), dtype=DTYPE, device=DEVICE), top_k, renorm, DTYPE)
    assert ((nan_ids >= 0) & (nan_ids < experts)).all()


@pytest.mark.parametrize("shape", [(1, 2048), (5, 67), (0, 16)])
def test_add_rms_norm_is_the_add_then_the_torch_module(shape):
    from freetoken.kernels.layer_ops import add_rms_norm
    from freetoken.models.qwen3_moe import RMSNorm

    gen = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    x, residual = (3 * torch.randn(*shape, generator=gen).to(DTYPE) for _ in range(2))
    want_sum = residual + x
    want = _torch_module(norm, "cpu")(want_sum).float()
    weight = norm.weight.to(DEVICE, DTYPE)
    got, got_sum = add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight, norm.eps)
    torch.testing.assert_close(got_sum.cpu(), want_sum, atol=0, rtol=0)
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL, rtol=ATOL)
    in_place = residual.to(DEVICE)
    _, s = add_rms_norm(x.to(DEVICE), in_place, weight, norm.eps, out_sum=in_place)
    assert s.data_ptr() == in_place.data_ptr()
    torch.testing.assert_close(in_place.cpu(), want_sum, atol=0, rtol=0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        add_rms_norm(x.to(DEVICE).t(), residual.to(DEVICE).t(), weight, norm.eps)


def _qk_norm_rope_reference(qkv, nq, nkv, q_norm, k_norm, cos, sin, slots, num_slots):
    """The torch modules' path: split q/k/v, per-head RMSNorm, RoPE, index_put into the caches."""
    from freetoken.models.qwen3_moe import _apply_rope

    d = q_norm.weight.shape[0]
    t = qkv.shape[0]
    q, k, v = qkv[:, : nq * d].view(t, nq, d), qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d), qkv[:, (nq + nkv) * d :]
    q, k = _apply_rope(q_norm(q), cos, sin), _apply_rope(k_norm(k), cos, sin)
    k_cache = torch.zeros(num_slots, nkv, d, dtype=qkv.dtype)
    v_cache = torch.zeros(num_slots, nkv, d, dtype=qkv.dtype)
    k_cache[slots] = k
    v_cache[slots] = v.reshape(t, nkv, d)
    return q, k_cache, v_cache


@pytest.mark.parametrize("tokens,nq,nkv,head_dim", [(1, 32, 4, 128), (5, 4, 2, 64), (3, 2, 1, 12)])
def test_qk_norm_rope_is_the_torch_norms_rope_and_cache_write(tokens, nq, nkv, head_dim):
    from freetoken.kernels.layer_ops import qk_norm_rope
    from freetoken.models.qwen3_moe import RMSNorm, RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens * head_dim)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(DTYPE)
    qkv = (3 * torch.randn(tokens, (nq + 2 * nkv) * head_dim, generator=gen)).to(DTYPE)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 1e6)(positions, DTYPE)
    num_slots = 2 * tokens + 1
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    want_q, want_k, want_v = _qk_norm_rope_reference(qkv, nq, nkv, q_norm, k_norm, cos, sin, slots, num_slots)
    k_cache = torch.zeros(num_slots, nkv, head_dim, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = qk_norm_rope(
        qkv.to(DEVICE),
        nq,
        nkv,
        q_norm.weight.to(DEVICE),
        k_norm.weight.to(DEVICE),
        1e-6,
        cos.to(DEVICE),
        sin.to(DEVICE),
        k_cache,
        v_cache,
        slots.to(DEVICE),
    )
    torch.testing.assert_close(v_cache.cpu(), want_v, atol=0, rtol=0)  # copied, untouched rows stay zero
    torch.testing.assert_close(q.cpu(), want_q, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(k_cache.cpu(), want_k, atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope(
            qkv.to(DEVICE),
            nq + 1,
            nkv,
            q_norm.weight.to(DEVICE),
            k_norm.weight.to(DEVICE),
            1e-6,
            cos.to(DEVICE),
            sin.to(DEVICE),
            k_cache,
            v_cache,
            slots.to(DEVICE),
        )


@pytest.mark.skipif(
    DEVICE != "cpu", reason="the interpreter's bf16; tests/engine/test_gpu.py checks the compiled kernel"
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN head, in Triton's numpy interpreter
def test_qk_norm_rope_rounds_bf16_as_torch_and_keeps_nan():
    """bf16 in the interpreter: the kernel's own rounding (`_round_to`, integer ops) gives torch's bf16 ops bit for
    bit, and a head holding a NaN stays NaN (neither zero nor inf)."""
    from freetoken.kernels.layer_ops import qk_norm_rope
    from freetoken.models.qwen3_moe import RMSNorm, RotaryEmbedding

    tokens, nq, nkv, d = 3, 4, 2, 64
    gen = torch.Generator().manual_seed(7)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    qkv = (3 * torch.randn(tokens, (nq + 2 * nkv) * d, generator=gen)).to(torch.bfloat16)
    qkv[1, 5] = float("nan")  # q head 0 of token 1
    cos, sin = RotaryEmbedding(d, 1e6)(torch.tensor([0, 17, 4000]), torch.bfloat16)
    slots = torch.tensor([4, 0, 2])
    want_q, want_k, want_v = _qk_norm_rope_reference(qkv, nq, nkv, q_norm, k_norm, cos, sin, slots, 5)
    k_cache, v_cache = torch.zeros_like(want_k), torch.zeros_like(want_v)
    q = qk_norm_rope(qkv, nq, nkv, q_norm.weight, k_norm.weight, 1e-6, cos, sin, k_cache, v_cache, slots)
    assert q[1, 0].isnan().all() and not q[1, 1:].isnan().any()
    torch.testing.assert_close(q, want_q, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, _round_to(tl.load(x_ptr + offs, mask=ok), tl.bfloat16), mask=ok)


def test_round_to_bf16_is_torchs_cast():
    """`_round_to` (integer ops) rounds float32 to bf16 as torch's cast does: ties to even, overflow to inf, and
    every NaN kept NaN (the device's canonical NaN is 0x7FFFFFFF, whose low half would carry into the sign)."""
    bits = [
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x7F800001,
        0x7FC00000,
        0x7F800000,
        0xFF800000,
        0x7F7FFFFF,
        0x3F808000,
        0x3F818000,
        0x3F80C000,
        0x00000001,
        0x80000000,
    ]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([special, 1e3 * torch.randn(500, generator=torch.Generator().manual_seed(1))]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16).float()
    assert out[:4].isnan().all()
    torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)
