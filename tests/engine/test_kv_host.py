"""The KV prefix cache's host tier (`freetoken.engine.kv_host`) on the CPU device, where the tier is a second buffer
on the same code path as CUDA's pinned one: demotion on eviction, promotion on a hit, LRU in both tiers, the
crossover rule, snapshot lifetimes (`on_evict`), resizes; and, through the engine, every answer equal to a cold
run's while sessions evict each other from a tiny KV budget.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine import assert_all_blocks_free, greedy
from test_engine_prefix_cache import cold, long_prompt, one

from freetoken.config import EngineConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.kv_host import CopyCost, HostKVTier, contiguous_runs, default_host_bytes
from freetoken.engine.prefix_cache import ROOT, PrefixCache
from freetoken.engine.resize import resize

BS = 4


def test_contiguous_runs_cut_where_either_side_jumps():
    assert contiguous_runs([(4, 8), (3, 7), (6, 9)]) == [(3, 7, 2), (6, 9, 1)]
    assert contiguous_runs([(0, 5), (1, 4)]) == [(0, 5, 1), (1, 4, 1)]
    assert contiguous_runs([]) == []


def test_crossover_is_the_fixed_cost_over_the_marginal_saving():
    cost = CopyCost(bytes_per_token=1000, h2d_bytes_per_s=1e9, fixed_s=1e-3)  # copy: 1 us per token
    assert cost.crossover_tokens == 0.0 and cost.worth_promoting(1)  # nothing measured yet: promote
    for n in (100, 400, 1600, 6400):  # each prefill step: 50 ms fixed + 11 us per token
        cost.add_prefill(n, 0.05 + 11e-6 * n)
    assert cost.prefill_s_per_token == pytest.approx(11e-6)  # the slope: the fixed 50 ms is not a token's cost
    assert cost.crossover_tokens == pytest.approx(1e-3 / 10e-6)  # 100 tokens
    assert not cost.worth_promoting(99) and cost.worth_promoting(101)
    slow = CopyCost(bytes_per_token=1000, h2d_bytes_per_s=1e8, fixed_s=1e-3)  # copy: 10 us per token
    slow.add_prefill(1000, 5e-3)  # one size only: the mean, 5 us per token
    assert slow.crossover_tokens == math.inf and not slow.worth_promoting(10**6)
    assert slow.stats()["crossover_tokens"] is None


def make_cache(num_blocks: int = 4, host_blocks: int = 3) -> tuple[KVCache, HostKVTier, PrefixCache]:
    kv = KVCache(2, 1, 2, num_blocks, BS, torch.float32, torch.device("cpu"))
    host = HostKVTier(kv, host_blocks)
    cache = PrefixCache(kv.allocator, BS, host=host)
    return kv, host, cache


def fill(kv: KVCache, cache: PrefixCache, tokens: list[int], value: float) -> list[int]:
    """A sequence of `tokens` (whole blocks) computed and released: its blocks indexed, their K/V = value + i."""
    blocks = cache.allocate(len(tokens) // BS)
    parent = ROOT
    for i, block in enumerate(blocks):
        for k, v in kv.layers:
            k[block * BS : (block + 1) * BS] = value + i
            v[block * BS : (block + 1) * BS] = -(value + i)
        parent = cache.insert(parent, tokens, i, block)
    cache.release(blocks)
    return blocks


def test_evicted_blocks_go_to_the_host_and_come_back_with_their_kv():
    kv, host, cache = make_cache(host_blocks=4)
    a, b = list(range(8)), list(range(100, 108))
    fill(kv, cache, a, 10.0)
    fill(kv, cache, b, 20.0)  # 4 blocks of 4: the GPU tier is full
    gone: list[int] = []
    cache.on_evict = gone.append
    fill(kv, cache, list(range(200, 208)), 30.0)  # evicts a's two blocks (least recent) to the host
    assert host.num_live == 2 and host.num_demoted_blocks == 2 and not gone
    match = cache.match(a + [1, 2])
    assert match.num_blocks == 2 and set(match.host) == {0, 1} and match.blocks == [-1, -1]
    promoted = cache.promote(match)
    assert promoted is not None and not promoted.host and -1 not in promoted.blocks
    for i, block in enumerate(promoted.blocks):
        for k, v in kv.layers:
            assert torch.equal(k[block * BS : (block + 1) * BS], torch.full_like(k[:BS], 10.0 + i))
            assert torch.equal(v[block * BS : (block + 1) * BS], torch.full_like(v[:BS], -(10.0 + i)))
    # Room for a's blocks came from b's, now on the host; the tier freed a's slots (b's took two of them). One copy
    # per batch, each a contiguous run: a out, b out, a back.
    assert host.num_promoted_blocks == 2 and host.num_live == 2 and host.num_copies == 3
    assert cache.match(b).num_blocks == 2 and set(cache.match(b).host) == {0, 1}
    assert host.bytes_h2d == 2 * kv.bytes_per_block and host.bytes_d2h == 4 * kv.bytes_per_block
    assert not gone


def test_a_node_dies_only_when_it_leaves_the_host_tier_too():
    """`on_evict` (state snapshots live and die with their KV block) fires when the host tier evicts the block,
    least recently used first, not when the GPU tier moves it to the host."""
    kv, host, cache = make_cache(num_blocks=2, host_blocks=2)
    seqs = [[s * 100 + t for t in range(8)] for s in range(3)]
    gone: list[int] = []
    cache.on_evict = gone.append
    fill(kv, cache, seqs[0], 1.0)
    nodes0 = cache.match(seqs[0]).nodes
    fill(kv, cache, seqs[1], 2.0)  # seqs[0] -> host
    assert not gone and host.num_live == 2
    fill(kv, cache, seqs[2], 3.0)  # seqs[1] -> host, which evicts seqs[0] (tail first, as released)
    assert sorted(gone) == sorted(nodes0) and host.num_evicted_blocks == 2
    assert cache.match(seqs[0]).num_blocks == 0 and cache.match(seqs[1]).num_blocks == 2


def test_without_a_tier_eviction_drops_at_once():
    kv = KVCache(2, 1, 2, 2, BS, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv.allocator, BS)
    gone: list[int] = []
    cache.on_evict = gone.append
    fill(kv, cache, list(range(8)), 1.0)
    fill(kv, cache, list(range(100, 108)), 2.0)
    assert len(gone) == 2


@pytest.mark.parametrize("with_host", [False, True])
def test_a_kv_shrink_spills_to_the_host_or_drops_with_on_evict(with_host):
    """A resize that keeps fewer blocks: with a tier the cached blocks left out move there (their nodes live on);
    without one they leave the cache and `on_evict` says so (snapshots die with their KV)."""
    kv, _host, cache = make_cache(num_blocks=4, host_blocks=4)
    if not with_host:
        cache = PrefixCache(kv.allocator, BS)
    gone: list[int] = []
    cache.on_evict = gone.append
    fill(kv, cache, list(range(16)), 1.0)
    keep = cache.keep_on_resize(2)
    cache.spill(keep)
    kv.adopt(kv.allocate_layers(2), keep)
    cache.remap(keep)
    match = cache.match(list(range(16)))
    assert match.num_blocks == (4 if with_host else 2)
    assert len(gone) == (0 if with_host else 2)
    if with_host:
        assert set(match.host) == {2, 3}
        assert cache.promote(match).num_blocks == 2  # no room for them in 2 GPU blocks: start after the GPU's
        keep = cache.keep_on_resize(4)  # grown back: they come back with their K/V
        kv.adopt(kv.allocate_layers(4), keep)
        cache.remap(keep)
        promoted = cache.promote(cache.match(list(range(16))))
        assert promoted is not None and promoted.num_blocks == 4 and not promoted.host
        for i, block in enumerate(promoted.blocks):
            assert torch.equal(
                kv.layers[1][0][block * BS : (block + 1) * BS], torch.full_like(kv.layers[1][0][:BS], 1.0 + i)
            )


def test_below_the_crossover_host_blocks_are_recomputed_and_their_entries_repointed():
    kv, host, cache = make_cache(host_blocks=8)
    a = list(range(8))
    fill(kv, cache, a, 10.0)
    fill(kv, cache, list(range(100, 116)), 20.0)  # a -> host
    host.cost.add_prefill(1000, 1e-9)  # prefill nearly free: copying never pays
    match = cache.match(a + [5])
    assert set(match.host) == {0, 1}
    kept = cache.promote(match)
    assert kept is not None and kept.num_blocks == 0 and host.num_skipped_tokens == 8 and host.num_promoted_blocks == 0
    # The sequence computes a's blocks again; indexing them re-points the host entries (same nodes).
    blocks = cache.allocate(2)
    parent = ROOT
    for i, block in enumerate(blocks):
        parent = cache.insert(parent, a, i, block)
    assert cache.match(a).nodes == match.nodes and not cache.match(a).host
    assert host.num_live == 2  # only the blocks this allocation moved there (not a's any more)
    assert all(key[1][0] >= 100 for key in cache._host_index)


def test_promotion_without_room_is_cut_or_refused():
    kv, host, cache = make_cache(num_blocks=2, host_blocks=2)
    a = list(range(8))
    fill(kv, cache, a, 1.0)
    held = cache.allocate(2)  # a -> host; both GPU blocks held by a running sequence
    match = cache.match(a)
    assert cache.promote(match).num_blocks == 0  # partial_ok: start without them
    assert cache.promote(match, partial_ok=False) is None  # a snapshot's blocks: wait
    assert host.num_live == 2  # nothing lost
    cache.release(held)


def test_default_budget():
    cfg = EngineConfig(device="cpu")
    assert default_host_bytes(cfg, None, torch.float32, "cpu") == 0  # type: ignore[arg-type]  # CPU: none by default
    assert default_host_bytes(EngineConfig(device="cpu", kv_host_gb=0.5), None, torch.float32, "cpu") == 5 * 10**8  # type: ignore[arg-type]
    off = EngineConfig(device="cpu", kv_host_gb=0.5, no_prefix_cache=True)
    assert default_host_bytes(off, None, torch.float32, "cpu") == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--kv-host-gb"):
        EngineConfig(kv_host_gb=-2).validate()


# --- through the engine ------------------------------------------------------------------------------------------


def sessions(demo, engine, turns: int = 3, n: int = 3) -> dict[str, list]:
    """`n` sessions of `turns` turns, interleaved (each turn resends the history plus new tokens); asserts each
    answer equals the cold engine's and returns the cached-token counts per session."""
    histories = {s: long_prompt(demo, 24 + 3 * s, salt=7 * s) for s in range(n)}
    cached: dict[str, list] = {str(s): [] for s in range(n)}
    for turn in range(turns):
        for s, history in histories.items():
            r = one(engine, history, greedy(8), rid=f"{s}-{turn}")
            want = cold(demo, history, greedy(8), kv_block_size=BS, max_model_len=96).token_ids
            assert r.token_ids == want, (s, turn)
            cached[str(s)].append(r.last.num_cached_tokens)
            histories[s] = history + r.token_ids + [11, 12, 13]
    return cached


