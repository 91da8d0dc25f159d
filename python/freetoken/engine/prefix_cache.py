"""The KV prefix cache: which blocks of the paged KV cache hold the K/V of which token prefix, and their lifetime.

Agent harnesses resend the whole conversation every turn, so a new prompt mostly starts with a prompt the engine
has already run. This module lets a new sequence start from the KV blocks an earlier one computed instead of
prefilling them again (vLLM's automatic prefix caching; SGLang's RadixAttention shares prefixes the same way).

The index. A *full* block (block_size tokens) is keyed by `(parent node, its token ids)`, where the parent node
names the content of every block before it (`ROOT` for the first block of a sequence). A block's K/V depend on
exactly its tokens, their positions and all earlier tokens; the chain of keys from `ROOT` fixes all three, so
equal keys mean equal K/V (for the one model and dtype this process serves: the index lives and dies with its
KV tensors, and a restart with other flags, `--max-model-len` included, starts empty). Looking a prompt up walks
its full blocks from the start, one dict lookup per block, and stops at the first block not found, so a prompt
edited in the middle reuses exactly the blocks before the first one that changed.

Why a chain of exact keys rather than vLLM's chain of hash digests or SGLang's token radix tree:
- the key holds the block's token ids themselves, so a hash collision (a crafted prompt, say) can never map a
  prompt onto another prompt's K/V: Python's dict compares keys by equality after hashing;
- a node id is a counter value never reused (a block id is reused), so a key whose parent content was evicted
  can never be matched again: it is only waste until the LRU order reaches it;
- the KV cache is paged by blocks, and only whole blocks can be shared without copying, so a tree over single
  tokens (SGLang's radix tree, built for a token-granular pool) would buy nothing here; the dict is O(1) per
  block and needs no tree surgery on eviction.

Lifetime. Every block has a reference count: the sequences whose block tables hold it. A block nobody holds
either returns to the allocator's free list (it holds nothing reusable) or, when it is in the index, stays cached
in an LRU list; `allocate` takes free blocks first, then evicts cached ones least recently released first.
Sequences release their blocks last block first, so a chain's tail is evicted before its head (a head is never
evicted while a descendant that could still match is cached, except a descendant of a duplicate, see `insert`).
The cache therefore only ever uses blocks of the KV budget that no running sequence needs.

Host tier (`--kv-host-gb`, `freetoken.engine.kv_host`). With one, `allocate` demotes an evicted block instead of
dropping it: its K/V are copied to a host slot and its index entry moves there, node and key unchanged; a `match`
runs on through host entries, and `promote` brings them back into GPU blocks before a sequence shares them (when
the copy beats prefilling them again, `kv_host.CopyCost`). A host entry whose content a sequence computed again is
re-pointed at that block by `insert`. `on_evict` fires when a node leaves the last tier that holds it.

Who calls what (the scheduler, at its safe points between steps):
- admission: `match` the sequence's tokens, `acquire` the blocks it will share, `allocate` the rest;
- after a step completed: `insert` every block that the step filled, so only K/V actually written by a finished
  step is ever indexed (a failed, aborted or preempted step leaves nothing indexed it did not finish);
- when a sequence ends or is preempted: `release` its blocks.
Sequences never write into a block they share: a prompt that is entirely cached recomputes its last position
into a private copy of its last block (`Scheduler` does the copy), and decode appends into private blocks.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from freetoken.engine.kv_cache import BlockAllocator
from freetoken.engine.kv_host import HostKVTier

# Node id of the empty prefix: the parent of every sequence's first block.
ROOT = 0

BlockKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks that hold a token sequence's longest cached prefix of full blocks.

    Attributes:
        blocks: KV block ids, in order (block i holds tokens [i * block_size, (i + 1) * block_size)); -1 where the
            block is in the host tier.
        nodes: the index node of each block (the parent key of the block after it).
        host: {i: host slot} of the blocks in the host tier (`PrefixCache.promote` brings them back).
    """

    blocks: list[int]
    nodes: list[int]
    host: dict[int, int] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        """KV blocks the match covers (in either tier)."""
        return len(self.blocks)

    def truncate(self, num_blocks: int) -> PrefixMatch:
        """The match of its first `num_blocks` blocks."""
        host = {i: slot for i, slot in self.host.items() if i < num_blocks}
        return PrefixMatch(self.blocks[:num_blocks], self.nodes[:num_blocks], host)


