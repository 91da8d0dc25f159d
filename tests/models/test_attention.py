"""Prefill attention (`freetoken.models.attention.paged_attention`): a cold prompt and an extend over a cached
prefix equal plain causal attention, and neither may run on cuDNN, which builds a graph for every new sequence
length (decode steps leave it out as well).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from freetoken.models import attention
from freetoken.models.attention import AttentionMetadata, paged_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """[qlen, nh, D] causal GQA attention of queries at positions start.. over keys 0..(their position)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos_q = torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_prefill_spans_match_causal_attention_and_never_use_cudnn(monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    # attention.py's own name for torch.nn.functional (CausalBias compares the function it gets with the real one).
    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=recording_sdpa))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default: the engine must turn it off itself
    gen = torch.Generator().manual_seed(0)
    nh, nkv, d, block = 8, 2, 16, 4
    scale = d**-0.5
    k_cache = torch.zeros(64, nkv, d)
    v_cache = torch.zeros(64, nkv, d)
    keys = torch.randn(20, nkv, d, generator=gen)
    values = torch.randn(20, nkv, d, generator=gen)
    queries = torch.randn(20, nh, d, generator=gen)
    blocks = [3, 0, 7, 5, 1]  # scattered
    # A cold prompt of 12 tokens, then an extend of 8 over them.
    for start, qlen in ((0, 12), (12, 8)):
        meta = AttentionMetadata.build([qlen], [start + qlen], [blocks], block, torch.device("cpu"))
        span = slice(start, start + qlen)
        got = paged_attention(queries[span], keys[span], values[span], k_cache, v_cache, meta, scale)
        expected = _reference(queries[span], keys[: start + qlen], values[: start + qlen], start, scale)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert seen == [False, False]
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in attention.PREFILL_SDPA_BACKENDS
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter (conftest sets it without a GPU)",
)
def test_decodes_beside_a_prefill_read_the_cache_in_place_on_kernel_devices(monkeypatch):
    """A step with a prefill span and decodes: on a kernel device the decodes go through the Triton decode kernel
    (block tables, no [decodes, longest context] gather of K/V), and every row equals the gathering path's."""
    gen = torch.Generator().manual_seed(1)
    nh, nkv, d, block = 8, 2, 16, 4
    scale = d**-0.5
    k_cache = torch.randn(128, nkv, d, generator=gen)
    v_cache = torch.randn(128, nkv, d, generator=gen)
    query_lens, context_lens = [1, 9, 1], [23, 30, 6]
    tables = [[5, 1, 9, 2, 30, 7], [3, 11, 12, 13, 4, 6, 8, 10], [20, 21]]
    queries = torch.randn(sum(query_lens), nh, d, generator=gen)
    keys = torch.randn(sum(query_lens), nkv, d, generator=gen)
    values = torch.randn(sum(query_lens), nkv, d, generator=gen)
    cpu = torch.device("cpu")

    def run() -> tuple[AttentionMetadata, torch.Tensor]:
        meta = AttentionMetadata.build(query_lens, context_lens, tables, block, cpu)
        out = paged_attention(queries, keys, values, k_cache.clone(), v_cache.clone(), meta, scale)
        return meta, out

    gathered_meta, expected = run()
    monkeypatch.setattr(attention, "KERNEL_DEVICES", {"cuda", "cpu"})
    meta, got = run()
    assert gathered_meta.decode_gather is not None and meta.decode_gather is None
    assert meta.decode_block_tables.tolist() == [[5, 1, 9, 2, 30, 7], [20, 21, 0, 0, 0, 0]]
    assert meta.decode_seq_lens.tolist() == [23, 6]
    torch.testing.assert_close(meta.positions, gathered_meta.positions)
    torch.testing.assert_close(meta.slot_mapping, gathered_meta.slot_mapping)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 1), (7, 19), (64, 64), (33, 500)])
def test_the_lower_right_bias_equals_torch_s_and_allocates_nothing(q_len, kv_len):
    """`lower_right_causal_bias` masks as `causal_lower_right` does (the same SDPA output, and plain causal attention
    aligned to the last key), and holds no storage: torch's own is an unread float32 [2, q_len, kv_len] host tensor."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, q_len, 16), torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
    ours = attention.lower_right_causal_bias(q_len, kv_len)
    theirs = torch.nn.attention.bias.causal_lower_right(q_len, kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ours, enable_gqa=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=theirs, enable_gqa=True))
    expected = _reference(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), kv_len - q_len, 16**-0.5)
    torch.testing.assert_close(out[0].transpose(0, 1), expected, rtol=1e-5, atol=1e-5)
    assert ours.untyped_storage().nbytes() == 0
