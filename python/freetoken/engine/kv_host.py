"""The host-RAM tier of the KV prefix cache: blocks the GPU prefix cache evicts keep their K/V in pinned host
memory, and come back over PCIe on a prefix hit when that is cheaper than prefilling them again.

Agent sessions with subagents overflow GPU KV quickly, while host RAM beside the expert pool often has tens of GB
free. `freetoken.engine.prefix_cache.PrefixCache` owns the index: an evicted GPU block whose content is indexed is
*demoted* (its K/V copied into a free host slot, the index entry moved to that slot, its node unchanged), and a
prompt whose cached prefix runs into host entries *promotes* them (GPU blocks allocated, K/V copied back, the
entries moved back). A node leaves the cache only when the host tier evicts it (least recently used) or the tier is
off: that is when `PrefixCache.on_evict` fires, so a recurrent-state snapshot (`freetoken.engine.state_checkpoints`)
lives and dies with its KV block, whichever tier holds it.

Layout and copies. The host memory is allocated as the tier fills, in chunks of `CHUNK_BYTES`, each
`[2 * num_layers, chunk_slots * block_size, num_kv_heads, head_dim]` (K then V of each layer), the KV cache's own row
layout (slot = block; slot s is row s % chunk_slots of chunk s // chunk_slots), page-locked with `cudaHostRegister`
(`freetoken.moe.pinned.PinnedRegion`, as the expert pool; torch's pinned allocator would round a 40 GB request up
to 64 GB and record an event per copy). Not all at start: the default budget is most of the free RAM, and pinning
it whole cost every engine start (each test's engine on the 128 GB device box pinned ~75 GB: tens of seconds) and
took memory from everything else on the box before any block was evicted. A chunk is added when no allocated slot
is free (`free_slot_ready`), and ahead of need, off a request's path, up to the blocks one step can evict (`reserve`:
at engine start and when the engine goes idle after work), if MemAvailable still leaves `DEFAULT_MARGIN_BYTES`;
otherwise the capacity stops where it is (logged once). The pairs of a demotion or a promotion are sorted and cut
into runs that are contiguous on both sides and inside one chunk: one copy per run and K/V tensor (the GPU cache has
one tensor per layer, K and V).
On CUDA the copies run on a side stream that first waits for the compute stream (the blocks' last writers), and
the compute stream waits for them before anything queued after (an event, no host sync): a demoted block is read
before its new owner writes it, and a promoted one is written before the attention (or the block copy of a fully
cached prompt) that reads it, while the host goes on scheduling. All copies share that one stream, so a host slot
is never rewritten before an earlier copy out of it has run. On a CPU device the tier is a second
buffer in the same memory and the copies are plain, on the same code path.

When to promote (`CopyCost`). Promoting n tokens costs `t0 + n * bytes_per_token / B_h2d` (t0: the fixed cost of
the 2 x num_layers copies of a run, their launches, measured at start with the tier's own one-block copy; B_h2d: the
H2D bandwidth of the bandwidth profile `ft serve` measures, `freetoken.moe.profile`, else one large copy measured at
start); prefilling them again
costs `n * g`, g the marginal prefill seconds per token the engine measures on its own steps (a least-squares line
through (tokens, seconds) of recent prefill steps: the slope, so the fixed cost of a step, paid with or without
these tokens, is not counted). Promotion pays from `crossover = t0 / (g - bytes_per_token / B_h2d)` tokens on; a
prefix hit with fewer host tokens recomputes them (its host entries stay, and are re-pointed at the recomputed
blocks when those are indexed). Until a prefill step has been measured, host hits are promoted.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.moe.pinned import PinnedRegion, PinningError

log = logging.getLogger(__name__)

# Share of what host memory has left (after the expert pool and the rest `plan_host_memory` lists) that the
# default `--kv-host-gb` leaves alone for the OS, page cache and growth, and a floor for that margin.
DEFAULT_MARGIN_SHARE = 0.25
DEFAULT_MARGIN_BYTES = 8 * 10**9
# Forgetting factor of the prefill-cost fit, per measured step: about the last 50 steps count.
PREFILL_FIT_DECAY = 0.98
# The start-up copy-rate measurement without a bandwidth profile: on CUDA one linear copy of this many bytes (past
# the launch-bound sizes, which end at a few MB); on a CPU device a promotion of this many blocks (or all there are).
MEASURE_LINE_BYTES = 64 * 2**20
MEASURE_RUN_BLOCKS = 64
# Host memory is added to the tier this much at a time (at least one block): pinning 256 MiB takes
# tens of milliseconds, paid by the step whose eviction needs the room, once per chunk.
CHUNK_BYTES = 256 * 2**20


def default_host_bytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, backend: str) -> int:
    """The host tier's budget in bytes: `--kv-host-gb` when given (>= 0); by default (-1) on CUDA, what
    MemAvailable leaves after everything `freetoken.moe.budget.plan_host_memory` lists (expert pool, pinned
    staging, the state-checkpoint tier), less a safety margin (`DEFAULT_MARGIN_SHARE` of it, at least
    `DEFAULT_MARGIN_BYTES`); 0 on a CPU device (the KV cache itself is host memory there: raise --kv-cache-gb)
    and without the prefix cache."""
    if cfg.no_prefix_cache:
        return 0
    if cfg.kv_host_gb >= 0:
        return int(cfg.kv_host_gb * 1e9)
    if torch.device(cfg.device).type != "cuda":
        return 0
    from freetoken.moe.budget import host_available_bytes, plan_host_memory

    available = host_available_bytes()
    if available is None:
        return 0
    left = available - sum(nbytes for nbytes, _ in plan_host_memory(cfg, model_cfg, dtype, backend).values())
    return max(0, int(left - max(DEFAULT_MARGIN_BYTES, DEFAULT_MARGIN_SHARE * left)))


def contiguous_runs(pairs: Sequence[tuple[int, int]], host_side: int = 0, chunk: int = 0) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs of block pairs (src block, dst block), sorted by src, each contiguous on both
    sides: `pairs` [(3, 7), (4, 8), (6, 9)] -> [(3, 7, 2), (6, 9, 1)]. With `chunk` > 0, no run crosses a multiple
    of `chunk` on side `host_side` (0: src, 1: dst), where memory is cut into chunks: [(3, 7), (4, 8)] with chunk 4
    on the src side -> [(3, 7, 1), (4, 8, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if (
            runs
            and runs[-1][0] + runs[-1][2] == src
            and runs[-1][1] + runs[-1][2] == dst
            and not (chunk and (src, dst)[host_side] % chunk == 0)
        ):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class CopyCost:
    """When promoting host blocks beats prefilling them again (see the module docstring for the formula).

    Args:
        bytes_per_token: K/V bytes of one token over all layers.
        h2d_bytes_per_s: host-to-device copy rate (the bandwidth profile's, or measured at start).
        fixed_s: the fixed cost of one promotion (measured at start).
    """

    def __init__(self, bytes_per_token: int, h2d_bytes_per_s: float, fixed_s: float) -> None:
        self.bytes_per_token = bytes_per_token
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self.fixed_s = fixed_s
        # Decayed sums of the prefill fit: weight, x (tokens), y (seconds), x^2, x*y.
        self._fit = [0.0] * 5
        self.num_prefill_samples = 0

    def add_prefill(self, num_tokens: int, seconds: float) -> None:
        """One measured prefill step: `num_tokens` computed in `seconds`."""
        x, y = float(num_tokens), seconds
        self._fit = [PREFILL_FIT_DECAY * s + v for s, v in zip(self._fit, (1.0, x, y, x * x, x * y), strict=True)]
        self.num_prefill_samples += 1

    @property
    def prefill_s_per_token(self) -> float | None:
        """The marginal prefill seconds per token: the fit's slope; the mean seconds per token while the steps
        measured do not spread in size enough to fit a slope (or it comes out non-positive); None before any."""
        w, sx, sy, sxx, sxy = self._fit
        if w == 0 or sx <= 0:
            return None
        var = sxx - sx * sx / w
        if var > 1e-6 * sxx:
            slope = (sxy - sx * sy / w) / var
            if slope > 0:
                return slope
        return sy / sx

    @property
    def copy_s_per_token(self) -> float:
        """Seconds to copy one token's K/V host to device at `h2d_bytes_per_s`."""
        return self.bytes_per_token / self.h2d_bytes_per_s

    @property
    def crossover_tokens(self) -> float | None:
        """Host tokens from which promoting them is cheaper than prefilling them again: 0 before a prefill step
        was measured (promote), `math.inf` when copying a token costs more than computing it, else t0 / (g - c)."""
        g = self.prefill_s_per_token
        if g is None:
            return 0.0
        margin = g - self.copy_s_per_token
        return math.inf if margin <= 0 else self.fixed_s / margin

    def worth_promoting(self, num_tokens: int) -> bool:
        """Whether promoting `num_tokens` host tokens beats prefilling them (`crossover_tokens`)."""
        crossover = self.crossover_tokens
        return crossover is not None and num_tokens >= crossover

    def stats(self) -> dict:
        """JSON-able figures of the decision (seconds as microseconds per token; inf crossover as None)."""
        g = self.prefill_s_per_token
        crossover = self.crossover_tokens
        return {
            "crossover_tokens": None if crossover is None or math.isinf(crossover) else round(crossover, 1),
            "h2d_gbps": round(self.h2d_bytes_per_s / 1e9, 3),
            "copy_fixed_us": round(self.fixed_s * 1e6, 1),
            "copy_us_per_token": round(self.copy_s_per_token * 1e6, 4),
            "prefill_us_per_token": None if g is None else round(g * 1e6, 3),
            "prefill_samples": self.num_prefill_samples,
        }


class HostKVTier:
    """Host slots holding K/V of prefix-cache blocks the GPU evicted, with their LRU order and the copies.

    Slots are handed out by `PrefixCache` (`take`, `give`, `evict_lru`); the index (which key a slot holds) is the
    prefix cache's.

    Args:
        kv: the GPU (compute-device) KV cache (`freetoken.engine.kv_cache.KVCache`): layers, block size, dtype.
        num_slots: blocks the tier may hold (>= 1); memory for them is allocated a chunk at a time as they fill
            (the first chunk at start, for the copy measurement).
        h2d_bytes_per_s: the bandwidth profile's host-to-device rate; None measures it at start.
        chunk_bytes: host memory added at a time (None: `CHUNK_BYTES`), rounded down to whole blocks (at least one).
        headroom: allocated slots kept free ahead of need (`reserve`, at start and on each call): the blocks one
            engine step can evict.

    Raises:
        ValueError: num_slots < 1.
        freetoken.moe.pinned.PinningError: the first chunk could not be page-locked.
    """

    def __init__(
        self,
        kv,
        num_slots: int,
        h2d_bytes_per_s: float | None = None,
        chunk_bytes: int | None = None,
        headroom: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_slots}")
        self.kv = kv
        self.num_slots = num_slots
        self.block_size = kv.block_size
        self.device = kv.layers[0][0].device
        self.bytes_per_block = kv.bytes_per_block
        self.chunk_slots = max(1, (chunk_bytes or CHUNK_BYTES) // self.bytes_per_block)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Per chunk: its (K, V) views per layer, and its page-locked registration on CUDA (None on a CPU device).
        self.chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._regions: list[PinnedRegion | None] = []
        self.num_allocated = 0  # slots with memory behind them: chunks' slots, the last chunk maybe shorter
        self._free: list[int] = []  # allocated slots holding nothing, the lowest last (popped first)
        self._grow()
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding cached content, least recent first
        self.num_demoted_blocks = 0
        self.num_promoted_blocks = 0
        self.num_evicted_blocks = 0
        self.num_skipped_tokens = 0  # host hits below the crossover, recomputed instead
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.num_copies = 0
        self.cost = self._measure(h2d_bytes_per_s)
        self.headroom = headroom
        self.reserve()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the tier holds when full."""
        return self.num_slots * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the tier may take when full."""
        return self.num_slots * self.bytes_per_block

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of host memory the tier holds now (its chunks)."""
        return self.num_allocated * self.bytes_per_block

    @property
    def num_live(self) -> int:
        """Slots holding cached content."""
        return len(self._lru)

    @property
    def num_free(self) -> int:
        """Slots holding nothing: allocated ones and those not allocated yet."""
        return len(self._free) + self.num_slots - self.num_allocated

    def _grow(self) -> bool:
        """Add one chunk of host memory (page-locked on CUDA) and its slots to the free ones. False when the
        capacity is all allocated, and, with the capacity cut to what is allocated (logged), when MemAvailable would
        leave less than `DEFAULT_MARGIN_BYTES` after it or the page-locking fails; the first chunk's failure raises
        instead."""
        if self.num_allocated >= self.num_slots:
            return False
        n = min(self.chunk_slots, self.num_slots - self.num_allocated)
        k0 = self.kv.layers[0][0]
        nbytes = n * self.bytes_per_block
        if self.chunks:
            from freetoken.moe.budget import host_available_bytes

            available = host_available_bytes()
            if available is not None and available - nbytes < DEFAULT_MARGIN_BYTES:
                return self._stop_growing(f"MemAvailable is {available / 1e9:.2f} GB")
        buf = torch.empty((2 * len(self.kv.layers), n * self.block_size, *k0.shape[1:]), dtype=k0.dtype)
        region = None
        if self.device.type == "cuda":
            try:
                region = PinnedRegion(buf.data_ptr(), buf.numel() * buf.element_size(), keep=buf)
            except PinningError as e:
                if not self.chunks:
                    raise
                return self._stop_growing(str(e))
        self.chunks.append([(buf[2 * i], buf[2 * i + 1]) for i in range(len(self.kv.layers))])
        self._regions.append(region)
        self._free = list(range(self.num_allocated + n - 1, self.num_allocated - 1, -1)) + self._free
        self.num_allocated += n
        return True

    def _stop_growing(self, why: str) -> bool:
        log.warning(
            "KV host tier: stays at %d blocks = %.2f GB of the %.2f GB asked (%s)",
            self.num_allocated,
            self.allocated_nbytes / 1e9,
            self.nbytes / 1e9,
            why,
        )
        self.num_slots = self.num_allocated
        return False

    def reserve(self) -> int:
        """Grow (`_grow`) until `headroom` allocated slots are free, the capacity is reached or growth stops.

        Done ahead, off a request's path: at engine start and when the engine goes idle after work
        (`LLMEngine.idle`), for the blocks one step can evict. Otherwise a step whose evictions need room pins it
        then: an agent trace's first turn on the H200 box (18.8k tokens, demoting the blocks of earlier prompts)
        took 1.80 s against 1.02 s for a prompt of its length on the same server before (`benches/agent_trace.py`).

        Returns the chunks added.
        """
        added = 0
        while len(self._free) < self.headroom and self._grow():
            added += 1
        return added

    # Slots (the prefix cache calls these).

    def free_slot_ready(self) -> bool:
        """Whether `take` has a slot: an allocated free one, or one of a chunk added now (`_grow`) while the
        capacity has room for it. False: `evict_lru` makes one."""
        return bool(self._free) or self._grow()

    def take(self) -> int:
        """A free slot, now live and most recently used. Raises IndexError when none is ready (`free_slot_ready`
        first; `evict_lru` when it is False)."""
        slot = self._free.pop()
        self._lru[slot] = None
        return slot

    def evict_lru(self) -> int:
        """Evict the least recently used live slot: it becomes free, counted. Returns it."""
        slot, _ = self._lru.popitem(last=False)
        self._free.append(slot)
        self.num_evicted_blocks += 1
        return slot

    def hold(self, slot: int) -> None:
        """Take a live slot out of the LRU order while a promotion reads it (`give` ends it)."""
        del self._lru[slot]

    def give(self, slot: int) -> None:
        """A slot whose content went back to the GPU (or was re-pointed at a recomputed block) becomes free."""
        self._lru.pop(slot, None)
        self._free.append(slot)

    def touch(self, slot: int) -> None:
        """Mark a live slot most recently used (a lookup matched it)."""
        self._lru.move_to_end(slot)

    # Copies.

    def _copy(self, pairs: Sequence[tuple[int, int]], promote: bool) -> None:
        """Copy blocks host slot -> GPU block (`promote`, pairs (slot, block)) or back (pairs (block, slot))."""
        bs, per = self.block_size, self.chunk_slots
        host = 0 if promote else 1
        runs = contiguous_runs(pairs, host_side=host, chunk=per)
        for run in runs:
            src, dst, n = run
            slot = run[host]
            chunk, row = self.chunks[slot // per], slot % per
            gpu_row = (dst if promote else src) * bs
            for (gk, gv), (hk, hv) in zip(self.kv.layers, chunk, strict=True):
                for g, h in ((gk, hk), (gv, hv)):
                    host_rows = h[row * bs : (row + n) * bs]
                    gpu_rows = g[gpu_row : gpu_row + n * bs]
                    (gpu_rows if promote else host_rows).copy_(host_rows if promote else gpu_rows, non_blocking=True)
        self.num_copies += len(runs)

    def _on_stream(self, pairs: Sequence[tuple[int, int]], promote: bool) -> None:
        if not pairs:
            return
        if self.stream is None:
            self._copy(pairs, promote)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(pairs, promote)
        # Now, not at the next step: the scheduler may copy a promoted block on the compute stream before the step
        # (`Scheduler._admit`'s private last block) or hand a demoted one to a sequence that writes it.
        compute.wait_stream(self.stream)

    def demote(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Queue the copies of GPU blocks into host slots: `pairs` (GPU block, slot)."""
        self._on_stream(pairs, promote=False)
        self.num_demoted_blocks += len(pairs)
        self.bytes_d2h += len(pairs) * self.bytes_per_block

    def promote(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Queue the copies of host slots into GPU blocks: `pairs` (slot, GPU block)."""
        self._on_stream(pairs, promote=True)
        self.num_promoted_blocks += len(pairs)
        self.bytes_h2d += len(pairs) * self.bytes_per_block

    def synchronize(self) -> None:
        """Wait until every queued copy has run (before the GPU KV tensors are replaced, `engine.resize`)."""
        if self.stream is not None:
            self.stream.synchronize()

    def _measure(self, profiled: float | None) -> CopyCost:
        """The promotion cost model's figures. The rate: the bandwidth profile's H2D rate when given; else on CUDA
        one large linear copy (`freetoken.bench.bandwidth.measure_line_rate` of `MEASURE_LINE_BYTES`), on a CPU
        device a promotion of `MEASURE_RUN_BLOCKS` blocks (the tier's own copies: torch runs a large CPU copy on
        its thread pool, whose speed on a loaded host says nothing about the per-block copies). The fixed cost t0:
        what a one-block promotion (the tier's own 2 x num_layers copies) takes beyond its bytes at that rate: the
        per-copy launch cost, which dominates runs below a few MB (on the H200 box at the Qwen3-30B-A3B shape:
        0.8 ms from 1 to 16 blocks, then ~54 GB/s). Copies go host slot i -> GPU block i, free before serving;
        best of 3 each."""
        one = self.copy_seconds(1)
        if profiled:
            rate = profiled
        elif self.stream is not None:
            from freetoken.bench.bandwidth import measure_line_rate

            rate = measure_line_rate(self.device, MEASURE_LINE_BYTES)
        else:
            n = min(MEASURE_RUN_BLOCKS, self.num_allocated, self.kv.num_blocks)
            rate = n * self.bytes_per_block / self.copy_seconds(n)
        self.num_copies = 0
        return CopyCost(self.bytes_per_block // self.block_size, rate, max(0.0, one - self.bytes_per_block / rate))

    def copy_seconds(self, num_blocks: int, promote: bool = True, repeats: int = 3) -> float:
        """Best of `repeats` seconds of one run of `num_blocks` blocks, host slots 0.. -> GPU blocks 0.. (`promote`)
        or back, waited for (they overwrite those blocks: only before serving, or on a tier of its own)."""
        pairs = [(i, i) for i in range(num_blocks)]
        best = math.inf
        for _ in range(repeats):
            self.synchronize()
            if self.stream is not None:
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self._on_stream(pairs, promote)
            self.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def stats(self) -> dict:
        """Counters (JSON-able): capacity, live and free slots, blocks demoted, promoted and evicted, host hits
        recomputed (below the crossover), bytes moved each way, copies, and the crossover's figures."""
        return {
            "capacity_blocks": self.num_slots,
            "capacity_tokens": self.capacity_tokens,
            "nbytes": self.nbytes,
            "allocated_nbytes": self.allocated_nbytes,
            "num_live_blocks": self.num_live,
            "num_free_blocks": self.num_free,
            "num_demoted_blocks": self.num_demoted_blocks,
            "num_promoted_blocks": self.num_promoted_blocks,
            "num_evicted_blocks": self.num_evicted_blocks,
            "num_hit_tokens": self.num_promoted_blocks * self.block_size,
            "num_skipped_tokens": self.num_skipped_tokens,
            "bytes_d2h": self.bytes_d2h,
            "bytes_h2d": self.bytes_h2d,
            "num_copies": self.num_copies,
            **self.cost.stats(),
        }
