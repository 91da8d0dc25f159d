"""Continuous batching with chunked prefill over the paged KV cache.

Each step takes a token budget (`max_prefill_tokens`). Running sequences that are decoding go first, one token
each, so a long prompt never stalls them; the rest of the budget goes to prompt chunks, of sequences already
admitted and then of waiting ones, up to `max_num_seqs` running. When the KV cache cannot give a decoding
sequence its next block, the most recently arrived running sequence is preempted: its blocks are freed and it
is recomputed from its tokens later (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from freetoken.engine.kv_cache import KVCache
from freetoken.engine.sequence import Sequence
from freetoken.engine.state_pool import RecurrentStatePool


@dataclass
class ScheduledStep:
    """What one step runs: sequences in order, and how many of each one's uncomputed tokens."""

    seqs: list[Sequence]
    query_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class Scheduler:
    """Owns the waiting queue and the running set, and the KV blocks of both; with a recurrent-state pool (hybrid
    models), the state slot of each running sequence too (taken at admission, given back with its blocks)."""

    def __init__(
        self, kv: KVCache, max_num_seqs: int, max_prefill_tokens: int, state_pool: RecurrentStatePool | None = None
    ) -> None:
        self.kv = kv
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max(1, max_prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.kv.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        if seq.state_slot >= 0:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = -1

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` more tokens; False when the cache has too few free."""
        need = self.kv.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)
        if need > self.kv.allocator.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.kv.allocator.allocate(need))
        return True

    def _preempt_last(self) -> Sequence | None:
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self._free(victim)
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> ScheduledStep:
        """Pick the next step's work. Returns an empty step only when there is no work.

        When running prompts hold blocks but none can grow, the newest is preempted until one can.
        """
        step = self._schedule_once()
        while not step.seqs and self.running:
            self._preempt_last()
            step = self._schedule_once()
        return step

    def _schedule_once(self) -> ScheduledStep:
        budget = self.max_prefill_tokens
        step = ScheduledStep([], [])
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
        for seq in prefilling:
            if budget <= 0:
                break
            chunk = min(seq.num_uncomputed, budget)
            if self._grow(seq, chunk):
                step.seqs.append(seq)
                step.query_lens.append(chunk)
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(seq.num_uncomputed, budget)
            if not self._grow(seq, chunk):
                break
            self.waiting.popleft()
            if self.state_pool is not None:  # running <= max_num_seqs = the pool's slots: one is free
                if seq.num_computed:
                    # A fresh slot is the zero state: KV reused for a prefix would meet linear layers that never saw
                    # it. Hybrid models may skip a prefix only with a state snapshot taken at its end.
                    raise RuntimeError(
                        f"request {seq.request_id}: admitted with {seq.num_computed} computed tokens but no "
                        "recurrent-state snapshot; the KV prefix cache must not skip prefill on hybrid models"
                    )
                seq.state_slot = self.state_pool.allocate()
            self.running.append(seq)
            step.seqs.append(seq)
            step.query_lens.append(chunk)
            budget -= chunk
        return step
