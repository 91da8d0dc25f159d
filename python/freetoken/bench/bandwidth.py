"""Bandwidths of the two miss paths on the deployed expert shape (the inputs of q*), and their ceilings.

Every figure is bytes/s; "expert bytes" are `ExpertPool.expert_nbytes` (gate_up + down, bf16). Methods:

- `measure_pcie`: host->device copies of whole experts from the pinned arena into device slots, on a copy
  stream, as the expert cache fills; sources walk the whole pool (no copy repeats a source until it wraps).
  Timed by CUDA events around a run of about `seconds` (count calibrated from a first timed run of 32).
- `measure_torch_copy`: the same-size copy done the plain torch way (one `pin_memory=True` tensor, copied again
  and again into one device tensor on a fresh stream): the reference our figure is checked against.
- `measure_line_rate`: one large linear pinned copy (1 GiB), best of 3: the PCIe ceiling.
- `measure_cpu`: the Rust host kernel (`CpuExperts.forward`), `experts_per_call` experts of one layer per call
  (top-k, as the criterion bench and a decode layer step do), every one of `batch` tokens routed to each; calls
  walk layers and expert groups across the whole pool (a working set far larger than the LLC), so weights stream
  from DRAM. Bytes/s = experts run x expert bytes / time inside `forward` (`perf_counter`). This is what the
  planner's B_cpu(b) means: b tokens per missing expert, one call per layer step.
- `measure_host_read`: a multi-threaded torch sum over the whole arena (read as float32), best of 3: the
  DRAM read ceiling of the host kernel.
- `measure_overlapped`: both at once: expert copies kept queued on the copy stream (never fewer than a few groups
  in flight) while the main thread runs host-kernel calls back to back, for `seconds`; PCIe bytes/s from the
  CUDA events of the copy groups that completed while the CPU was busy, CPU bytes/s as in `measure_cpu`. They
  share the memory bus; these are the figures q* uses.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from freetoken._core import CpuExperts, ExpertPool

CALIBRATE_COPIES = 32
COPY_GROUP = 16  # expert copies per CUDA event pair in the overlapped run
COPY_GROUPS_IN_FLIGHT = 6
LINE_RATE_BYTES = 1 << 30


def _expert_sources(pool: ExpertPool, start: int = 0):
    """Byte offsets of experts from `start`, walking layers first then experts, over the whole pool, forever."""
    total = pool.num_layers * pool.num_experts
    i = start
    while True:
        flat = i % total
        yield pool.expert_offset(flat % pool.num_layers, flat // pool.num_layers)
        i += 1


def _timed(stream: torch.cuda.Stream, enqueue: Callable[[], None]) -> float:
    """Seconds `stream` spends on the work `enqueue()` queues on it, between two CUDA events (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        enqueue()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _copy_rate(copy_one: Callable[[int], None], nbytes: int, stream: torch.cuda.Stream, seconds: float) -> float:
    """Bytes/s of `copy_one(i)` (one async copy of `nbytes` on `stream`), over about `seconds`, by CUDA events."""

    def timed(first: int, count: int) -> float:
        return _timed(stream, lambda: [copy_one(i) for i in range(first, first + count)])

    timed(0, 8)  # warm-up
    per_copy_s = timed(8, CALIBRATE_COPIES) / CALIBRATE_COPIES
    count = max(CALIBRATE_COPIES, int(seconds / per_copy_s))
    return count * nbytes / timed(8 + CALIBRATE_COPIES, count)


def measure_pcie(
    pool: ExpertPool, arena: torch.Tensor, slots: torch.Tensor, stream: torch.cuda.Stream, seconds: float = 1.0
) -> float:
    """Bytes/s of whole-expert host->device copies (pinned arena -> slots) on `stream`.

    Args:
        pool: the pool; sources walk all its experts.
        arena: [pool.nbytes] uint8 CPU view of the arena, pinned (`freetoken.moe.pinned.PinnedRegion`).
        slots: [S, >= expert_nbytes] uint8 device tensor; copies cycle through its rows.
        stream: the copy stream.
        seconds: about how long the timed run lasts.
    """
    n = pool.expert_nbytes
    sources = _expert_sources(pool)

    def copy_one(i: int) -> None:
        off = next(sources)
        slots[i % slots.shape[0], :n].copy_(arena[off : off + n], non_blocking=True)

    return _copy_rate(copy_one, n, stream, seconds)


def measure_torch_copy(nbytes: int, device: torch.device, seconds: float = 1.0) -> float:
    """Bytes/s of a plain torch pinned copy of `nbytes`: one `torch.empty(pin_memory=True)` uint8 tensor copied
    into one device tensor, repeatedly, on a fresh stream (the reference for `measure_pcie`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _copy_rate(lambda i: dst.copy_(src, non_blocking=True), nbytes, torch.cuda.Stream(device), seconds)


def measure_line_rate(device: torch.device, nbytes: int = LINE_RATE_BYTES) -> float:
    """Bytes/s of one large linear pinned host->device copy of `nbytes`, best of 3 (the PCIe ceiling)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    return nbytes / min(_timed(stream, lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))


class _CpuCalls:
    """Host-kernel calls of `experts_per_call` experts at `batch` tokens each, walking the whole pool.

    Call i runs layer i % L on the i // L-th group of `experts_per_call` experts (mod E), so consecutive calls
    read different memory and the walk covers the whole pool before it repeats.
    """

    def __init__(self, cpu: CpuExperts, pool: ExpertPool, batch: int, experts_per_call: int) -> None:
        self.cpu, self.pool = cpu, pool
        self.n = min(experts_per_call, pool.num_experts)
        gen = np.random.default_rng(batch)
        self.hidden = gen.standard_normal((batch, pool.hidden_size), dtype=np.float32)
        self.out = np.zeros((batch, pool.hidden_size), dtype=np.float32)
        self.weights = np.full((batch, self.n), 1.0 / self.n, dtype=np.float32)
        self.ids = np.zeros((batch, self.n), dtype=np.int64)
        self.i = 0

    def run(self) -> tuple[int, float]:
        """One call: (expert bytes read, seconds inside `forward`)."""
        layer, group = self.i % self.pool.num_layers, self.i // self.pool.num_layers
        experts = (np.arange(self.n, dtype=np.int64) + group * self.n) % self.pool.num_experts
        self.ids[:] = experts  # every token picks every expert of the call
        self.i += 1
        t0 = time.perf_counter()
        self.cpu.forward(layer, self.hidden, self.ids, self.weights, experts, self.out)
        return self.n * self.pool.expert_nbytes, time.perf_counter() - t0


def measure_cpu(
    cpu: CpuExperts, pool: ExpertPool, batch: int, experts_per_call: int = 8, seconds: float = 1.0
) -> float:
    """Expert weight bytes/s of the host kernel at `batch` tokens per expert (see the module docstring).

    Args:
        cpu: the kernels (their thread count is the one measured).
        pool: the pool, sized far beyond the LLC.
        batch: tokens routed to each expert of a call (b).
        experts_per_call: experts per `forward` call (the model's top-k).
        seconds: about how long the timed calls last (after one warm-up call).
    """
    calls = _CpuCalls(cpu, pool, batch, experts_per_call)
    calls.run()
    nbytes = busy_s = 0.0
    while busy_s < seconds:
        b, s = calls.run()
        nbytes, busy_s = nbytes + b, busy_s + s
    return nbytes / busy_s


def measure_host_read(pool: ExpertPool, num_threads: int) -> float:
    """Bytes/s of reading the whole arena (a torch float32 sum on `num_threads` threads), best of 3: the DRAM
    read ceiling of the host kernel."""
    words = torch.frombuffer(pool.arena_view(), dtype=torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            words.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return pool.nbytes / best


def measure_overlapped(
    cpu: CpuExperts,
    pool: ExpertPool,
    arena: torch.Tensor,
    slots: torch.Tensor,
    stream: torch.cuda.Stream,
    batch: int,
    experts_per_call: int = 8,
    seconds: float = 1.0,
) -> tuple[float, float]:
    """(PCIe expert-copy bytes/s, host-kernel bytes/s at `batch`) with both running at once for about `seconds`.

    The main thread keeps `COPY_GROUPS_IN_FLIGHT` groups of `COPY_GROUP` expert copies queued on `stream` (each
    group between two CUDA events) and runs one host-kernel call between checks, as a decode layer step queues its
    fills and then runs its CPU experts. Copies read the pool from its middle, the kernel from its start. The PCIe
    figure counts the groups that completed while the kernel ran (first to last completion, by their events).
    """
    n = pool.expert_nbytes
    sources = _expert_sources(pool, start=pool.num_layers * pool.num_experts // 2)
    calls = _CpuCalls(cpu, pool, batch, experts_per_call)
    in_flight: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
    done: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    slot = 0
    cpu_bytes = cpu_s = 0.0
    calls.run()
    while cpu_s < seconds:
        while len(in_flight) < COPY_GROUPS_IN_FLIGHT:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(COPY_GROUP):
                    off = next(sources)
                    slots[slot % slots.shape[0], :n].copy_(arena[off : off + n], non_blocking=True)
                    slot += 1
                end.record(stream)
            in_flight.append((start, end))
        b, s = calls.run()
        cpu_bytes, cpu_s = cpu_bytes + b, cpu_s + s
        while in_flight and in_flight[0][1].query():
            done.append(in_flight.popleft())
    stream.synchronize()
    if len(done) < 2:  # the kernel ran shorter than two copy groups: count all, a lower bound on overlap
        done += list(in_flight)
    pcie_s = done[0][0].elapsed_time(done[-1][1]) / 1e3
    return len(done) * COPY_GROUP * n / pcie_s, cpu_bytes / cpu_s


def planner_figures(overlapped: dict[int, tuple[float, float]]) -> tuple[float, dict[int, float]]:
    """The figures the planner and the prefill cost model take, from `measure_overlapped` runs at each b
    ({b: (PCIe bytes/s, host-kernel bytes/s)}): B_pcie the median of the copies' rates over b, B_cpu(b) the
    kernel's rate at each b; both measured with the other path running, as they share the host memory bus when a
    layer step splits its misses (what `ft bench bw` writes to the profile's `planner`)."""
    return statistics.median(p for p, _ in overlapped.values()), {b: c for b, (_, c) in overlapped.items()}
