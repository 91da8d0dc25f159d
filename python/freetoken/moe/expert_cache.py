"""`offload`, `cpu` and `hybrid`: routed experts live in host RAM; a cache of expert slots sits on the device.

Per MoE layer step (`shared/DESIGN.md`, "One decode step, one MoE layer"):
1. the router's top-k ids (and, when the CPU will be used, the hidden states) come to the host: one sync;
2. the Rust planner (`freetoken._core.Planner`) splits the distinct experts into hits (resident slots), fills
   (copied from the pinned host pool into a slot, evicting the policy's victim) and CPU runs, by the backend:
   `offload` fills every miss, `cpu` runs every miss on the host, `hybrid` sends the share q* of miss bytes to
   the CPU so both paths end together;
3. fills are queued on a copy stream (DMA engines, not SMs) from the pinned arena; the device computes hits and
   fills in one grouped SwiGLU over slot ids once the fills' event fires, while the host computes its experts
   with the Rust kernels (GIL released); their weighted outputs are added last.

On the CPU device the same code runs with the slots as host tensors (the "copy" is a memcpy), so CI tests the
planning and bookkeeping of every backend.

The layer step itself (plan, fills, CPU experts, and the bandwidth samples that refine q*) is one Rust type,
`freetoken._core.LayerServer` (`rust/freetoken-core/src/driver/server.rs`), called here with the GIL released for
eager and prefill steps and by the decode driver thread for captured ones: how fills and CPU experts are ordered
is written once, there. This module only moves the routing to the host and launches the slot kernel when the
server says the fills are queued. The planner refines the profile from the server's samples (an EMA of measured
/ profiled bandwidth per path, bounded to [1/4, 4]) and q* follows the box when another process loads the PCIe or
memory bus; `stats()["bandwidth"]` reads profiled against measured from it.

Decode steps captured in CUDA graphs do the same per layer without Python: the Rust decode driver thread serves
each layer through the same `LayerServer` while the graph runs (`device_handshake`, `freetoken.moe.handshake`).

Prefill chunks (`begin_step` says how many prompt tokens a step has) take the strategy that `freetoken.moe.prefill`
prices cheapest: whole-layer streaming into the layer buffers (`LayerStreamer`, no host sync, the slot cache left
as it is) or one of the on-demand plans above.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np
import torch

from freetoken._core import CpuExperts, CudaSlots, ExpertPool, LayerServer, Planner, StepReport
from freetoken.config import PREFILL_STRATEGIES
from freetoken.moe.compute import expert_views, grouped_swiglu
from freetoken.moe.handshake import DeviceHandshake
from freetoken.moe.pinned import PinnedBuffers, PinnedRegion
from freetoken.moe.prefill import (
    DEFAULT_PCIE_BYTES_PER_S,
    DEMAND_MODES,
    Calibration,
    LayerStreamer,
    PrefillCosts,
    candidate_strategies,
    choose_strategy,
    measure_gpu_flops,
)
from freetoken.quant.experts import quantized_swiglu
from freetoken.quant.formats import ExpertLayout, format_named

MODES = ("offload", "cpu", "hybrid")
# Parts of a driven decode step as the driver thread saw them (`DecodeDriver.finish`): waiting for the device's
# posts (its span of kernels), serving the posts, and within serving the plan, queueing the fills, the CPU experts
# and the fills' exposed wait.
DRIVER_PHASES = ("wait", "serve", "plan", "issue", "cpu", "fill_wait")
CPU_BLOCK_M = 16  # rows per tile of the plan's alignment on the CPU device, whose slot experts do not read it
# How long the CPU experts' workers poll for the next layer before they park: longer than the span between two MoE
# layers of a decode step (0.3-1 ms on the H200 box), so a step's CPU experts start without waking threads (20-30 us
# of a 130-300 us call, benches/cpu_experts.py). Only where the workers leave a core to the launching thread: a
# polling worker sharing its core would hold up every layer.
WORKER_IDLE_SPIN_US = 2000.0


def default_cpu_threads(device: torch.device) -> int:
    """Threads of the host expert kernels by default: every allowed CPU on the CPU device; on CUDA one fewer, because
    while the decode driver thread and its workers run a layer's CPU experts, the thread that launches the step's
    graphs waits in a spin of its own, and a worker time-sliced with it holds up the whole layer (on the 16-core H200
    box, 16 threads ran a hybrid step's CPU experts at 39 GB/s, `benches/cpu_experts.py` measures 70-90 GB/s)."""
    cpus = len(os.sched_getaffinity(0))
    return max(1, cpus - 1) if device.type == "cuda" else cpus


def bandwidth_stats(planner: Planner) -> dict:
    """JSON-able, per miss path ("pcie", "cpu"): the profiled and refined curves (GB/s by batch), the measured EMA
    (GB/s), its ratio to the profile and the samples taken, read from the planner, which does the refinement."""

    def gbps(path: str, profile: tuple[float, dict[int, float]] | None) -> dict | None:
        curve = None if profile is None else {1: profile[0]} if path == "pcie" else profile[1]
        return None if curve is None else {b: round(v / 1e9, 3) for b, v in curve.items()}

    profiled, refined = planner.profile(), planner.refined_profile()
    out = {}
    for path, (bytes_per_s, ratio, samples) in planner.bandwidth().items():
        out[path] = {
            "profiled_gbps": gbps(path, profiled),
            "refined_gbps": gbps(path, refined),
            "measured_gbps": None if bytes_per_s is None else round(bytes_per_s / 1e9, 3),
            "measured_over_profiled": None if ratio is None else round(ratio, 3),
            "num_samples": samples,
        }
    return out


class ExpertCacheBackend:
    """Experts in the host `ExpertPool`, a device cache of `num_slots` expert slots, planned per layer step.

    Args:
        mode: "offload", "cpu" or "hybrid".
        pool: the host pool, layout `[layer][expert]`, each expert in its checkpoint format (`pool.format`: bf16
            `{gate_up [2I, H], down [H, I]}`, or quantized weights and scales, `freetoken.quant.formats`); the
            slots hold the same bytes, the fills copy them, the slot kernel and the host kernels read them as stored.
        device: compute device; slots are allocated there.
        num_slots: expert slots in the cache (0 is allowed for `cpu`).
        policy: slot replacement policy of the planner ("lru", "layer_lru", "lfu").
        pcie_bytes_per_s: B_pcie, host->device expert copy bandwidth (bytes/s); needed by `hybrid`.
        cpu_bytes_per_s: B_cpu(b) as {batch: weight bytes/s}; needed by `hybrid`.
        cpu_threads: threads of the host expert kernels, the calling thread included (default:
            `default_cpu_threads`).
        layer_buffers: full-layer buffers for streaming prefill (`LayerStreamer`): 0 (none), 1 (copy, then
            compute) or 2 (double-buffered: the next layer's copy overlaps this layer's compute).
        prefill_strategy: "auto" (the cheapest by `freetoken.moe.prefill.choose_strategy`, among the strategies
            the backend can run: `freetoken.moe.prefill.candidate_strategies`), or always "stream", "fill", "cpu"
            or "hybrid".

    Raises:
        ValueError: unknown mode or strategy, no slots for a mode that fills, `hybrid` without a bandwidth
            profile, or a prefill strategy that lacks what it needs (buffers, slots, a profile).
    """

    graph_safe = False  # `forward` syncs with the host per layer; captured decode steps use `device_handshake`
    wants_weights = False  # the pool read the checkpoint itself

    def __init__(
        self,
        mode: str,
        pool: ExpertPool,
        device: torch.device,
        num_slots: int,
        policy: str = "lru",
        pcie_bytes_per_s: float | None = None,
        cpu_bytes_per_s: dict[int, float] | None = None,
        cpu_threads: int | None = None,
        layer_buffers: int = 0,
        prefill_strategy: str = "auto",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"--moe-backend {mode!r}: expected one of {', '.join(MODES)}")
        if num_slots < 1 and mode != "cpu":
            raise ValueError(f"--moe-backend {mode} needs at least one expert slot, got {num_slots}")
        if mode == "hybrid" and (pcie_bytes_per_s is None or not cpu_bytes_per_s):
            raise ValueError("--moe-backend hybrid needs a bandwidth profile (run `ft bench bw`)")
        self._check_prefill(mode, num_slots, layer_buffers, prefill_strategy, pcie_bytes_per_s, cpu_bytes_per_s)
        self.mode = mode
        self.pool = pool
        self.device = device
        self.num_slots = num_slots
        hidden, inter = pool.hidden_size, pool.intermediate_size
        self.expert_nbytes = pool.expert_nbytes
        self.layout = format_named(pool.format, pool.block).layout(hidden, inter)
        # Zero-copy view of the arena, one expert per row; the pool object stays alive as the buffer's owner.
        arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
        num_experts = pool.num_layers * pool.num_experts
        if pool.expert_offset(pool.num_layers - 1, pool.num_experts - 1) != (num_experts - 1) * pool.expert_stride:
            raise ValueError("the pool's experts are not laid out [layer][expert] at expert_stride")
        self.pool_experts = arena[: num_experts * pool.expert_stride].view(num_experts, pool.expert_stride)
        if device.type == "cuda":
            self._pinned_pool = PinnedRegion(pool.ptr, pool.nbytes, keep=pool)
        # The cache's slots, then the prefill layer buffers: one weight tensor, so one kernel reads both.
        rows = max(num_slots, 1) + layer_buffers * pool.num_experts
        self.slots = torch.empty(rows, pool.expert_stride, dtype=torch.uint8, device=device)
        self._slot_weights()
        self.planner = Planner(
            pool.num_layers,
            pool.num_experts,
            pool.expert_nbytes,
            max(num_slots, 1),
            policy=policy,
            pcie_bytes_per_s=pcie_bytes_per_s,
            cpu_bytes_per_s=cpu_bytes_per_s,
        )
        self.cpu = CpuExperts(pool, num_threads=cpu_threads or default_cpu_threads(device))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.server = self._layer_server()
        self.pool_layer = {model_layer: i for i, model_layer in enumerate(pool.moe_layers)}
        self.host = PinnedBuffers(pin=device.type == "cuda")
        self._cpu_out_dirty = True  # forward_staged's cpu_out buffer may hold a sum (unknown at first)
        self.streamer = None
        if layer_buffers:
            self.streamer = LayerStreamer(
                pool, self.pool_experts, self.slots, max(num_slots, 1), layer_buffers, self.planner, self.copy_stream
            )
        self.prefill_strategy = prefill_strategy
        self.gpu_flops_per_s = measure_gpu_flops(device) if device.type == "cuda" and layer_buffers else None
        self.demand = next(name for name, planner_mode in DEMAND_MODES.items() if planner_mode == mode)
        self.strategy = self.demand  # of the current step
        self.strategy_steps = dict.fromkeys(("stream", *DEMAND_MODES), 0)  # prefill steps only
        self.calibration = Calibration(device)
        # Driven decode steps and the driver's seconds summed over them, by part (`DecodeDriver.finish`).
        self.driven_steps = 0
        self.driver_seconds = dict.fromkeys(DRIVER_PHASES, 0.0)
        self.stream_flags = 0  # layers whose fill flag the copy stream raised after their fills

    def _slot_weights(self) -> None:
        """The slots as the bf16 kernels' stacked weights (`gate_up`, `down` views), or None for a quantized pool,
        whose kernels read the slots' bytes (`slot_swiglu`)."""
        if self.layout.format.quantized:
            self.gate_up = self.down = None
        else:
            self.gate_up, self.down = expert_views(self.slots, self.pool.hidden_size, self.pool.intermediate_size)

    def slot_swiglu(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        topk_weights: torch.Tensor,
        alignment: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The grouped SwiGLU over rows of `self.slots` (cache slots and layer buffers) in the pool's format:
        [T, H] hidden, [T, k] row ids (negative: skipped) and weights -> [T, H], into `out` when given. `alignment`
        (CUDA): the ids' tiles, when the caller has them."""
        if self.layout.format.quantized:
            return quantized_swiglu(hidden, self.slots, self.layout, ids, topk_weights, alignment=alignment, out=out)
        if not hidden.is_cuda:
            y = grouped_swiglu(hidden, self.gate_up, self.down, ids, topk_weights)
            return y if out is None else out.copy_(y)
        from freetoken.kernels.fused_moe import fused_moe

        return fused_moe(hidden, self.gate_up, self.down, ids, topk_weights, alignment=alignment, out=out)

    def _layer_server(self) -> LayerServer:
        """The Rust layer step over `self.slots`: fills by the CUDA driver API on `copy_stream`, or by memcpy into
        the host slots on the CPU device (the same code either way)."""
        rows = self.slots.shape[0]
        if self.copy_stream is None:
            return LayerServer(self.planner, self.cpu, rows, slots=self.slots.numpy().reshape(-1))
        cuda = CudaSlots(
            ordinal=self.slots.device.index,
            stream=self.copy_stream.cuda_stream,
            ptr=self.slots.data_ptr(),
            stride=self.slots.stride(0),
            rows=rows,
        )
        return LayerServer(self.planner, self.cpu, rows, cuda=cuda)

    @staticmethod
    def _check_prefill(mode, num_slots, layer_buffers, strategy, pcie, cpu) -> None:
        if strategy not in PREFILL_STRATEGIES:
            raise ValueError(f"--prefill-strategy {strategy!r}: expected auto, stream, fill, cpu or hybrid")
        if layer_buffers not in (0, 1, 2):
            raise ValueError(f"layer buffers: 0, 1 or 2, got {layer_buffers}")
        if strategy == "stream" and not layer_buffers and mode == "cpu":
            raise ValueError(
                "--prefill-strategy stream needs the offload or hybrid backend: --moe-backend cpu (what auto is on a "
                "CPU device) keeps no layer buffers"
            )
        if strategy == "stream" and not layer_buffers:
            raise ValueError("--prefill-strategy stream needs layer buffers, which the GPU budget does not leave")
        if strategy in ("fill", "hybrid") and num_slots < 1:
            raise ValueError(f"--prefill-strategy {strategy} needs expert slots (--moe-backend {mode} has none)")
        if strategy == "hybrid" and (pcie is None or not cpu):
            raise ValueError("--prefill-strategy hybrid needs a bandwidth profile (run `ft bench bw`)")

    def begin_step(self, num_tokens: int, num_prefill_tokens: int, top_k: int) -> None:
        """Choose how this step's misses are served: steps without prompt tokens (decode) use the backend's own
        plan; prefill steps the fixed `prefill_strategy`, or under "auto" the cheapest by the cost model.

        Args:
            num_tokens: tokens of the step (prompt chunks and decodes).
            num_prefill_tokens: those that are prompt tokens.
            top_k: experts per token (the model's `num_experts_per_tok`).
        """
        self.calibration.poll()
        if num_prefill_tokens == 0:
            self.strategy = self.demand
            return
        costs = self.prefill_costs(top_k)
        if self.prefill_strategy != "auto":
            self.strategy = self.prefill_strategy
        else:
            candidates = candidate_strategies(
                self.demand, self.streamer is not None, self.num_slots > 0, costs.cpu_bytes_per_s is not None
            )
            self.strategy = choose_strategy(costs, num_tokens, candidates, self.calibration)
        self.strategy_steps[self.strategy] += 1
        predicted = costs.seconds(self.strategy, num_tokens) * self.pool.num_layers
        self.calibration.start(self.strategy, num_tokens, predicted)

    def prefill_costs(self, top_k: int) -> PrefillCosts:
        """The cost model's inputs now: residency, and the refined bandwidths (a nominal PCIe rate without a
        profile or measurement)."""
        refined = self.planner.refined_profile()
        measured_pcie = self.planner.bandwidth()["pcie"][0]
        pcie_bytes_per_s = refined[0] if refined else (measured_pcie or DEFAULT_PCIE_BYTES_PER_S)
        return PrefillCosts(
            num_experts=self.pool.num_experts,
            top_k=top_k,
            expert_nbytes=self.expert_nbytes,
            resident=self.planner.num_resident / self.pool.num_layers,
            pcie_bytes_per_s=pcie_bytes_per_s,
            cpu_bytes_per_s=None if refined is None else refined[1],
            gpu_flops_per_s=self.gpu_flops_per_s,
            overlap=self.streamer is not None and self.streamer.num_buffers == 2,
        )

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Not used: the pool read the experts from the checkpoint (`wants_weights` is False)."""
        raise TypeError("ExpertCacheBackend takes its experts from its ExpertPool, not from the torch loader")

    def load_layer_quantized(self, layer: int, layout: ExpertLayout, packed: torch.Tensor) -> None:
        """Not used, as `load_layer`: the pool holds the checkpoint's quantized bytes itself."""
        raise TypeError("ExpertCacheBackend takes its experts from its ExpertPool, not from the torch loader")

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """See `ExpertBackend.forward`: [T, H] hidden, [T, k] ids and weights -> [T, H]."""
        pool_layer = self.pool_layer[layer]
        out = self._forward(pool_layer, hidden, topk_ids, topk_weights)
        if pool_layer == self.pool.num_layers - 1:
            self.calibration.end()
        return out

    def _forward(
        self, pool_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.strategy == "stream":
            return self._stream(pool_layer, hidden, topk_ids, topk_weights)
        num_tokens, k = topk_ids.shape
        cuda = hidden.is_cuda
        host_ids = self.host.get("ids", (num_tokens, k), torch.int64)
        host_ids.copy_(topk_ids, non_blocking=cuda)
        host_weights = self.host.get("weights", (num_tokens, k), torch.float32)
        host_hidden = self.host.get("hidden", (num_tokens, hidden.shape[1]), torch.float32)
        # Offload needs them only when every slot is pinned (rare): the server fetches them then.
        ready = DEMAND_MODES[self.strategy] != "offload" or not cuda
        if ready:
            host_weights.copy_(topk_weights, non_blocking=cuda)
            host_hidden.copy_(hidden, non_blocking=cuda)
        out, host_out = self._serve(pool_layer, hidden, topk_weights, host_ids, host_weights, host_hidden, ready, None)
        if host_out is None:
            return out if out is not None else torch.zeros_like(hidden)
        cpu_out = host_out.to(self.device, hidden.dtype, non_blocking=True)
        return cpu_out if out is None else out + cpu_out

    def forward_staged(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        host_ids: torch.Tensor,
        host_weights: torch.Tensor,
        host_hidden: torch.Tensor,
        out: torch.Tensor,
        cpu_out: torch.Tensor,
    ) -> None:
        """`forward` for the piecewise CUDA-graph decode step, whose captured span already queued the copies of
        the routing and the hidden states into pinned host buffers (no copy calls here).

        Args:
            layer: decoder layer.
            hidden: [B, H] device hidden states (model dtype); topk_weights: [B, k] on the device.
            host_ids: [B, k] int64, host_weights: [B, k] float32, host_hidden: [B, H] float32: pinned host copies
                of the ids, weights and hidden states, queued on the current stream before this call.
            out: [B, H] device buffer for the slot experts' sum (zeros when none ran).
            cpu_out: [N >= B, H] float32 device buffer whose first B rows get the CPU experts' sum; all of it is
                zero when none ran (it is added to every row of the next captured span).
        """
        pool_layer = self.pool_layer[layer]
        _, host_out = self._serve(pool_layer, hidden, topk_weights, host_ids, host_weights, host_hidden, True, out)
        if host_out is not None:
            cpu_out[: host_out.shape[0]].copy_(host_out, non_blocking=True)
            self._cpu_out_dirty = True
        elif self._cpu_out_dirty:
            cpu_out.zero_()
            self._cpu_out_dirty = False

    def _serve(
        self,
        pool_layer: int,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        host_ids: torch.Tensor,
        host_weights: torch.Tensor,
        host_hidden: torch.Tensor,
        ready: bool,
        out: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One on-demand layer step once its inputs' host copies are queued: sync, then the Rust `LayerServer`
        (GIL released) plans, queues the fills and runs the CPU experts; the slot kernel is launched on the device
        as soon as the fills are queued (`on_fills_queued`, so it overlaps the CPU experts), on the CPU device after
        the server returns. `ready`: the host weights and hidden states are valid (else the server fetches them
        if it needs them). Returns (the slot experts' sum, or None when no slot ran and no `out` was given; the
        pinned float32 host sum of the CPU experts, or None)."""
        cuda = hidden.is_cuda
        stream = torch.cuda.current_stream(self.device) if cuda else None
        if stream is not None:
            stream.synchronize()  # ids (and weights, hidden when ready) are on the host now
        num_tokens, k = host_ids.shape
        if cuda:
            from freetoken.kernels.fused_moe import block_m_for

            block_m = block_m_for(num_tokens * k)
        else:
            block_m = CPU_BLOCK_M
        ns, nr, nt = self.server.plan_layout(num_tokens, k, block_m)
        plan = self.host.get("plan", (ns + nr + 2 * nt,), torch.int64)
        host_out = self.host.get("out", tuple(host_hidden.shape), torch.float32)
        plan_np = plan.numpy()
        result: list[torch.Tensor | None] = [out]

        def slot_experts(num_fills: int) -> None:
            """The grouped SwiGLU over the picks resident in slots (-1 where the CPU runs them), into `out`."""
            if not (plan_np[:ns] >= 0).any():
                if out is not None:
                    out.zero_()
                return
            if not cuda:
                slots = torch.from_numpy(plan_np[:ns].copy()).view(num_tokens, k)
                result[0] = self.slot_swiglu(hidden, slots, topk_weights, out=out)
                return
            if num_fills:
                stream.wait_stream(self.copy_stream)  # the fills, queued on the copy stream by the server
            # Slot ids and the kernel's tile alignment (made on the host, where they are known already) in one
            # copy through the reused pinned buffer: no alignment kernels, no copy from pageable memory.
            dev = plan[: ns + nr + nt].to(self.device, non_blocking=True)
            alignment = (dev[ns : ns + nr], dev[ns + nr :])
            slots = dev[:ns].view(num_tokens, k)
            result[0] = self.slot_swiglu(hidden, slots, topk_weights, alignment=alignment, out=out)

        def fetch_inputs() -> None:
            host_hidden.copy_(hidden)
            host_weights.copy_(topk_weights)

        report = self.server.serve(
            pool_layer,
            DEMAND_MODES[self.strategy],
            host_ids.numpy(),
            host_weights.numpy(),
            host_hidden.numpy(),
            plan_np,
            host_out.numpy().reshape(-1),
            block_m,
            inputs_ready=ready,
            on_fills_queued=slot_experts if cuda else None,
            fetch_inputs=fetch_inputs,
        )
        if not cuda:
            slot_experts(report.num_fills)
        if report.num_fills and self.streamer is not None:
            self.streamer.invalidate()  # evictions: the buffers' row tables may point at stale slots
        return result[0], host_out if report.num_cpu else None

    def _stream(
        self, pool_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert of the layer from its slot or its layer buffer (copied ahead by the streamer); no host sync."""
        last = pool_layer + 1 == self.pool.num_layers
        rows = self.streamer.rows(pool_layer, None if last else pool_layer + 1)
        if hidden.is_cuda:
            from freetoken.kernels.fused_moe import align_pairs, block_m_for

            # Tiles aligned over the layer's E experts, then each tile's expert mapped to its weight row: aligning
            # over every row (slots and buffers) would size the kernel's tiles and scratch for ~15x more groups.
            pairs, tiles = align_pairs(topk_ids, self.pool.num_experts, block_m_for(topk_ids.numel()))
            tiles = torch.where(tiles >= 0, rows[tiles.clamp(min=0)], tiles)
            out = self.slot_swiglu(hidden, topk_ids, topk_weights, alignment=(pairs, tiles))
        else:
            out = self.slot_swiglu(hidden, rows[topk_ids], topk_weights)
        self.streamer.done(pool_layer)
        return out

    def resize(self, num_slots: int, allocate: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Change the cache to `num_slots` slots at a safe point (no step in flight, no decode driver holding the
        slots' address: `freetoken.engine.resize` drops it first). The planner keeps the residents that fit, the
        most valuable by its policy (`Planner.resize`), and each is copied again from the pinned pool, the source of
        truth, so the old slots are released before the new ones are allocated. The prefill layer buffers follow.

        Args:
            num_slots: slots of the new cache, >= 1.
            allocate: `torch.empty`'s signature: where the new slots are allocated (a test injects an OOM here).

        Raises:
            torch.OutOfMemoryError (or the CPU allocator's RuntimeError): the new slots did not fit; the cache is
                back at its old size with its residents (rolled back) before this raises.
        """
        if num_slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {num_slots}")
        buffers = 0 if self.streamer is None else self.streamer.num_buffers
        streamed = (0, 0) if self.streamer is None else (self.streamer.layers_streamed, self.streamer.bytes_copied)
        rows = lambda n: n + buffers * self.pool.num_experts
        old = self.num_slots
        self.slots = self.gate_up = self.down = self.streamer = None  # type: ignore[assignment]  # freed, rebuilt below
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            slots = allocate((rows(num_slots), self.pool.expert_stride), dtype=torch.uint8, device=self.device)
        except Exception:
            self._install_slots(
                allocate((rows(old), self.pool.expert_stride), dtype=torch.uint8, device=self.device),
                old,
                buffers,
                streamed,
            )
            raise
        self.planner.resize(num_slots)
        self._install_slots(slots, num_slots, buffers, streamed)

    def _install_slots(self, slots: torch.Tensor, num_slots: int, buffers: int, streamed: tuple[int, int]) -> None:
        """Take `slots` as the cache and layer buffers, and copy every resident expert from the pool into its slot."""
        self.slots, self.num_slots = slots, num_slots
        self._slot_weights()
        self.server = self._layer_server()  # its copier holds the slots' address
        if buffers:
            self.streamer = LayerStreamer(
                self.pool, self.pool_experts, slots, num_slots, buffers, self.planner, self.copy_stream
            )
            self.streamer.layers_streamed, self.streamer.bytes_copied = streamed
        e = self.pool.num_experts
        for layer in range(self.pool.num_layers):
            layer_slots = self.planner.layer_slots(layer)
            experts = np.flatnonzero(layer_slots >= 0)
            with torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext():
                for expert, slot in zip(experts.tolist(), layer_slots[experts].tolist(), strict=True):
                    slots[slot].copy_(self.pool_experts[layer * e + expert], non_blocking=True)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def stale_slots(self) -> list[tuple[int, int, int]]:
        """(pool layer, expert, slot) of every expert the planner counts resident whose slot does not hold the pool's
        bytes of it: empty unless a fill was lost, is still landing, or was overwritten while the expert stayed
        resident. A consistency check for tests and `benches/diag_evict_stress.py`; call it between steps (it
        synchronizes the device first, so copies queued earlier have landed)."""
        if self.copy_stream is not None:
            torch.cuda.synchronize(self.device)
        e, n = self.pool.num_experts, self.expert_nbytes
        stale: list[tuple[int, int, int]] = []
        for layer in range(self.pool.num_layers):
            layer_slots = self.planner.layer_slots(layer).astype(np.int64)
            experts = np.flatnonzero(layer_slots >= 0)
            if not experts.size:
                continue
            want = self.pool_experts[torch.from_numpy(layer * e + experts)][:, :n].to(self.device)
            got = self.slots[torch.from_numpy(layer_slots[experts]).to(self.device)][:, :n]
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            stale.extend((layer, int(experts[i]), int(layer_slots[experts[i]])) for i in bad)
        return stale

    def device_handshake(self, top_k: int, sizes: list[int]) -> DeviceHandshake:
        """The handshake of the decode driver over this backend's layer server and slots (`freetoken.moe.handshake`),
        for padded batch sizes `sizes`. Raises ValueError on the CPU device, which has no CUDA graphs."""
        if self.copy_stream is None:
            raise ValueError("the decode driver's handshake needs a CUDA device")
        if self.cpu.num_threads < len(os.sched_getaffinity(0)):  # a core each for the workers, driver and launcher
            self.cpu.idle_spin_us = WORKER_IDLE_SPIN_US
        return DeviceHandshake(
            self.server, self.mode, self.slots, self.pool.moe_layers, self.pool.hidden_size, top_k, sizes
        )

    def run_slots(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        sorted_pairs: torch.Tensor,
        tile_stages: torch.Tensor,
        out: torch.Tensor | None,
        before_stage: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The grouped SwiGLU (Triton) over slot ids already aligned on the device, their tiles in stages run in
        turn (`fused_moe_tiles`, or `fused_moe_quant_tiles` for a quantized pool; the decode driver's hits, then
        its fills after `before_stage(1)`): [T, H], written into `out` when given."""
        if self.layout.format.quantized:
            from freetoken.kernels.fused_moe_quant import fused_moe_quant_tiles

            return fused_moe_quant_tiles(
                hidden, self.slots, self.layout, topk_weights, sorted_pairs, tile_stages, out, before_stage
            )
        from freetoken.kernels.fused_moe import fused_moe_tiles

        return fused_moe_tiles(
            hidden, self.gate_up, self.down, topk_weights, sorted_pairs, tile_stages, out=out, before_stage=before_stage
        )

    def after_driven_step(self, report: StepReport) -> None:
        """Book a driven decode step's report (the server gave the planner its bandwidth samples already): the
        driver's time by phase, and invalidated layer-buffer tables when slots changed."""
        self.driven_steps += 1
        for phase in DRIVER_PHASES:
            self.driver_seconds[phase] += getattr(report, f"{phase}_seconds")
        self.stream_flags += report.stream_flags
        if report.fills and self.streamer is not None:
            self.streamer.invalidate()

    def after_failed_driven_step(self) -> None:
        """A driven decode step failed part way: its fills may have moved slots, so the layer buffers' row tables
        are stale."""
        if self.streamer is not None:
            self.streamer.invalidate()

    def stats(self) -> dict:
        """Per-layer planner counters (lists over pool layers), the cache's size, the host kernels' threads and
        instruction set, the bandwidths of both miss paths, profiled against measured (`bandwidth_stats`),
        and the decode driver's time per step by phase, JSON-able."""
        counters = {name: values.tolist() for name, values in self.planner.stats().items()}
        return {
            "backend": self.mode,
            "num_slots": self.num_slots,
            "num_resident": self.planner.num_resident,
            "expert_nbytes": self.expert_nbytes,
            "expert_format": self.layout.format.name,
            "cpu_threads": self.cpu.num_threads,
            "cpu_isa": self.cpu.isa,
            "bandwidth": bandwidth_stats(self.planner),
            "decode_driver": {
                "steps": self.driven_steps,
                "fill_flags_by_copy_stream": self.stream_flags,
                "ms_per_step": {
                    phase: round(1e3 * v / max(1, self.driven_steps), 3) for phase, v in self.driver_seconds.items()
                },
            },
            "prefill": {
                "strategy": self.prefill_strategy,
                "layer_buffers": 0 if self.streamer is None else self.streamer.num_buffers,
                "steps_by_strategy": dict(self.strategy_steps),
                "measured_over_predicted": self.calibration.stats(),
                "layers_streamed": 0 if self.streamer is None else self.streamer.layers_streamed,
                "bytes_streamed": 0 if self.streamer is None else self.streamer.bytes_copied,
            },
            "layers": counters,
        }
