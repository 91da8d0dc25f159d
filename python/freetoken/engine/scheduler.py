"""Continuous batching with chunked prefill over the paged KV cache.

Each step takes a token budget (`max_prefill_tokens`). Running sequences that are decoding go first, one token
each, so a long prompt never stalls them; the rest of the budget goes to prompt chunks, of sequences already
admitted and then of waiting ones, up to `max_num_seqs` running and, per request, its share of them
(`freetoken.engine.admission`); prompts being prefilled leave room for waiting ones short enough to finish in the
step, so a short request is not queued behind a long prompt (`_short_arrivals`). When the KV cache cannot give a
decoding sequence its next block, the most recently arrived running sequence is preempted: its blocks are freed
and it is recomputed from its tokens later (vLLM's recompute preemption).

A waiting sequence is admitted on the longest prefix of its tokens that the prefix cache holds
(`freetoken.engine.prefix_cache`): it shares those blocks and prefills only the rest (a sequence that asks for its
prompt's log-probabilities prefills all of it: those need every position's logits). After each finished step,
`commit` indexes the blocks the step filled.

Hybrid models (a recurrent-state pool) resume only from a recurrent-state snapshot
(`freetoken.engine.state_checkpoints`): a waiting sequence is admitted at the deepest snapshot of its prefix, on the
cached blocks before it (never more of the prefix cache's match), with the snapshot's state in its slot; without
checkpoints (`--state-checkpoints off`) the prefix cache is off for them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from freetoken.engine.admission import Admission
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.kv_host import HostKVTier
from freetoken.engine.prefix_cache import ROOT, BlockKey, PrefixCache, PrefixMatch
from freetoken.engine.sequence import Sequence
from freetoken.engine.state_checkpoints import Snapshot, StateCheckpoints, StepCaptures
from freetoken.engine.state_pool import RecurrentStatePool


@dataclass
class ScheduledStep:
    """What one step runs: sequences in order, and how many of each one's uncomputed tokens."""

    seqs: list[Sequence]
    query_lens: list[int]
    # Recurrent-state snapshots the step takes (hybrid models with checkpoints), None when none.
    captures: StepCaptures | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes, over all its sequences."""
        return sum(self.query_lens)


class Scheduler:
    """Owns the waiting queue and the running set, and the KV blocks of both (through the prefix cache).

    Args:
        kv: the KV cache (its allocator and block size; `copy_block` for a fully cached prompt).
        max_num_seqs: most running sequences.
        max_prefill_tokens: the token budget of one step.
        prefix_cache: reuse the K/V of cached prompt prefixes (`--no-prefix-cache` turns it off).
        admission: the per-request share of the batch (`freetoken.engine.admission`); by default a request's
            choices may use the whole batch.
        state_pool: hybrid models' recurrent-state pool: each running sequence holds a slot, taken at admission and
            given back with its blocks. K/V alone cannot resume a sequence whose linear layers compress the prefix
            into a state: the prefix cache serves it only through `checkpoints`, and is off without them.
        checkpoints: recurrent-state snapshots of hybrid models (`freetoken.engine.state_checkpoints`).
        kv_host: the prefix cache's host-RAM tier (`freetoken.engine.kv_host`), None for none.
    """

    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_prefill_tokens: int,
        prefix_cache: bool = True,
        admission: Admission | None = None,
        state_pool: RecurrentStatePool | None = None,
        checkpoints: StateCheckpoints | None = None,
        kv_host: HostKVTier | None = None,
    ) -> None:
        self.kv = kv
        self.state_pool = state_pool
        self.checkpoints = checkpoints if state_pool is not None and prefix_cache else None
        self.prefix_cache = PrefixCache(
            kv.allocator,
            kv.block_size,
            enabled=prefix_cache and (state_pool is None or self.checkpoints is not None),
            host=kv_host,
        )
        if self.checkpoints is not None:
            self.prefix_cache.on_evict = self.checkpoints.on_evict
        self.max_num_seqs = max_num_seqs
        self.admission = admission or Admission(max_num_seqs)
        self.max_prefill_tokens = max(1, max_prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences whose client stopped reading (`pause`): they keep their KV blocks, not their batch slot.
        self.paused: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind the waiting sequences."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether a sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks (the indexed ones stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.paused:
            self.paused.remove(seq)
        self._free(seq)

    # Backpressure: a running sequence is paused while its client does not read its output. It is out of the
    # batch (no steps, no batch slot) but keeps its KV blocks and computed tokens, so resuming costs nothing.

    def pause(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch, keeping its KV blocks (no-op when it is not running)."""
        if seq in self.running:
            self.running.remove(seq)
            self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        """Put a paused sequence back: into the batch when it has a free slot, else first in the waiting queue."""
        if seq not in self.paused:
            return
        self.paused.remove(seq)
        if len(self.running) < self.max_num_seqs:
            self.running.append(seq)
        else:
            self.waiting.appendleft(seq)

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's blocks and queue it first, to be recomputed from its tokens (reusing what
        the prefix cache still holds of them). Also how the engine drops the K/V a failed step may have left."""
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
            self.waiting.appendleft(seq)

    def commit(self, step: ScheduledStep) -> None:
        """Index the full blocks that `step`, now finished, wrote (call it only after the step ran to the end).

        Each sequence's blocks are indexed in order, each under the node of the block before it; a block whose
        content is already cached elsewhere stays private (`PrefixCache.insert`).
        """
        if not self.prefix_cache.enabled:
            return
        bs = self.kv.block_size
        for seq in step.seqs:
            while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed:
                i = seq.num_hashed_blocks
                seq.kv_parent = self.prefix_cache.insert(seq.kv_parent, seq.token_ids, i, seq.block_table[i])
                seq.kv_nodes.append(seq.kv_parent)
                seq.num_hashed_blocks = i + 1
        if self.checkpoints is not None:
            self.checkpoints.commit(
                step.seqs, step.query_lens, step.captures, lambda seq, b: seq.kv_nodes[b - 1] if b else ROOT
            )

    def abandon(self, step: ScheduledStep) -> None:
        """`step` failed: drop the snapshots it was taking (their states were never finished)."""
        if self.checkpoints is not None:
            self.checkpoints.discard(step.captures)

    def _free(self, seq: Sequence) -> None:
        self.prefix_cache.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.kv_parent = ROOT
        seq.kv_nodes = []
        if self.checkpoints is not None:
            self.checkpoints.forget(seq)
        if seq.state_slot >= 0:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = -1

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` more tokens; False when the cache has too few free or evictable."""
        need = self.kv.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)
        if need > self.prefix_cache.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.prefix_cache.allocate(need))
        return True

    def _preempt_last(self) -> Sequence | None:
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.preempt(victim)
        return victim

    def _next_block_key(self, seq: Sequence) -> BlockKey | None:
        """The key of the full prompt block a prefilling sequence computes next, or None when it has none left."""
        b = seq.num_hashed_blocks
        if (
            not self.prefix_cache.enabled
            or seq.num_computed >= seq.prompt_len
            or (b + 1) * self.kv.block_size > seq.prompt_len
        ):
            return None
        return self.prefix_cache.key(seq.kv_parent, seq.token_ids, b)

    def _resume_point(self, tokens: list[int]) -> tuple[PrefixMatch, Snapshot | None]:
        """Where a prompt would start: the cached blocks it shares and, for a hybrid model, the snapshot it
        resumes from (the deepest one of its prefix; the blocks then stop at the snapshot's last full block)."""
        match = self.prefix_cache.match(tokens)
        if self.state_pool is None:
            return match, None
        snap = self.checkpoints.find(tokens, match.nodes) if self.checkpoints is not None else None
        b = snap.position // self.kv.block_size if snap is not None else 0
        return match.truncate(b), snap

    def _admit(self, seq: Sequence, match: PrefixMatch, budget: int, snap: Snapshot | None = None) -> int:
        """Start `seq` on the cached blocks of `match` and give it blocks for its first chunk; a hybrid model's
        sequence also takes its state slot, restored from `snap` when given (`_resume_point`).

        Every token of a sequence that is cached entirely, up to its last, is reused but that last one: the
        logits of the next token must come from this sequence. Its last block is shared, and a sequence never
        writes into a shared block, so it gets a private copy of that block and recomputes the last position.
        A snapshot's partial last block is a private block its tail K/V is copied into.

        Cached blocks in the host tier are brought back first (`PrefixCache.promote`): all of them for a hybrid
        model's snapshot, else when copying beats prefilling them again.

        Returns the first chunk's length, or 0 (nothing held) when the KV cache has too few blocks.
        """
        bs = self.kv.block_size
        promoted = self.prefix_cache.promote(match, partial_ok=snap is None)
        if promoted is None:
            return 0
        match = promoted
        num_tokens = len(seq.token_ids)
        shared = match.blocks
        copy_src = None
        if match.num_blocks * bs == num_tokens:
            copy_src, shared = shared[-1], shared[:-1]
        self.prefix_cache.acquire(shared)
        seq.block_table = list(shared)
        seq.num_hashed_blocks = len(shared)
        seq.num_computed = snap.position if snap is not None else len(shared) * bs
        seq.kv_nodes = list(match.nodes[: len(shared)])
        seq.kv_parent = seq.kv_nodes[-1] if shared else ROOT
        if copy_src is not None:
            self.prefix_cache.acquire([copy_src])  # so that the allocation cannot evict it
            if self.prefix_cache.num_free < 1:
                self.prefix_cache.release([copy_src])
                self._free(seq)
                return 0
            copy = self.prefix_cache.allocate(1)[0]
            self.kv.copy_block(copy_src, copy)
            self.prefix_cache.release([copy_src])
            seq.block_table.append(copy)
            seq.num_computed = num_tokens - 1
        chunk = min(seq.num_uncomputed, budget)
        if not self._grow(seq, chunk):
            self._free(seq)
            return 0
        if self.state_pool is not None:
            if seq.num_computed and snap is None:  # a bug upstream: reused K/V would meet a zero state
                self._free(seq)
                raise RuntimeError(
                    f"request {seq.request_id}: admitted on {seq.num_computed} cached tokens without a "
                    "recurrent-state snapshot; a hybrid model may skip prefill only from a snapshot"
                )
            seq.state_slot = self.state_pool.allocate()
            if snap is not None:
                tail = seq.block_table[len(shared)] if snap.position % bs else None
                self.checkpoints.restore(snap, seq.state_slot, tail)
            if self.checkpoints is not None:
                self.checkpoints.admitted(seq)
        self.prefix_cache.count_lookup(num_tokens, seq.num_computed)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens, seq.num_cache_write_tokens = self._reuse(seq.prompt_len, match, snap)
        return chunk

    def _reuse(self, num_tokens: int, match: PrefixMatch, snap: Snapshot | None = None) -> tuple[int, int]:
        """(tokens reused, tokens it adds to the cache) of a prompt of `num_tokens` admitted on `match` (and, on a
        hybrid model, `snap`): the matched tokens but the last when all match, or the snapshot's position; and the
        prompt's other full blocks."""
        bs = self.kv.block_size
        matched = match.num_blocks * bs
        if snap is not None:
            reused = snap.position
        else:
            reused = num_tokens - 1 if matched == num_tokens else matched
        written = (num_tokens // bs) * bs - matched if self.prefix_cache.enabled else 0
        return reused, written

    def estimate_reuse(self, prompt_ids: list[int]) -> tuple[int, int]:
        """What a request of `prompt_ids` admitted now would report: (tokens reused, tokens added to the cache).

        Read-only, so the event loop may call it while the engine thread steps (each dict read is atomic under
        the GIL): the engine may index or evict blocks before the request is admitted, so it is an estimate, and
        `Sequence.num_cached_tokens` has the count at admission.
        """
        try:
            return self._reuse(len(prompt_ids), *self._resume_point(prompt_ids))
        except RuntimeError:  # the engine thread changed the snapshot index while this read it: say none
            return 0, 0

    def schedule(self) -> ScheduledStep:
        """Pick the next step's work. Returns an empty step only when there is no work.

        When running prompts hold blocks but none can grow, the newest is preempted until one can.
        """
        step = self._schedule_once()
        while not step.seqs and self.running:
            self._preempt_last()
            step = self._schedule_once()
        return step

    def _short_arrivals(self, budget: int, share: int) -> int:
        """Tokens of this step's `budget` that running prefills leave to waiting sequences short enough to finish
        their prompt in it (at most half the budget in all).

        A long prompt would otherwise take the whole budget step after step, and a request arriving behind it (a
        subagent's turn, a probe) would wait for all of it: a 2-token request waited 86 s behind a 58k-token
        prompt on the CPU device. A step of an offloaded MoE costs about the same with a chunk a little shorter
        (streaming its experts dominates it), so the long prompt loses little; a waiting prompt as long as it is
        gets nothing, as sharing the budget between two long prompts would only delay the first. What a waiting
        prompt needs is estimated from the prefix cache (`estimate_reuse`): an agent's next turn is mostly cached.
        """
        room = self.max_num_seqs - len(self.running)
        if self.state_pool is not None:  # a hybrid model's sequence also needs a free recurrent-state slot
            room = min(room, self.state_pool.num_free)
        reserve, limit = 0, budget // 2
        # The first of the queue only, as admission takes them in order: a step looks up at most this many prompts.
        for seq in itertools.islice(self.waiting, self.max_num_seqs):
            if room <= 0 or reserve >= limit:
                break
            if not self.admission.admissible(seq, self.running, share):
                continue
            need = len(seq.token_ids)
            if need > limit - reserve and not seq.wants_prompt_logprobs:  # only a long prompt needs the lookup
                need -= self.estimate_reuse(seq.token_ids)[0]
            if need <= limit - reserve:
                reserve += need
                room -= 1
        return reserve

    def _schedule_once(self) -> ScheduledStep:
        budget = self.max_prefill_tokens
        step = ScheduledStep([], [])
        # Fair admission (`freetoken.engine.admission`): with the batch full while a request waits within its
        # share, one sequence of the group furthest over its share makes room (recomputed later).
        share = self.admission.fair_share(self.waiting, self.running, self.max_num_seqs)
        if self.waiting and len(self.running) >= self.max_num_seqs:
            victim = self.admission.victim(self.waiting, self.running, share)
            if victim is not None:
                self.preempt(victim)
        decoding = sorted((s for s in self.running if s.num_uncomputed == 1), key=lambda s: s.arrival)
        for seq in decoding:
            if seq not in self.running:
                continue  # preempted below to make room for an older sequence
            while not self._grow(seq, 1):
                victim = self._preempt_last()
                if victim is seq or victim is None:
                    break
            if seq in self.running and budget > 0:
                step.seqs.append(seq)
                step.query_lens.append(1)
                budget -= 1
        prefilling = [s for s in self.running if s.num_uncomputed > 1 and s not in step.seqs]
        reserve = self._short_arrivals(budget, share) if prefilling else 0
        for seq in prefilling:
            if budget - reserve <= 0:
                break
            chunk = min(seq.num_uncomputed, budget - reserve)
            if self._grow(seq, chunk):
                step.seqs.append(seq)
                step.query_lens.append(chunk)
                budget -= chunk
        # Prompt blocks that running sequences are computing now: a waiting sequence whose next block is one of
        # them waits until that block is indexed and then shares it (n > 1 choices, concurrent requests with one
        # system prompt) instead of computing the same K/V beside it.
        in_flight = {key for key in map(self._next_block_key, self.running) if key is not None}
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if not self.admission.admissible(seq, self.running, share):  # its request runs its share: pass over
                i += 1
                continue
            if self.state_pool is not None and not self.state_pool.num_free:
                break  # paused sequences keep their state slots (as their KV blocks): none left for a new one
            snap = None
            if seq.wants_prompt_logprobs:  # every prompt position's logits are needed: no K/V is reused
                match = PrefixMatch([], [])
            else:
                match = self.prefix_cache.match(seq.token_ids)
                if in_flight and (match.num_blocks + 1) * self.kv.block_size <= len(seq.token_ids):
                    parent = match.nodes[-1] if match.nodes else ROOT
                    if self.prefix_cache.key(parent, seq.token_ids, match.num_blocks) in in_flight:
                        i += 1
                        continue
                if self.state_pool is not None:
                    match, snap = self._resume_point(seq.token_ids)
            chunk = self._admit(seq, match, budget, snap)
            if not chunk:
                break
            del self.waiting[i]
            self.running.append(seq)
            step.seqs.append(seq)
            step.query_lens.append(chunk)
            budget -= chunk
            key = self._next_block_key(seq)
            if key is not None:
                in_flight.add(key)
        if self.checkpoints is not None and step.seqs:
            step.captures = self.checkpoints.plan_step(step.seqs, step.query_lens)
        return step