def test_sessions_evicting_each_other_stay_exact_and_reuse_more_with_the_host_tier(demo):
    """Three sessions through a KV cache that holds about one of them: with the host tier every later turn reuses
    its whole history (restored tokens count as cached), without it most is prefilled again; answers equal cold."""
    base = dict(kv_block_size=BS, kv_cache_tokens=96, max_model_len=96)
    with_host = demo.engine(kv_host_gb=0.001, **base)
    assert with_host.kv_host is not None
    # Promote every host hit: on a loaded CPU the measured crossover can exceed these short turns, and this test is
    # about the copy path (the decision has its own tests above).
    with_host.kv_host.cost.worth_promoting = lambda num_tokens: True  # type: ignore[method-assign]
    got = sessions(demo, with_host)
    without = sessions(demo, demo.engine(**base))
    stats = with_host.stats()["kv_host"]
    assert stats["num_promoted_blocks"] > 0 and stats["num_hit_tokens"] == stats["num_promoted_blocks"] * BS
    assert stats["bytes_h2d"] == stats["num_promoted_blocks"] * with_host.kv.bytes_per_block
    assert sum(map(sum, got.values())) > sum(map(sum, without.values()))
    for s, counts in got.items():
        assert all(c >= 24 for c in counts[1:]), (s, counts)  # each later turn: its whole previous prompt
    assert with_host.scheduler.prefix_cache.stats()["num_hit_tokens"] == sum(map(sum, got.values()))
    assert stats["prefill_samples"] > 0 and stats["crossover_tokens"] is not None
    assert_all_blocks_free(with_host)