class PrefixCache:
    """Content index, reference counts and LRU eviction of the KV cache's blocks.

    Args:
        allocator: the KV cache's free list; this class takes blocks from it and gives back the blocks that hold
            nothing reusable.
        block_size: tokens per block.
        enabled: False (`--no-prefix-cache`) keeps the reference counts and the allocation path but never
            matches nor indexes a block.
        host: the host tier evicted blocks go to (`freetoken.engine.kv_host`), None for none.
    """

    def __init__(
        self, allocator: BlockAllocator, block_size: int, enabled: bool = True, host: HostKVTier | None = None
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.host = host if enabled else None
        self._host_index: dict[BlockKey, tuple[int, int]] = {}  # key -> (node id, host slot)
        self._host_key_of: dict[int, BlockKey] = {}  # host slot -> its key
        self._refs = [0] * allocator.num_blocks
        self._index: dict[BlockKey, tuple[int, int]] = {}  # key -> (node id, block)
        self._key_of: dict[int, BlockKey] = {}  # block -> its key, for the blocks in the index
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed blocks nobody holds, least recent first
        self._nodes = itertools.count(ROOT + 1)
        self.num_lookups = 0
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        # Called with the node of each block evicted from the last tier holding it: state checkpoints
        # (`freetoken.engine.state_checkpoints`) drop the snapshots that extend it, whose KV is gone.
        self.on_evict: Callable[[int], None] | None = None

    @property
    def capacity_tokens(self) -> int:
        """Most tokens the cache can hold: every block of the KV cache, when no sequence holds any."""
        return self.allocator.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: free ones and cached ones nobody holds."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the index (held by a sequence or not)."""
        return len(self._key_of)

    def ref_count(self, block: int) -> int:
        """Sequences holding `block`."""
        return self._refs[block]

    def key(self, parent: int, tokens: Sequence[int], index: int) -> BlockKey:
        """The key of full block `index` of `tokens` (its token ids [index * block_size, ...)) under `parent`."""
        start = index * self.block_size
        return parent, tuple(tokens[start : start + self.block_size])

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The cached blocks of the longest prefix of `tokens` made of full blocks, in either tier; nothing changes
        (the caller `promote`s and `acquire`s what it uses, and counts the lookup with `count_lookup`). Empty when
        disabled."""
        blocks: list[int] = []
        nodes: list[int] = []
        host: dict[int, int] = {}
        if not self.enabled:
            return PrefixMatch(blocks, nodes)
        parent = ROOT
        for i in range(len(tokens) // self.block_size):
            key = self.key(parent, tokens, i)
            found = self._index.get(key)
            if found is None:
                found = self._host_index.get(key)
                if found is None:
                    break
                host[i] = found[1]
                found = (found[0], -1)
            parent, block = found
            nodes.append(parent)
            blocks.append(block)
        return PrefixMatch(blocks, nodes, host)

    def promote(self, match: PrefixMatch, partial_ok: bool = True) -> PrefixMatch | None:
        """`match` with its host-tier blocks brought back into GPU blocks (copies queued on the tier's stream, ahead
        of the compute stream's next work, `HostKVTier`); the blocks end up cached and unheld, for the
        caller to `acquire` at once.

        With `partial_ok`, a match whose host tokens are below the crossover (`kv_host.CopyCost`), or whose host
        blocks the GPU has no room for, is cut before its first host block (the rest is prefilled again, and
        `insert` re-points the host entries at the recomputed blocks); without it (a hybrid model resuming from a
        snapshot, which needs every block before it) host blocks are always promoted, and None is returned when
        the GPU has no room.
        """
        if not match.host:
            return match
        host = self.host
        assert host is not None  # host entries exist only with a tier
        first = min(match.host)
        if partial_ok and not host.cost.worth_promoting(len(match.host) * self.block_size):
            host.num_skipped_tokens += len(match.host) * self.block_size
            return match.truncate(first)
        on_gpu = [b for i, b in enumerate(match.blocks) if i not in match.host]
        if len(match.host) > self.num_free - sum(1 for b in on_gpu if self._refs[b] == 0):
            return match.truncate(first) if partial_ok else None
        self.acquire(on_gpu)  # so that the allocation below cannot evict them
        for slot in match.host.values():
            host.hold(slot)  # nor the host tier's evictions the slots being read
        new = sorted(self.allocate(len(match.host)))
        blocks = list(match.blocks)
        pairs = []
        for (slot, i), block in zip(sorted((slot, i) for i, slot in match.host.items()), new, strict=True):
            key = self._host_key_of.pop(slot)
            node, _ = self._host_index.pop(key)
            self._index[key] = (node, block)
            self._key_of[block] = key
            blocks[i] = block
            pairs.append((slot, block))
        host.promote(pairs)
        for slot, _ in pairs:
            host.give(slot)
        self.release(blocks)
        return PrefixMatch(blocks, list(match.nodes))

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup: `num_tokens` looked up, `num_hit_tokens` of them reused."""
        self.num_lookups += 1
        self.num_lookup_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of `blocks` (cached blocks a sequence starts sharing); a cached block
        nobody held stops being evictable."""
        for block in blocks:
            if self._refs[block] == 0:
                if block not in self._evictable:
                    raise ValueError(f"KV block {block} is neither held nor cached; it cannot be shared")
                del self._evictable[block]
            self._refs[block] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one sequence (one reference each): free blocks first, then cached blocks nobody holds,
        least recently released first (they leave the index).

        Raises:
            MemoryError: fewer than `n` blocks are free or evictable (callers check `num_free` first).
        """
        if n > self.num_free:
            raise MemoryError(f"KV cache: {n} blocks asked, {self.num_free} free or evictable")
        fresh = min(n, self.allocator.num_free)
        blocks = self.allocator.allocate(fresh)
        evicted = [self._evictable.popitem(last=False)[0] for _ in range(n - fresh)]
        self._evict(evicted)
        blocks += evicted
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def _evict(self, blocks: list[int]) -> None:
        """Take unheld cached blocks out of the GPU index, in eviction order: into host slots (the tier's least
        recently used ones evicted when none is free) and their copies queued; or, without a tier or a slot, out
        of the cache. The blocks, sorted, get the slots, sorted, so that a run of blocks is copied as one; the
        tier's LRU order is the eviction order (a chain's tail leaves the host tier before its head)."""
        host = self.host
        entries = []
        for block in blocks:
            key = self._key_of.pop(block)
            entries.append((block, key, self._index.pop(key)[0]))
            self.num_evictions += 1
        pending: dict[int, tuple[int, BlockKey, int]] = {}  # slot taken -> (block, key, node), in eviction order
        for entry in entries:
            ready = host is not None and host.free_slot_ready()  # may add a chunk of host memory
            if host is not None and (ready or host.num_live):
                if not ready:
                    slot = host.evict_lru()
                    if slot in pending:  # a tier smaller than this batch: an earlier block of it leaves again
                        self._forget(pending.pop(slot)[2])
                    else:
                        self._drop_host(slot)
                pending[host.take()] = entry
            else:
                self._forget(entry[2])
        if not pending:
            return
        slot_of = dict(zip(sorted(block for block, _, _ in pending.values()), sorted(pending), strict=True))
        for block, key, node in pending.values():
            slot = slot_of[block]
            self._host_index[key] = (node, slot)
            self._host_key_of[slot] = key
            host.touch(slot)  # type: ignore[union-attr]  # slots only with a tier
        host.demote(sorted(slot_of.items()))  # type: ignore[union-attr]

    def _forget(self, node: int) -> None:
        if self.on_evict is not None:
            self.on_evict(node)

    def _drop_host(self, slot: int) -> None:
        self._forget(self._host_index.pop(self._host_key_of.pop(slot))[0])

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks` (one sequence's block table, in order). Blocks nobody holds
        any more stay cached when indexed (the table's tail becomes evictable before its head), else go back to
        the free list."""
        freed = []
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise ValueError(f"KV block {block} released more often than it was held")
            self._refs[block] = refs
            if refs == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    freed.append(block)
        if freed:
            self.allocator.free(freed[::-1])

    def insert(self, parent: int, tokens: Sequence[int], index: int, block: int) -> int:
        """Index `block`, whose K/V a finished step wrote for full block `index` of `tokens` under `parent`.

        Returns the node of that content, the parent of the next block. When the same content is already cached
        in another block (two sequences computed it side by side), that block's node is returned and `block` stays
        out of the index (private to its sequence, freed with it). Disabled, nothing is indexed and `ROOT` is
        returned.

        Raises:
            ValueError: `block` is not held by a sequence, or is already indexed.
        """
        if not self.enabled:
            return ROOT
        if self._refs[block] < 1 or block in self._key_of:
            raise ValueError(f"KV block {block} cannot be indexed: it is not a held, unindexed block")
        key = self.key(parent, tokens, index)
        if len(key[1]) != self.block_size:
            raise ValueError(f"block {index} of {len(tokens)} tokens is not full")
        found = self._index.get(key)
        if found is not None:
            return found[0]
        found = self._host_index.get(key)
        if found is not None:  # computed again below the crossover: the GPU block replaces the host copy
            node, slot = self._host_index.pop(key)
            del self._host_key_of[slot]
            self.host.give(slot)  # type: ignore[union-attr]  # host entries exist only with a tier
            self._index[key] = (node, block)
            self._key_of[block] = key
            return node
        node = next(self._nodes)
        self._index[key] = (node, block)
        self._key_of[block] = key
        return node

    def keep_on_resize(self, num_blocks: int) -> list[int]:
        """The blocks a KV cache resized to `num_blocks` keeps, in their new order: every block a sequence holds,
        then the cached blocks nobody holds, most recently released first (the heads of chains before their
        tails, as `release` orders them), as many as fit.

        Raises:
            ValueError: the held blocks alone do not fit.
        """
        held = [b for b, refs in enumerate(self._refs) if refs > 0]
        if len(held) > num_blocks:
            raise ValueError(f"running requests hold {len(held)} KV blocks; {num_blocks} cannot keep them")
        cached = list(reversed(self._evictable))[: num_blocks - len(held)]
        return held + cached

    def spill(self, keep: Sequence[int]) -> None:
        """Before a resize adopts `keep` (`keep_on_resize`, the old KV tensors still in place): demote the cached
        blocks it leaves out into the host tier, so a shrink keeps them (no-op without a tier)."""
        if self.host is None:
            return
        kept = set(keep)
        dropped = [b for b in self._evictable if b not in kept]
        for block in dropped:
            del self._evictable[block]
        self._evict(dropped)

    def remap(self, keep: Sequence[int]) -> dict[int, int]:
        """Follow a resized KV cache (`KVCache.adopt`) whose block i is old block `keep[i]`: reference counts,
        index and LRU order move to the new ids; cached blocks left out leave the index (counted as evictions, and
        `on_evict` called; `spill` first moves them to the host tier, whose entries stay as they are).
        Call it after `KVCache.adopt`, which resets the allocator to the new size. Returns {old id: new id} for the
        block tables."""
        new_of = {old: new for new, old in enumerate(keep)}
        refs = [0] * self.allocator.num_blocks
        for old, new in new_of.items():
            refs[new] = self._refs[old]
        self._refs = refs
        for block in [b for b in self._key_of if b not in new_of]:
            self._forget(self._index.pop(self._key_of.pop(block))[0])
            self.num_evictions += 1
        self._index = {key: (node, new_of[block]) for key, (node, block) in self._index.items()}
        self._key_of = {new_of[block]: key for block, key in self._key_of.items()}
        self._evictable = OrderedDict((new_of[b], None) for b in self._evictable if b in new_of)
        return new_of

    def stats(self) -> dict:
        """Counters (JSON-able): lookups, tokens looked up and reused, evictions, blocks cached and evictable,
        and the capacity in tokens."""
        return {
            "enabled": self.enabled,
            "num_lookups": self.num_lookups,
            "num_lookup_tokens": self.num_lookup_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0,
            "num_evictions": self.num_evictions,
            "num_cached_blocks": self.num_cached_blocks,
            "num_evictable_blocks": len(self._evictable),
            "capacity_tokens": self.capacity_tokens,
        }
