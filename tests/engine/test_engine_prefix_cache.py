"""The KV prefix cache inside the engine (CPU, float32): every output equals the same request on a cold engine.

"Cold" is an engine with `no_prefix_cache` running the request alone. Reuse is checked where clients see it (the
chunks' `num_cached_tokens`) and in the cache's counters.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import Result, assert_all_blocks_free, collect, greedy, run

from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams

BS = 4


def cold(demo, prompt: list[int], params: SamplingParams | None = None, **kwargs) -> Result:
    """`prompt` alone on a fresh engine without the prefix cache."""
    return run(demo.engine(no_prefix_cache=True, **kwargs), {"x": (prompt, params or greedy())})["x"]


def one(engine: LLMEngine, prompt: list[int], params: SamplingParams | None = None, rid: str = "x") -> Result:
    return run(engine, {rid: (prompt, params or greedy())})[rid]


def long_prompt(demo, n: int, salt: int = 0) -> list[int]:
    """`n` token ids from the demo prompts (real text), shifted by `salt` so that prompts differ from the start."""
    pool = [t for p in demo.prompts for t in p]
    return [pool[(i + salt) % len(pool)] for i in range(n)]


def test_second_turn_reuses_the_first_and_equals_cold(demo):
    engine = demo.engine(kv_block_size=BS)
    turn1 = long_prompt(demo, 30)
    r1 = one(engine, turn1)
    assert r1.last.num_cached_tokens == 0
    assert r1.last.num_cache_write_tokens == 28  # 7 full blocks of the 30-token prompt
    # The next turn: the whole history (prompt, answer) and a new message.
    turn2 = turn1 + r1.token_ids + long_prompt(demo, 9, salt=5)
    r2 = one(engine, turn2)
    computed = len(turn1) + len(r1.token_ids) - 1  # the last sampled token has no K/V
    assert r2.last.num_cached_tokens == computed // BS * BS
    assert r2.token_ids == cold(demo, turn2, kv_block_size=BS).token_ids
    stats = engine.scheduler.prefix_cache.stats()
    assert stats["num_lookups"] == 2 and stats["num_hit_tokens"] == r2.last.num_cached_tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("length", [20, 22, 41])
def test_strict_prefix_recomputes_from_its_own_tokens(demo, length):
    """A prompt that is a strict prefix of a cached sequence (prompt and output): its next token comes from its
    own last position, never from the cached continuation; block-aligned (20), it is entirely cached and only its
    last position is recomputed."""
    engine = demo.engine(kv_block_size=BS)
    first = long_prompt(demo, 30)
    r1 = one(engine, first, greedy(16))
    history = first + r1.token_ids
    prompt = history[:length]
    r = one(engine, prompt)
    assert r.token_ids == cold(demo, prompt, kv_block_size=BS).token_ids
    expected = length - 1 if length % BS == 0 else length // BS * BS
    assert r.last.num_cached_tokens == expected
    assert_all_blocks_free(engine)


def test_fully_cached_prompt_never_writes_the_shared_block(demo):
    engine = demo.engine(kv_block_size=BS)
    prompt = long_prompt(demo, 24)
    one(engine, prompt)
    cache = engine.scheduler.prefix_cache
    last = cache.match(prompt).blocks[-1]
    k_before = [k[last * BS : (last + 1) * BS].clone() for k, _ in engine.kv.layers]

    def after_step(n):
        if n == 1:  # position 23 was recomputed into a copy of the last block
            seq = engine._seqs["x"]
            assert seq.block_table[:-1] == cache.match(prompt).blocks[:-1] and seq.block_table[-1] != last
            assert cache.ref_count(last) == 0

    engine.add_request("x", prompt, greedy())
    r = collect(engine, {}, after_step)["x"]
    assert r.last.num_cached_tokens == 23
    assert all(
        torch.equal(k[last * BS : (last + 1) * BS], b) for (k, _), b in zip(engine.kv.layers, k_before, strict=True)
    )
    assert r.token_ids == cold(demo, prompt, kv_block_size=BS).token_ids


@pytest.mark.parametrize("edit_at", [0, 9, 17, 27])
def test_edit_in_the_middle_reuses_only_the_blocks_before_it(demo, edit_at):
    engine = demo.engine(kv_block_size=BS)
    prompt = long_prompt(demo, 30)
    one(engine, prompt)
    edited = list(prompt)
    edited[edit_at] = (edited[edit_at] + 1) % 1000
    r = one(engine, edited)
    assert r.last.num_cached_tokens == edit_at // BS * BS
    assert r.token_ids == cold(demo, edited, kv_block_size=BS).token_ids


def test_many_sessions_under_a_small_kv_budget_evict_and_stay_correct(demo):
    """Five two-turn sessions interleaved through a cache that holds about two of them: blocks are evicted, and
    every answer equals the cold one."""
    engine = demo.engine(kv_block_size=BS, kv_cache_tokens=160, max_model_len=96)
    histories = {s: long_prompt(demo, 24 + 3 * s, salt=7 * s) for s in range(5)}
    for turn in range(2):
        for s, history in histories.items():
            r = one(engine, history, greedy(8), rid=f"{s}-{turn}")
            assert r.token_ids == cold(demo, history, greedy(8), kv_block_size=BS, max_model_len=96).token_ids, s
            histories[s] = history + r.token_ids + [11, 12, 13]
    stats = engine.scheduler.prefix_cache.stats()
    assert stats["num_evictions"] > 0
    assert stats["num_hit_tokens"] > 0
    assert_all_blocks_free(engine)


def test_concurrent_requests_share_a_prefix_being_computed(demo):
    """Four requests with one 32-token system prompt arrive together: one computes the shared blocks, the others
    wait for them and reuse them, and each answer equals its cold run."""
    system = long_prompt(demo, 32)
    prompts = [system + long_prompt(demo, 3 + i, salt=40 + 11 * i) for i in range(4)]
    engine = demo.engine(kv_block_size=BS)
    results = run(engine, {str(i): (p, greedy()) for i, p in enumerate(prompts)})
    assert [results[str(i)].last.num_cached_tokens for i in range(4)] == [0, 32, 32, 32]
    for i, p in enumerate(prompts):
        assert results[str(i)].token_ids == cold(demo, p, kv_block_size=BS).token_ids, i
    assert_all_blocks_free(engine)


def test_n_choices_share_the_prompt_blocks(demo):
    """The server runs n choices as n requests of one prompt; they share its full blocks (seeded samples too)."""
    prompt = long_prompt(demo, 26)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    engine = demo.engine(kv_block_size=BS)
    results = run(engine, {str(i): (prompt, p) for i, p in enumerate(params)})
    assert [results[str(i)].last.num_cached_tokens for i in range(3)] == [0, 24, 24]
    for i, p in enumerate(params):
        assert results[str(i)].token_ids == cold(demo, prompt, p, kv_block_size=BS).token_ids, i
    # Chunked prefill: the later choices follow the first chunk by chunk.
    engine = demo.engine(kv_block_size=BS, max_prefill_tokens=8)
    results = run(engine, {str(i): (prompt, greedy()) for i in range(3)})
    assert [results[str(i)].last.num_cached_tokens for i in range(3)] == [0, 24, 24]
    assert len({tuple(r.token_ids) for r in results.values()}) == 1


def test_preemption_under_a_tiny_kv_budget_stays_correct(demo):
    """Six requests on a shared prefix through 16 blocks of 4 tokens: sequences are preempted, recomputed on what
    the cache kept of them, and every answer equals the cold one."""
    system = long_prompt(demo, 12)
    prompts = [system + long_prompt(demo, 2 + i, salt=30 + 5 * i) for i in range(6)]
    engine = demo.engine(kv_block_size=BS, kv_cache_tokens=64)
    preempted = []
    preempt = engine.scheduler.preempt

    def counting_preempt(seq):
        preempted.append(seq)
        preempt(seq)

    engine.scheduler.preempt = counting_preempt
    results = run(engine, {str(i): (p, greedy(16)) for i, p in enumerate(prompts)})
    assert preempted, "the cache was big enough; the test proves nothing"
    for i, p in enumerate(prompts):
        assert results[str(i)].token_ids == cold(demo, p, greedy(16), kv_block_size=BS).token_ids, i
    assert_all_blocks_free(engine)


def scribble(engine: LLMEngine, step) -> None:
    """Fill the blocks that `step`'s sequences have not indexed (those the step wrote) with nonsense K/V."""
    for seq in step.seqs:
        for block in seq.block_table[seq.num_hashed_blocks :]:
            for k, v in engine.kv.layers:
                k[block * BS : (block + 1) * BS] = 1e3
                v[block * BS : (block + 1) * BS] = -1e3


