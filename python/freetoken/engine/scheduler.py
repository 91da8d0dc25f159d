"""Continuous batching with chunked prefill over the paged KV cache.

Each step takes a token budget (`max_prefill_tokens`). Running sequences that are decoding go first, one token
each, so a long prompt never stalls them; the rest of the budget goes to prompt chunks, of sequences already
admitted and then of waiting ones, up to `max_num_seqs` running and, per request, its share of them
(`freetoken.engine.admission`). When the KV cache cannot give a decoding
sequence its next block, the most recently arrived running sequence is preempted: its blocks are freed and it
is recomputed from its tokens later (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from freetoken.engine.admission import Admission
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.sequence import Sequence


@dataclass
class ScheduledStep:
    """What one step runs: sequences in order, and how many of each one's uncomputed tokens."""

    seqs: list[Sequence]
    query_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class Scheduler:
    """Owns the waiting queue and the running set, and the KV blocks of both."""

    def __init__(
        self, kv: KVCache, max_num_seqs: int, max_prefill_tokens: int, admission: Admission | None = None
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        # Per-request share of the batch (`freetoken.engine.admission`); by default a request's choices may use
        # the whole batch.
        self.admission = admission or Admission(max_num_seqs)
        self.max_prefill_tokens = max(1, max_prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences whose client stopped reading (`pause`): they keep their KV blocks, not their batch slot.
        self.paused: list[Sequence] = []

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

    def _free(self, seq: Sequence) -> None:
        self.kv.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

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
        return self._preempt(max(self.running, key=lambda s: s.arrival))

    def _preempt(self, victim: Sequence) -> Sequence:
        """Free a running sequence's blocks and queue it first, to be recomputed from its tokens."""
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
        # Fair admission (`freetoken.engine.admission`): with the batch full while a request waits within its
        # share, one sequence of the group furthest over its share makes room (recomputed later).
        share = self.admission.fair_share(self.waiting, self.running, self.max_num_seqs)
        if self.waiting and len(self.running) >= self.max_num_seqs:
            victim = self.admission.victim(self.waiting, self.running, share)
            if victim is not None:
                self._preempt(victim)
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
        index = 0  # waiting sequences of a group at its share are passed over, in order
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if not self.admission.admissible(seq, self.running, share):
                index += 1
                continue
            chunk = min(seq.num_uncomputed, budget)
            if not self._grow(seq, chunk):
                break
            del self.waiting[index]
            self.running.append(seq)
            step.seqs.append(seq)
            step.query_lens.append(chunk)
            budget -= chunk
        return step