def test_concurrent_sessions_with_the_host_tier_stay_exact(demo):
    """Sessions running at once (subagents) under a tiny budget: preemption, demotion and promotion interleave."""
    engine = demo.engine(kv_block_size=BS, kv_cache_tokens=64, max_model_len=96, kv_host_gb=0.001)
    system = long_prompt(demo, 16)
    from test_engine import run

    for turn in range(2):
        prompts = {str(i): system + long_prompt(demo, 6 + 4 * i + turn * 9, salt=30 + 5 * i) for i in range(3)}
        results = run(engine, {f"{k}-{turn}": (p, greedy(10)) for k, p in prompts.items()})
        for k, p in prompts.items():
            assert results[f"{k}-{turn}"].token_ids == cold(demo, p, greedy(10), kv_block_size=BS).token_ids, k
    assert engine.kv_host.num_demoted_blocks > 0
    assert_all_blocks_free(engine)


def test_the_host_tier_survives_a_kv_resize_and_keeps_what_a_shrink_drops(demo):
    engine = demo.engine(kv_block_size=BS, kv_cache_tokens=128, max_model_len=96, kv_host_gb=0.001)
    prompt = long_prompt(demo, 60)
    first = one(engine, prompt, greedy(8), rid="a")
    history = prompt + first.token_ids
    one(engine, long_prompt(demo, 60, salt=50), greedy(8), rid="other")
    cache = engine.scheduler.prefix_cache
    on_gpu, live = cache.num_cached_blocks, engine.kv_host.num_live
    assert on_gpu > 24
    resize(engine, kv_blocks=24)  # shrink: the cached blocks past 24 go to the host tier
    assert engine.kv_host.num_live == live + on_gpu - 24
    r = one(engine, history + [5, 6], greedy(8), rid="b")
    assert r.last.num_cached_tokens == (len(history) - 1) // BS * BS
    assert r.token_ids == cold(demo, history + [5, 6], greedy(8), kv_block_size=BS).token_ids
    resize(engine, kv_blocks=40)  # and back up: the host tier is untouched
    r = one(engine, history + [5, 6], greedy(8), rid="c")
    assert r.token_ids == cold(demo, history + [5, 6], greedy(8), kv_block_size=BS).token_ids
    assert_all_blocks_free(engine)