def test_a_failed_step_leaves_no_block_indexed(demo):
    """A step that wrote garbage K/V and then failed: its blocks are never indexed, the request can be run again
    on the same engine, and its answer equals the cold one."""
    engine = demo.engine(kv_block_size=BS)
    prompt = long_prompt(demo, 30)
    real_run = engine.runner.run

    def failing_run(step):
        real_run(step)
        scribble(engine, step)  # as if the step had computed nonsense
        raise RuntimeError("injected")

    engine.runner.run = failing_run
    engine.add_request("bad", prompt, greedy())
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.abort("bad")
    engine.runner.run = real_run
    assert engine.scheduler.prefix_cache.num_cached_blocks == 0
    assert_all_blocks_free(engine)
    r = one(engine, prompt)
    assert r.last.num_cached_tokens == 0
    assert r.token_ids == cold(demo, prompt, kv_block_size=BS).token_ids


def test_a_failed_step_drops_the_kv_of_a_sequence_that_goes_on(demo):
    """Without the abort: the failed step's sequence starts over from its tokens (not from K/V the step may have
    left half written), so its answer still equals the cold one."""
    engine = demo.engine(kv_block_size=BS, max_prefill_tokens=8)
    prompt = long_prompt(demo, 30)
    real_run = engine.runner.run
    calls = []

    def fail_second(step):
        calls.append(1)
        out = real_run(step)
        if len(calls) == 2:
            scribble(engine, step)
            raise RuntimeError("injected")
        return out

    engine.runner.run = fail_second
    engine.add_request("x", prompt, greedy())
    engine.step()
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    seq = engine._seqs["x"]
    assert seq.num_computed == 0 and not seq.block_table and seq in engine.scheduler.waiting
    r = collect(engine, {})["x"]
    assert r.token_ids == cold(demo, prompt, kv_block_size=BS).token_ids


