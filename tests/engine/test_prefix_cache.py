"""The KV prefix cache's index on its own: insert, match, ref counts, LRU eviction, against a simple model.

The model (`Model` below) keys each cached block by the whole token prefix it ends (not by parent node and block
tokens as the index does), so the property test compares two formulations of the same contract.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from freetoken.engine.kv_cache import BlockAllocator
from freetoken.engine.prefix_cache import ROOT, PrefixCache

BS = 4


def cache(num_blocks: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks), BS, enabled)


def fill(pc: PrefixCache, tokens: list[int]) -> list[int]:
    """Admit `tokens` as one sequence would: share the cached prefix, allocate the rest, index every full block
    (as after the step that computed them). Returns the block table."""
    match = pc.match(tokens)
    pc.acquire(match.blocks)
    table = match.blocks + pc.allocate(-(-len(tokens) // BS) - match.num_blocks)
    parent = match.nodes[-1] if match.nodes else ROOT
    for i in range(match.num_blocks, len(tokens) // BS):
        parent = pc.insert(parent, tokens, i, table[i])
    return table


def test_match_finds_full_blocks_only():
    pc = cache()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table = fill(pc, tokens)
    assert pc.num_cached_blocks == 2
    assert pc.match(tokens).blocks == table[:2]
    assert pc.match(tokens[:9]).blocks == table[:2]
    assert pc.match(tokens[:7]).blocks == table[:1]  # a strict prefix reuses its full blocks
    assert pc.match(tokens[:3]).blocks == []
    assert pc.match(tokens + [99] * 6).blocks == table[:2]  # the partial third block was never indexed


def test_edit_in_the_middle_reuses_up_to_the_changed_block():
    pc = cache(16)
    tokens = list(range(20))
    table = fill(pc, tokens)
    edited = list(tokens)
    edited[9] = 999  # in block 2
    assert pc.match(edited).blocks == table[:2]
    # Same tokens at the same place after the edit do not match: their K/V depend on everything before them.
    assert pc.match([999] + tokens[1:]).blocks == []


def test_shared_blocks_are_ref_counted_and_never_evicted_while_held():
    pc = cache(4)
    a = fill(pc, [1, 2, 3, 4, 5, 6, 7, 8])
    b = fill(pc, [1, 2, 3, 4, 9, 9, 9, 9])
    assert b[0] == a[0] and pc.ref_count(a[0]) == 2 and b[1] != a[1]
    pc.release(a)
    assert pc.ref_count(a[0]) == 1 and pc.ref_count(a[1]) == 0
    assert pc.num_free == 1 + 1  # one never used, a's second block evictable
    got = pc.allocate(2)
    assert a[0] not in got and a[1] in got and pc.num_evictions == 1
    assert pc.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [a[0]]
    with pytest.raises(MemoryError):
        pc.allocate(1)


def two_ended(num_tokens: int) -> tuple[PrefixCache, list[int], list[int]]:
    """A cache of 4 blocks where sequence a (tokens 0, 1, ...) and then b (100, 101, ...) ran and ended."""
    pc = cache(4)
    a = fill(pc, list(range(num_tokens)))
    b = fill(pc, list(range(100, 100 + num_tokens)))
    pc.release(a)
    pc.release(b)
    return pc, a, b


def test_eviction_is_least_recently_released_tail_first():
    pc, a, b = two_ended(8)
    # a released first: its tail, then its head; b's after.
    assert pc.allocate(1) == [a[1]]
    assert pc.match(list(range(8))).blocks == [a[0]]
    assert pc.allocate(2) == [a[0], b[1]]
    assert pc.num_evictions == 3 and pc.num_cached_blocks == 1


def test_reuse_refreshes_recency():
    pc, a, b = two_ended(4)
    again = fill(pc, list(range(4)))  # a's block, taken back and released again: now the most recent
    assert again == a
    pc.release(again)
    pc.allocate(2)  # the two free blocks
    assert pc.allocate(1) == b


def test_duplicate_content_stays_private():
    pc = cache()
    tokens = list(range(8))
    t1 = pc.allocate(2)
    t2 = pc.allocate(2)
    p1 = pc.insert(ROOT, tokens, 0, t1[0])
    p2 = pc.insert(ROOT, tokens, 0, t2[0])  # computed side by side: the first one wins
    assert p1 == p2 and pc.num_cached_blocks == 1
    pc.insert(p2, tokens, 1, t2[1])  # the chain goes on under the shared node
    assert pc.match(tokens).blocks == [t1[0], t2[1]]
    pc.release(t2)
    assert pc.ref_count(t2[0]) == 0 and t2[0] in pc.allocator._free  # not indexed: back to the free list


def test_evicted_parent_orphans_its_children():
    pc = cache(3)
    tokens = list(range(8))
    a = pc.allocate(2)
    node = pc.insert(ROOT, tokens, 0, a[0])
    pc.insert(node, tokens, 1, a[1])
    b = pc.allocate(1)
    pc.insert(ROOT, tokens, 0, b[0])  # duplicate of a[0]: private
    pc.release([a[0]])  # the head alone (its holder kept the tail)
    pc.allocate(1)  # evicts a[0]
    again = pc.allocate(0)
    assert again == [] and pc.match(tokens).blocks == []
    # The same first block indexed anew is a new node: the old child never matches under it.
    pc.release(b)
    c = fill(pc, tokens[:4])
    assert pc.match(tokens).blocks == c


def test_errors():
    pc = cache(2)
    (block,) = pc.allocate(1)
    with pytest.raises(ValueError, match="neither held nor cached"):
        pc.acquire([1 - block])
    with pytest.raises(ValueError, match="not full"):
        pc.insert(ROOT, [1, 2], 0, block)
    pc.insert(ROOT, [1, 2, 3, 4], 0, block)
    with pytest.raises(ValueError, match="cannot be indexed"):
        pc.insert(ROOT, [1, 2, 3, 4], 0, block)
    pc.release([block])
    with pytest.raises(ValueError, match="released more often"):
        pc.release([block])


def test_disabled_never_matches_nor_indexes():
    pc = cache(enabled=False)
    table = fill(pc, list(range(8)))
    assert pc.num_cached_blocks == 0 and pc.match(list(range(8))).blocks == []
    pc.release(table)
    assert pc.allocator.num_free == 8


def test_stats():
    pc = cache(4)
    fill(pc, list(range(8)))
    pc.count_lookup(10, 8)
    s = pc.stats()
    assert s["num_lookups"] == 1 and s["num_hit_tokens"] == 8 and s["num_lookup_tokens"] == 10
    assert s["num_cached_blocks"] == 2 and s["capacity_tokens"] == 16 and s["num_evictable_blocks"] == 0


class Model:
    """The contract, written another way: a cached block is named by the whole token prefix it ends and the entry
    it was indexed under; an entry is reachable only through the entry it was indexed under."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = dict.fromkeys(range(num_blocks), 0)
        self.free = set(range(num_blocks))
        self.lru: list[int] = []  # cached blocks nobody holds, least recent first
        self.entries: dict[int, tuple[tuple[int, ...], int, int]] = {}  # block -> (prefix, parent entry, entry)
        self.next_entry = 1

    def match(self, tokens: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(len(tokens) // BS):
            prefix = tuple(tokens[: (i + 1) * BS])
            hit = [(b, e) for b, (p, pe, e) in self.entries.items() if p == prefix and pe == parent]
            if not hit:
                break
            out.append(hit[0][0])
            parent = hit[0][1]
        return out

    def insert(self, parent: int, tokens: list[int], i: int, block: int) -> int:
        prefix = tuple(tokens[: (i + 1) * BS])
        for p, pe, e in self.entries.values():
            if p == prefix and pe == parent:
                return e
        entry = self.next_entry
        self.next_entry += 1
        self.entries[block] = (prefix, parent, entry)
        return entry


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions, decode appends and releases of sequences over a small alphabet (prefixes collide)."""

    NUM_BLOCKS = 6

    def __init__(self) -> None:
        super().__init__()
        self.pc = cache(self.NUM_BLOCKS)
        self.model = Model(self.NUM_BLOCKS)
        self.seqs: list[dict] = []  # tokens, table, hashed blocks, parent node (index) and parent entry (model)

    def _allocate(self, n: int) -> list[int]:
        expected_evicted = self.model.lru[: max(0, n - len(self.model.free))]
        got = self.pc.allocate(n)
        assert len(set(got)) == n
        fresh = [b for b in got if b in self.model.free]
        assert len(fresh) == min(n, len(self.model.free))
        assert [b for b in got if b not in self.model.free] == expected_evicted
        for b in fresh:
            self.model.free.discard(b)
        for b in expected_evicted:
            self.model.lru.remove(b)
            del self.model.entries[b]
        for b in got:
            assert self.model.refs[b] == 0
            self.model.refs[b] = 1
        return got

    def _commit(self, seq: dict) -> None:
        while (seq["hashed"] + 1) * BS <= len(seq["tokens"]):
            i = seq["hashed"]
            seq["node"] = self.pc.insert(seq["node"], seq["tokens"], i, seq["table"][i])
            seq["entry"] = self.model.insert(seq["entry"], seq["tokens"], i, seq["table"][i])
            seq["hashed"] += 1

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens):
        match = self.pc.match(tokens)
        expected = self.model.match(tokens)
        assert match.blocks == expected
        for i, b in enumerate(match.blocks):  # soundness: what matched holds exactly these tokens
            assert self.model.entries[b][0] == tuple(tokens[: (i + 1) * BS])
        need = -(-len(tokens) // BS) - match.num_blocks
        self.pc.acquire(match.blocks)
        for b in match.blocks:
            if self.model.refs[b] == 0:
                self.model.lru.remove(b)
            self.model.refs[b] += 1
        if need > self.pc.num_free:
            self._release(match.blocks)
            return
        table = match.blocks + self._allocate(need)
        seq = {
            "tokens": list(tokens),
            "table": table,
            "hashed": match.num_blocks,
            "node": match.nodes[-1] if match.nodes else ROOT,
            "entry": self.model.entries[match.blocks[-1]][2] if match.blocks else 0,
        }
        self._commit(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, index, more):
        seq = self.seqs[index % len(self.seqs)]
        need = -(-(len(seq["tokens"]) + len(more)) // BS) - len(seq["table"])
        if need > self.pc.num_free:
            return
        seq["tokens"] += more
        seq["table"] += self._allocate(need)
        self._commit(seq)

    def _release(self, table: list[int]) -> None:
        self.pc.release(table)
        for b in reversed(table):
            self.model.refs[b] -= 1
            if self.model.refs[b] == 0:
                if b in self.model.entries:
                    self.model.lru.append(b)
                else:
                    self.model.free.add(b)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self._release(self.seqs.pop(index % len(self.seqs))["table"])

    @invariant()
    def agrees(self):
        assert all(self.pc.ref_count(b) == r for b, r in self.model.refs.items())
        assert list(self.pc._evictable) == self.model.lru
        assert self.pc.num_free == len(self.model.free) + len(self.model.lru)
        assert self.pc.num_cached_blocks == len(self.model.entries)
        held = sorted(b for s in self.seqs for b in s["table"])
        assert sorted(set(held)) == sorted(b for b, r in self.model.refs.items() if r > 0)


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCacheAgainstModel = PrefixCacheMachine.TestCase
