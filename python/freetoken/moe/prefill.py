"""Prefill through the expert cache: whole-layer streaming into double buffers, and the strategy of each chunk.

A long chunk routes to nearly every expert of every layer, so on-demand fills would stall the GPU on each layer's
copies after its routing is known. `LayerStreamer` keeps one or two full-layer buffers on the device (rows after
the cache's slots in one weight tensor): while layer n's experts compute from buffer n % 2, the copy stream loads
layer n+1's experts into the other one (its routing is not known yet, so every expert that is not already in a
slot). Events order each copy after the last kernel that read its buffer, and each kernel after its copy; nothing
waits on the host, so the forward pass of a chunk queues ahead of the GPU. Resident experts are read from their
slots and the slot cache is left as it is: decode-hot experts survive a prefill (`shared/DESIGN.md`, "Prefill").

`choose_strategy` prices each chunk (per MoE layer, `PrefillCosts`) from the bandwidth profile and the GPU's
measured matmul rate F (`measure_gpu_flops`); t_gpu = T·k·S / F (a bf16 SwiGLU expert of S bytes does S FLOPs per
token: 2 per weight):
    stream: max(N·S / B_pcie, t_gpu)   N experts not resident; the copy overlaps the previous layer's compute
            (N·S / B_pcie + t_gpu with one buffer)
    fill:   M·S / B_pcie + t_gpu + t_sync   M = D·N/E misses among D = E·(1 - (1 - k/E)^T) routed experts
            (uniform routing, an upper bound for real, skewed routers); copies start after the routing is on
            the host (one sync) and the kernel waits for them
    cpu:    M·S / B_cpu(b) + t_gpu + t_sync   b = T·k / D tokens per expert (`cpu_bytes_per_s_at`: past the profile's
            largest batch the CPU is compute-bound, so bytes/s falls as b_max / b)
    hybrid: M·S / (B_pcie + B_cpu(b)) + t_gpu + t_sync   both miss paths end together at q* (the planner's split)
The model leaves out what it cannot see (per-copy call costs, the CPU kernels' speed on uneven routing, the host
memory bus that copies and CPU kernels share, attention), so each chunk's wall time is measured against its
prediction and the ratio's running average per strategy and chunk size class (`Calibration`) scales that strategy's
later predictions at that size (at a size not measured yet, the nearest measured size's). A strategy the model
prices close to the best one is run at each size class to be measured (`EXPLORE_MARGIN`, wide while the strategy
has no measurement at any size, `EXPLORE_MARGIN_NEAR` once a neighbouring size's scale corrects its price), so one
it overprices is still found. Every prefill chunk may stream, however short: a 64-token extend after an 8k prefix
streamed in 0.86 s on the lent H200 box (Qwen3-30B-A3B, 24 GB) against 1.00 s with `hybrid`, which `auto` took when
chunks under 65 tokens could not stream.

`auto` chooses among every strategy the backend can run (`candidate_strategies`), not only streaming and the
backend's own plan: on that box a 16-token extend took 0.29 s with `cpu` (no fills: the decode-hot slots stay, 25 %
hits) against 0.28-0.44 s with `hybrid`, whose fills of one-off experts evict the slots until none hits (its time
depends on how many extends ran before), which the model (uniform routing, no eviction cost) cannot see.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from freetoken._core import cpu_bytes_per_s_at

# Planner backend of each on-demand strategy.
DEMAND_MODES = {"fill": "offload", "cpu": "cpu", "hybrid": "hybrid"}
# One host round trip per MoE layer (routing to the host, planning, copies queued): ~0.6 ms measured on the lent
# H200 box (benches/moe_backends.py --profile); streaming has none.
SYNC_SECONDS = 0.6e-3
# Without a bandwidth profile: PCIe 4.0 x16's practical host->device rate. Only ratios of copy costs use it.
DEFAULT_PCIE_BYTES_PER_S = 25e9
# A strategy not yet measured at a chunk size class is run there when its price is within a factor of the measured
# best one's; exploring costs two chunks per strategy and class (the first is a warm-up). Never measured at any size,
# its price is the bare model's, whose error relative to another strategy's reached 3x on the lent H200 box
# (measured / predicted at 16 tokens: `cpu` 0.33, `hybrid` 0.75-1.2, `stream` 0.96), so the margin is wide; measured
# at another size, the scale carried from there leaves a smaller error (it moved by 1.1-1.8x between neighbouring
# sizes), so a tight margin keeps long chunks, where a wrong strategy costs most, from exploring.
EXPLORE_MARGIN = 2.5
EXPLORE_MARGIN_NEAR = 1.2


@dataclass(frozen=True)
class PrefillCosts:
    """Inputs of the per-chunk cost model, for one MoE layer.

    Attributes:
        num_experts: E, routed experts per layer.
        top_k: k.
        expert_nbytes: S, bytes of one expert.
        resident: mean experts per layer resident in slots.
        pcie_bytes_per_s: B_pcie (bytes/s).
        cpu_bytes_per_s: B_cpu(b) as {batch: bytes/s}, or None without a profile.
        gpu_flops_per_s: F, the device's bf16 matmul rate (FLOP/s); None: compute time not counted (CPU device).
        overlap: two layer buffers (the copy of layer n+1 overlaps layer n's compute).
    """

    num_experts: int
    top_k: int
    expert_nbytes: int
    resident: float
    pcie_bytes_per_s: float
    cpu_bytes_per_s: dict[int, float] | None
    gpu_flops_per_s: float | None = None
    overlap: bool = True

    def seconds(self, strategy: str, num_tokens: int) -> float:
        """Estimated seconds per MoE layer of a `num_tokens` chunk with `strategy` ("stream", "fill", "cpu",
        "hybrid"); inf for "cpu"/"hybrid" without a CPU profile."""
        e, s = self.num_experts, self.expert_nbytes
        absent = e - min(self.resident, e)
        gpu = num_tokens * self.top_k * s / self.gpu_flops_per_s if self.gpu_flops_per_s else 0.0
        if strategy == "stream":
            copy = absent * s / self.pcie_bytes_per_s
            return max(copy, gpu) if self.overlap else copy + gpu
        routed = e * (1.0 - (1.0 - self.top_k / e) ** num_tokens)
        miss_bytes = routed * absent / e * s
        if strategy == "fill":
            return miss_bytes / self.pcie_bytes_per_s + gpu + SYNC_SECONDS
        if not self.cpu_bytes_per_s:
            return float("inf")
        cpu = cpu_bytes_per_s_at(self.cpu_bytes_per_s, num_tokens * self.top_k / max(routed, 1.0))
        if strategy == "cpu":
            return miss_bytes / cpu + gpu + SYNC_SECONDS
        return miss_bytes / (self.pcie_bytes_per_s + cpu) + gpu + SYNC_SECONDS


def candidate_strategies(demand: str, streams: bool, slots: bool, profile: bool) -> list[str]:
    """The strategies `auto` chooses among, in order of preference on a tie: "stream" with layer buffers
    (`streams`), the backend's own on-demand plan `demand`, "cpu" with a CPU profile (`profile`; the model prices it
    inf without one), "hybrid" with slots and a profile, "fill" with slots unless "hybrid" is a candidate (the model
    never prices "hybrid" above "fill", and measured it was cheaper at every extend of 16-2048 tokens on the lent
    H200 box: it is "fill" with part of the misses moved to the CPU)."""
    out = ["stream"] if streams else []
    for strategy, runnable in (
        (demand, True),
        ("cpu", profile),
        ("hybrid", slots and profile),
        ("fill", slots and not profile),
    ):
        if runnable and strategy not in out:
            out.append(strategy)
    return out


def choose_strategy(
    costs: PrefillCosts, num_tokens: int, candidates: list[str], calibration: Calibration | None = None
) -> str:
    """The strategy for a prefill chunk of `num_tokens`: the cheapest of `candidates` (ties: the first), each
    prediction times its measured / predicted scale (`Calibration.scale`). Once the cheapest has been measured at
    this size class, a candidate not measured there whose price is within `EXPLORE_MARGIN` of it
    (`EXPLORE_MARGIN_NEAR` when the candidate has been measured at another size) is taken instead (the cheapest
    such), so that it gets measured: a strategy the model overprices by less than that is found. Not where streaming
    is the measured best: its price is a layer's copy, which the model gets within ~20 % (measured / predicted
    0.78-1.13 on the lent H200 box), and an on-demand strategy that routes to nearly every expert copies the same
    bytes without the overlap; exploring there cost two long chunks of a strategy far off its price (Qwen3.5-35B-A3B,
    a 32768-token chunk under `hybrid`: 6.1x its prediction, 10.5 s of TTFT twice in one agent session)."""

    def price(c: str) -> float:
        return costs.seconds(c, num_tokens) * (calibration.scale(c, num_tokens) if calibration else 1.0)

    best = min(candidates, key=price)
    if calibration is None or not calibration.measured(best, num_tokens) or best == "stream":
        return best

    def margin(c: str) -> float:
        return EXPLORE_MARGIN_NEAR if calibration.measured_anywhere(c) else EXPLORE_MARGIN

    untried = [c for c in candidates if not calibration.measured(c, num_tokens) and price(c) <= margin(c) * price(best)]
    return min(untried, key=price) if untried else best


class Calibration:
    """Running average, per strategy and chunk size class, of a prefill chunk's measured time over the cost
    model's prediction.

    `start` and `end` bracket a chunk's forward pass with CUDA events (perf_counter on the CPU device); `poll`
    reads a finished one without waiting. Each sample moves its (strategy, class) scale by `alpha` towards
    measured / predicted, bounded to [`min_scale`, `max_scale`]. The first timing of each (strategy, class) is
    not a sample: it includes compiling that chunk size's kernels, and one inflated first sample would rule the
    strategy out for good (a strategy that loses is not run, so not measured, again). Classes are powers of 4 of the
    chunk's tokens (what the model misses differs between a 64-token extend and an 8192-token chunk).

    Args:
        device: the compute device; CUDA events on its current stream, perf_counter on the CPU.
        alpha: weight of a new sample (chunks are few, so it is large).
    """

    def __init__(
        self, device: torch.device, alpha: float = 0.3, min_scale: float = 0.25, max_scale: float = 8.0
    ) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.alpha, self.min_scale, self.max_scale = alpha, min_scale, max_scale
        self.warm: set[tuple[str, int]] = set()  # keys whose first (warm-up) timing has been seen
        self.scales: dict[tuple[str, int], float] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self._pending: tuple | None = None  # ((strategy, class), predicted seconds, start, end or None)

    @staticmethod
    def size_class(num_tokens: int) -> int:
        """floor(log4(num_tokens))."""
        return (max(num_tokens, 1).bit_length() - 1) // 2

    def scale(self, strategy: str, num_tokens: int) -> float:
        """Measured / predicted for `strategy` at chunks of this size; at a size class without samples, that of the
        nearest class with some (the larger on a tie: what a model misses varies slowly with size); 1.0 before
        any sample of `strategy`."""
        size = self.size_class(num_tokens)
        if (strategy, size) in self.scales:
            return self.scales[(strategy, size)]
        sizes = [c for s, c in self.scales if s == strategy]
        return self.scales[(strategy, min(sizes, key=lambda c: (abs(c - size), -c)))] if sizes else 1.0

    def measured(self, strategy: str, num_tokens: int) -> bool:
        """Whether `strategy` has a sample at this size class (its warm-up timing does not count)."""
        return (strategy, self.size_class(num_tokens)) in self.samples

    def measured_anywhere(self, strategy: str) -> bool:
        """Whether `strategy` has a sample at any size class."""
        return any(s == strategy for s, _ in self.samples)

    def start(self, strategy: str, num_tokens: int, predicted_s: float) -> None:
        """A chunk of `num_tokens` run with `strategy`, predicted to take `predicted_s`, starts now."""
        self.poll()
        if self._pending is not None and self._pending[3] is None:
            self._pending = None  # that chunk never reached its last MoE layer (its step failed): drop it
        if self._pending is not None:  # the last one has not finished: skip this one
            return
        self._pending = ((strategy, self.size_class(num_tokens)), predicted_s, self._now(), None)

    def end(self) -> None:
        """The chunk's last MoE layer is queued."""
        if self._pending is None or self._pending[3] is not None:
            return
        self._pending = (*self._pending[:3], self._now())
        if not self.cuda:
            self.poll()

    def _now(self) -> torch.cuda.Event | float:
        """A CUDA event recorded on the current stream, or perf_counter on the CPU device."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def poll(self) -> None:
        """Fold in the pending chunk if it has finished."""
        if self._pending is None or self._pending[3] is None:
            return
        key, predicted, begin, stop = self._pending
        if self.cuda:
            if not stop.query():
                return
            seconds = begin.elapsed_time(stop) / 1e3
        else:
            seconds = stop - begin
        self._pending = None
        if not 0 < predicted < float("inf"):  # nothing to scale (a CPU path without a CPU profile costs inf)
            return
        if key not in self.warm:
            self.warm.add(key)
            return
        ratio = min(max(seconds / predicted, self.min_scale), self.max_scale)
        old = self.scales.get(key)
        self.scales[key] = ratio if old is None else old + self.alpha * (ratio - old)
        self.samples[key] = self.samples.get(key, 0) + 1

    def stats(self) -> dict[str, dict[str, float]]:
        """{strategy: {"tokens>=4^c": scale}}, JSON-able."""
        out: dict[str, dict[str, float]] = {}
        for (strategy, size), value in sorted(self.scales.items()):
            out.setdefault(strategy, {})[f"tokens>={4**size}"] = round(value, 3)
        return out


def measure_gpu_flops(device: torch.device, tokens: int = 4096, hidden: int = 2048, inter: int = 1536) -> float:
    """The device's bf16 matmul rate (FLOP/s): the median of 5 timed [tokens, hidden] x [hidden, inter] products
    after a warm-up (a few ms in all); a stand-in for the grouped expert kernel at prefill sizes."""
    a = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    b = torch.randn(hidden, inter, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * tokens * hidden * inter / sorted(times)[len(times) // 2]


class LayerStreamer:
    """One or two full-layer expert buffers and the copies that fill them, ahead of the layer that reads them.

    Args:
        pool: the host `ExpertPool`.
        pool_experts: [num_layers * E, stride] uint8 view of its (pinned, on CUDA) arena, one expert per row,
            `[layer][expert]` (`ExpertCacheBackend.pool_experts`, which checks that layout).
        weights: [num_slots + num_buffers * E, stride] uint8 device tensor: the cache's slots, then the buffers.
        num_slots: rows of `weights` that are cache slots.
        num_buffers: 2 overlaps each layer's copy with the previous layer's compute; 1 copies, then computes.
        planner: the cache's `Planner` (read for residency, never changed here).
        copy_stream: the transfer stream (None on the CPU device, where copies are memcpy in order).

    Raises:
        ValueError: `num_buffers` not 1 or 2, or `weights` too small.
    """

    def __init__(
        self,
        pool,
        pool_experts: torch.Tensor,
        weights: torch.Tensor,
        num_slots: int,
        num_buffers: int,
        planner,
        copy_stream: torch.cuda.Stream | None,
    ) -> None:
        if num_buffers not in (1, 2):
            raise ValueError(f"layer buffers: 1 or 2, got {num_buffers}")
        e = pool.num_experts
        if weights.shape[0] < num_slots + num_buffers * e:
            raise ValueError(f"{weights.shape[0]} weight rows cannot hold {num_slots} slots and {num_buffers} layers")
        self.pool, self.pool_experts, self.weights, self.planner = pool, pool_experts, weights, planner
        self.num_slots, self.num_buffers, self.num_experts = num_slots, num_buffers, e
        self.copy_stream = copy_stream
        device = weights.device
        self.tables = torch.empty(num_buffers, e, dtype=torch.int64, device=device)
        self.layer: list[int | None] = [None] * num_buffers  # the pool layer each buffer holds (or is receiving)
        cuda = copy_stream is not None
        self.ready = [torch.cuda.Event() if cuda else None for _ in range(num_buffers)]
        self.free = [torch.cuda.Event() if cuda else None for _ in range(num_buffers)]
        self._free_recorded = [False] * num_buffers
        self.bytes_copied = 0
        self.layers_streamed = 0

    def invalidate(self) -> None:
        """Forget what the buffers hold: the slot map may have changed (their row tables point into slots)."""
        self.layer = [None] * self.num_buffers

    def _issue(self, layer: int) -> None:
        """Queue the copy of `layer`'s non-resident experts into its buffer, and its row table."""
        b = layer % self.num_buffers
        e = self.num_experts
        base = self.num_slots + b * e
        slots = self.planner.layer_slots(layer).astype(np.int64)
        absent = slots < 0
        rows = np.where(absent, base + np.arange(e), slots)
        # Runs of consecutive absent experts: one copy each (the pool and the buffer share the layout).
        edges = np.flatnonzero(np.diff(np.concatenate(([0], absent.astype(np.int8), [0]))))
        runs = edges.reshape(-1, 2)
        first = layer * e
        cuda = self.copy_stream is not None
        host_rows = torch.from_numpy(rows)
        if cuda:
            host_rows = host_rows.pin_memory()  # the caching host allocator keeps it until the copy is done
        with torch.cuda.stream(self.copy_stream) if cuda else contextlib.nullcontext():
            if cuda and self._free_recorded[b]:
                self.copy_stream.wait_event(self.free[b])  # the last kernel that read this buffer is done
            self.tables[b].copy_(host_rows, non_blocking=cuda)
            for start, end in runs.tolist():
                src = self.pool_experts[first + start : first + end]
                self.weights[base + start : base + end].copy_(src, non_blocking=cuda)
            if cuda:
                self.ready[b].record(self.copy_stream)
        self.layer[b] = layer
        self.bytes_copied += int(absent.sum()) * self.pool.expert_nbytes
        self.layers_streamed += 1

    def rows(self, layer: int, next_layer: int | None) -> torch.Tensor:
        """The weight row of every expert of `layer` ([E] int64 on the device: its slot, or its buffer row), once
        the current stream may read them; queues `next_layer`'s copy first when there are two buffers."""
        b = layer % self.num_buffers
        if self.layer[b] != layer:
            self._issue(layer)
        if next_layer is not None and self.num_buffers == 2 and self.layer[next_layer % 2] != next_layer:
            self._issue(next_layer)
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.weights.device).wait_event(self.ready[b])
        return self.tables[b]

    def done(self, layer: int) -> None:
        """Mark `layer`'s buffer free once the kernels queued so far (its readers) have run."""
        b = layer % self.num_buffers
        if self.copy_stream is not None:
            self.free[b].record(torch.cuda.current_stream(self.weights.device))
            self._free_recorded[b] = True