def test_hybrid_snapshots_live_on_while_their_kv_is_in_the_host_tier(tmp_path_factory):
    """Qwen3.5 (hybrid): where the GPU tier alone drops a snapshot with its evicted KV block
    (test_state_checkpoints.test_kv_eviction_invalidates_snapshots), the host tier keeps the block, so the snapshot
    stays valid, the prompt resumes from it on promoted blocks, and the answer equals cold's."""
    from test_state_checkpoints import TOOLS, Qwen35, cold, session

    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

    qwen35 = Qwen35(build_qwen3_5_demo_checkpoint(tmp_path_factory.mktemp("qwen35"), seed=0))
    engine = qwen35.engine(kv_cache_tokens=512, kv_host_gb=0.01)
    p1 = qwen35.encode(session(1, salt="first "), TOOLS)
    one(engine, p1, greedy(4))
    for s in range(3):  # other prompts take every GPU block
        one(engine, qwen35.encode(session(1, salt=f"other {s} "), TOOLS), greedy(4))
    assert engine.stats()["state_checkpoints"]["num_invalidated"] == 0
    promoted = engine.kv_host.num_promoted_blocks
    r = one(engine, p1 + [11, 12, 13])
    assert r.last.num_cached_tokens > len(p1) // 2 and engine.kv_host.num_promoted_blocks > promoted
    assert r.token_ids == cold(qwen35, p1 + [11, 12, 13])
    assert_all_blocks_free(engine)


def test_runs_do_not_cross_a_host_chunk():
    # Host slots on the src side (a promotion), chunks of 4 slots: 3 and 4 are in different chunks.
    assert contiguous_runs([(2, 10), (3, 11), (4, 12), (5, 13)], host_side=0, chunk=4) == [(2, 10, 2), (4, 12, 2)]
    # On the dst side (a demotion): GPU blocks 7, 8 contiguous, host slots 3 | 4 cut.
    assert contiguous_runs([(7, 3), (8, 4)], host_side=1, chunk=4) == [(7, 3, 1), (8, 4, 1)]
    assert contiguous_runs([(7, 3), (8, 4)]) == [(7, 3, 2)]