def test_no_prefix_cache_never_reuses(demo):
    engine = demo.engine(kv_block_size=BS, no_prefix_cache=True)
    prompt = long_prompt(demo, 30)
    one(engine, prompt)
    r = one(engine, prompt)
    assert r.last.num_cached_tokens == 0 and r.last.num_cache_write_tokens == 0
    stats = engine.scheduler.prefix_cache.stats()
    assert not stats["enabled"] and stats["num_cached_blocks"] == 0 and stats["num_hit_tokens"] == 0
    assert engine.scheduler.estimate_reuse(prompt) == (0, 0)


def test_cached_prefix_estimate(demo):
    engine = demo.engine(kv_block_size=BS)
    prompt = long_prompt(demo, 30)
    assert engine.scheduler.estimate_reuse(prompt) == (0, 28)
    r = one(engine, prompt)
    assert (r.last.num_cached_tokens, r.last.num_cache_write_tokens) == (0, 28)
    assert engine.scheduler.estimate_reuse(prompt + [5, 6, 7]) == (28, 4)
    assert engine.scheduler.estimate_reuse(prompt[:28]) == (27, 0)
    assert engine.stats()["prefix_cache"]["num_cached_blocks"] == (30 + 12 - 1) // BS  # prompt and output


def test_a_fully_cached_prompt_waits_when_its_copy_has_no_block():
    """The copy of a fully cached prompt's last block needs a block of its own; when the only one not held is the
    cached block itself, the sequence waits (it must not evict the block it copies)."""
    from freetoken.engine.kv_cache import KVCache
    from freetoken.engine.scheduler import Scheduler
    from freetoken.engine.sequence import Sequence

    kv = KVCache(1, 1, 2, num_blocks=2, block_size=BS, dtype=torch.float32, device=torch.device("cpu"))
    scheduler = Scheduler(kv, max_num_seqs=4, max_prefill_tokens=64)

    def start(tokens):
        seq = Sequence(str(tokens), list(tokens), greedy(), None, None)
        scheduler.add(seq)
        step = scheduler.schedule()
        assert step.seqs == [seq]
        seq.num_computed = len(tokens)  # as the model runner does, and the engine appends the sampled token
        scheduler.commit(step)
        seq.token_ids.append(0)
        return seq

    a = start([1, 2, 3, 4])
    cached = list(a.block_table)
    scheduler.remove(a)  # a's block: cached, nobody holds it
    c = start([7, 8, 9])  # decoding in the other block
    b = Sequence("b", [1, 2, 3, 4], greedy(), None, None)
    scheduler.add(b)
    assert scheduler.schedule().seqs == [c] and list(scheduler.waiting) == [b]
    assert scheduler.prefix_cache.match([1, 2, 3, 4]).blocks == cached