def test_host_memory_is_added_a_chunk_at_a_time_as_blocks_are_evicted():
    """A tier of 5 slots in chunks of 2 blocks: one chunk at start, another each time no allocated slot is free;
    blocks demoted into three chunks come back with their own K/V (runs cut at the chunk edges)."""
    kv = KVCache(2, 1, 2, 6, BS, torch.float32, torch.device("cpu"))
    host = HostKVTier(kv, 5, chunk_bytes=2 * kv.bytes_per_block)
    cache = PrefixCache(kv.allocator, BS, host=host)
    assert host.num_allocated == 2 and host.allocated_nbytes == 2 * kv.bytes_per_block and host.num_free == 5
    a = list(range(20))  # 5 blocks
    fill(kv, cache, a, 10.0)
    assert host.num_live == 0 and len(host.chunks) == 1
    fill(kv, cache, list(range(100, 124)), 20.0)  # 6 blocks: all of a's go to the host, which grows to 3 chunks
    assert host.num_live == 5 and len(host.chunks) == 3 and host.num_allocated == 5 and host.num_free == 0
    assert host.stats()["allocated_nbytes"] == host.stats()["nbytes"] == 5 * kv.bytes_per_block
    promoted = cache.promote(cache.match(a + [1]))
    assert promoted is not None and not promoted.host
    for i, block in enumerate(promoted.blocks):
        for k, v in kv.layers:
            assert torch.equal(k[block * BS : (block + 1) * BS], torch.full_like(k[:BS], 10.0 + i))
            assert torch.equal(v[block * BS : (block + 1) * BS], torch.full_like(v[:BS], -(10.0 + i)))


def test_the_tier_stops_growing_when_host_memory_runs_low(monkeypatch, caplog):
    """Past the first chunk, a chunk is added only while MemAvailable leaves the margin after it; otherwise the
    capacity stays what is allocated (logged) and evictions reuse the least recently used slots."""
    from freetoken.engine import kv_host
    from freetoken.moe import budget

    kv = KVCache(2, 1, 2, 2, BS, torch.float32, torch.device("cpu"))
    host = HostKVTier(kv, 8, chunk_bytes=2 * kv.bytes_per_block)
    cache = PrefixCache(kv.allocator, BS, host=host)
    monkeypatch.setattr(budget, "host_available_bytes", lambda: kv_host.DEFAULT_MARGIN_BYTES)
    gone: list[int] = []
    cache.on_evict = gone.append
    seqs = [[s * 100 + t for t in range(8)] for s in range(3)]
    for s, tokens in enumerate(seqs):
        fill(kv, cache, tokens, float(s))
    assert host.num_slots == host.num_allocated == 2 and host.num_live == 2  # seqs[1] on the host, seqs[0] dropped
    assert len(gone) == 2 and "stays at 2 blocks" in caplog.text
    assert cache.match(seqs[1]).num_blocks == 2 and cache.match(seqs[0]).num_blocks == 0


def test_reserve_grows_ahead_to_the_free_slots_asked_within_the_capacity():
    """`reserve()` adds chunks until `headroom` allocated slots are free (a chunk at a time), never past the
    capacity."""
    kv = KVCache(2, 1, 2, 6, BS, torch.float32, torch.device("cpu"))
    host = HostKVTier(kv, 7, chunk_bytes=2 * kv.bytes_per_block)
    assert host.num_allocated == 2
    host.headroom = 5
    assert host.reserve() == 2 and host.num_allocated == 6 and len(host._free) == 6
    assert host.reserve() == 0  # already there
    host.headroom = 100
    assert host.reserve() == 1 and host.num_allocated == host.num_slots == 7  # the last chunk is shorter
    assert host.reserve() == 0


def test_the_engine_keeps_one_steps_evictions_pinned_ahead(demo, monkeypatch):
    """At start the tier holds the blocks one step can evict (its token budget's and one per sequence); once
    evictions used them, going idle grows it back (`LLMEngine.idle`), so no request pays for the growth. (Chunks of
    two blocks: the demo's blocks are small.)"""
    from freetoken.engine import kv_host

    monkeypatch.setattr(kv_host, "CHUNK_BYTES", 2 * demo.engine(kv_block_size=BS).kv.bytes_per_block)
    engine = demo.engine(
        kv_block_size=BS, kv_cache_tokens=64, max_model_len=96, kv_host_gb=0.01, max_prefill_tokens=16, max_num_seqs=2
    )
    tier, headroom = engine.kv_host, engine.kv.blocks_for(16) + 2
    assert tier.num_slots > 3 * headroom and len(tier._free) >= headroom
    assert tier.allocated_nbytes < tier.nbytes  # not all of it: the rest is added as it fills
    for salt in range(6):  # sessions that evict each other's blocks into the tier
        one(engine, long_prompt(demo, 40, salt=salt), greedy(4), rid=str(salt))
    assert tier.num_live > 0 and len(tier._free) < headroom
    engine.idle()
    assert len(tier._free) >= headroom
    assert_all_blocks_free(engine)
