"""Decode throughput of every expert backend at consumer-GPU memory budgets, on the real Qwen3-30B-A3B config.

Rows: `fused` (all experts on the GPU: the ceiling), `offload`, `cpu`, `hybrid`, and `static`, a baseline like
llama.cpp's `--n-cpu-moe` (the experts of as many whole layers as the budget holds on the GPU, the rest on the
CPU with the same Rust kernels). Budgets (`--budgets`, GB: non-expert weights + KV cache + expert slots) and
batch sizes (`--batch`). Weights are seeded random (`ExpertPool.random`, 58 GB of bf16 experts); routing is
replayed from a synthetic trace calibrated to published statistics (`freetoken._core.synthetic_trace`: Zipf
skew 0.45 (busiest expert ~4.4x the uniform share), reuse 0.35 within a 16-step window), because random
routers route almost uniformly, which would understate locality. The trace replaces the routers' ids on the
device (`freetoken.moe.routing_replay`, what `ft serve --replay-routing synthetic` runs), so every row, captured
graphs included, sees the same routing.

    python benches/moe_backends.py [--budgets 16 24 32] [--batch 1 4] [--steps 32] [--warmup 16]
        [--format bf16 fp8 nvfp4 mxfp4]

`--format` runs every row once per expert format, the experts stored as the real checkpoints store them (FP8 with
128 x 128 block scales, NVFP4 with e4m3 scales per 16 and a float32 scale per tensor, MXFP4 with e8m0 scales per
32; seeded random codes, `ExpertPool.random(format=...)`): the pool, the slots and every copy hold the format's
bytes, the host kernels and the slot kernel read them as stored, and the bandwidths the planner and the bound use
are measured on that format's pool (its own copy and host-kernel rates). Each row names its format; the JSON ends
with each format's tok/s over bf16's at the same budget, batch and backend (`vs_bf16`).

Prints a table (decode tok/s, hit rate, PCIe and CPU bytes per token, the bound from those bytes over the
measured bandwidths, achieved/bound, peak GPU memory; for the expert cache also the bandwidths it measured, where
the decode driver's time went per step, and the host-overhead share of the step) and a final JSON line. Needs
CUDA.

The bound of a row is the longest of three times, each the row's miss bytes per step over a measured capacity:
PCIe bytes over B_pcie (copies alone), CPU bytes over B_cpu(b) (host kernel alone), and both together over the
host memory bus: B_both(b), what the two paths moved per second when run at once (`measure_overlapped`), or either
path's own figure where that is more. b is the trace's mean tokens per routed expert of a layer step (about 1 at
batch 1 to 4), rounded to a measured b. The copies and the host kernel read the same host DRAM, so on a box whose
memory bus is narrower than the two paths' sum the third term binds; it is an estimate, from one mix of the two.
`bound_by` names the term that binds; `achieved_over_paths_bound` is the ratio against the first two alone (the
paths as if independent).

The box is shared, and its memory bandwidth drifts by tens of percent within a run, so the three capacities of a
row's bound are measured side by side with the row: just before its timed steps and just after them, the larger
of the two (`row_gbps`). The figures measured at the start, each the best of `BANDWIDTH_RUNS` runs, give the
planner its profile and the JSON header, and `achieved_over_start_bound` is the ratio against a bound from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

from freetoken._core import CpuExperts, ExpertPool
from freetoken.bench.bandwidth import measure_cpu, measure_overlapped, measure_pcie
from freetoken.config import EXPERT_CACHE_POLICIES, EngineConfig, ModelConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.loader import init_dummy_weights
from freetoken.models.presets import preset_config_path
from freetoken.moe.budget import plan_expert_slots
from freetoken.moe.compute import expert_views, grouped_swiglu
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from freetoken.moe.pinned import PinnedRegion
from freetoken.moe.routing_replay import install_trace, synthetic_tables
from freetoken.quant.experts import quantized_swiglu
from freetoken.quant.formats import ExpertFormat, format_named

# `--format` names: the checkpoint formats of the released models (Qwen FP8: 128 x 128 blocks; ModelOpt NVFP4).
FORMATS = {
    "bf16": ("bf16", (0, 0)),
    "fp8": ("fp8_block", (128, 128)),
    "nvfp4": ("nvfp4", (0, 0)),
    "mxfp4": ("mxfp4", (0, 0)),
}

BANDWIDTH_RUNS = 3  # each bandwidth measured at the start is the best of this many ~1 s runs
ROW_BANDWIDTH_S = 0.5  # seconds of each bandwidth run beside a row (three before its timed steps, three after)
ROW_SCRATCH_SLOTS = 16  # device expert slots the PCIe runs beside a row copy into


class StaticLayers:
    """llama.cpp `--n-cpu-moe`-like placement: layers [0, n) keep all experts on the GPU, the rest run on the CPU."""

    graph_safe = False
    wants_weights = False

    def __init__(self, pool: ExpertPool, gpu_arena: torch.Tensor, num_gpu_layers: int, cpu: CpuExperts):
        self.pool, self.cpu, self.num_gpu_layers = pool, cpu, num_gpu_layers
        per_layer = gpu_arena.view(num_gpu_layers, pool.num_experts, -1) if num_gpu_layers else []
        self.layout = format_named(pool.format, pool.block).layout(pool.hidden_size, pool.intermediate_size)
        if self.layout.format.quantized:
            self.layers = list(per_layer)
        else:
            self.weights = [expert_views(layer, pool.hidden_size, pool.intermediate_size) for layer in per_layer]
        self.pool_layer = {layer: n for n, layer in enumerate(pool.moe_layers)}
        self.bytes_cpu = 0

    def begin_step(self, num_tokens, num_prefill_tokens, top_k):
        pass

    def stats(self):
        return {"backend": "static", "bytes_cpu": self.bytes_cpu}

    def forward(self, layer, hidden, topk_ids, topk_weights):
        li = self.pool_layer[layer]
        if li < self.num_gpu_layers and self.layout.format.quantized:
            return quantized_swiglu(hidden, self.layers[li], self.layout, topk_ids, topk_weights)
        if li < self.num_gpu_layers:
            return grouped_swiglu(hidden, *self.weights[li], topk_ids, topk_weights)
        x = hidden.float().cpu().numpy()
        ids = topk_ids.cpu().numpy()
        out = np.zeros_like(x)
        experts = np.unique(ids)
        self.cpu.forward(li, x, ids, topk_weights.float().cpu().numpy(), experts, out)
        self.bytes_cpu += len(experts) * self.pool.expert_nbytes
        return torch.from_numpy(out).to(hidden.device, hidden.dtype)


def run_decode(
    engine: LLMEngine, clock: torch.Tensor, backend, batch: int, warmup: int, steps: int
) -> tuple[list[float], dict]:
    """Step times (s) of `steps` decode steps after a prefill and `warmup` steps, and the backend's counters
    at the start of the measured steps. `clock` (the replayed trace's) is reset after the prefill, so the decode
    steps replay the trace from its first step."""
    params = SamplingParams(max_tokens=warmup + steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(1 + i, 33 + i)), params)
    engine.step()  # prefill
    clock.zero_()
    times = []
    for n in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if n == warmup - 1:
            start_stats = snapshot(backend)
        if n >= warmup:
            times.append(time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    return times, start_stats


def profile_steps(engine: LLMEngine, backend, batch: int, log) -> float | None:
    """Where 4 warm decode steps spend their time: the profiler's top ops by CPU and by GPU time (logged), and the
    share of the steps' wall time outside every device kernel and copy and the host expert kernels
    (`cpu_experts` ranges): the union of those intervals against each step's span. In a driven step the device's
    waits for the driver (`_wait_fetch`) do not count as kernel time, and the driver's CPU experts and its exposed
    waits for fills (a Rust thread, unseen by the profiler: its own timings) count as covered; the device mostly
    idles then, save the slot kernel, which runs while the CPU experts do (its time, ~30 us a layer at batch 1, is
    counted twice, which lowers the share by as much). The profiler's own cost per op counts as outside, which
    raises it. None when the trace has no device events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", list(range(1 + i, 33 + i)), params)
    for _ in range(7):  # prefill and warm-up
        engine.step()
    before = snapshot(backend)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            with record_function("decode_step"):
                engine.step()
                torch.cuda.synchronize()
    after = snapshot(backend)
    driver_busy_us = 1e6 * sum(after.get(k, 0.0) - before.get(k, 0.0) for k in ("driver_cpu", "driver_fill_wait"))
    while engine.has_work():
        engine.step()
    for key in ("self_cpu_time_total", "self_cuda_time_total"):
        log(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50))
    events = prof.events()
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == "decode_step"]
    busy = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name != "decode_step"
        and "_wait_fetch" not in e.name
        and (e.device_type == DeviceType.CUDA or e.name == "cpu_experts")
    )
    if not steps or not any(e.device_type == DeviceType.CUDA for e in events):
        return None
    covered = 0.0
    for lo, hi in steps:
        end = lo
        for start, stop in busy:
            start, stop = max(start, end), min(stop, hi)
            if stop > start:
                covered += stop - start
                end = stop
    total = sum(hi - lo for lo, hi in steps)
    return max(0.0, 1.0 - (covered + driver_busy_us) / total)


def cprofile_steps(engine: LLMEngine, batch: int, log) -> None:
    """Python's own profile of 8 warm decode steps: the 25 functions with the most time of their own (the host
    work between CUDA calls that the torch profiler reports only as its callers' self time)."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"c{i}", list(range(1 + i, 33 + i)), params)
    for _ in range(7):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    while engine.has_work():
        engine.step()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    log(out.getvalue())


def bandwidths_now(cpu: CpuExperts, pool: ExpertPool, arena: torch.Tensor, device: torch.device, b: int) -> dict:
    """The three capacities of a bound, measured now (bytes/s): B_pcie, B_cpu(b) and B_both(b), one run of
    `ROW_BANDWIDTH_S` each, through a scratch of `ROW_SCRATCH_SLOTS` device slots freed afterwards."""
    scratch = torch.empty(ROW_SCRATCH_SLOTS, pool.expert_stride, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream()
    now = {
        "pcie": measure_pcie(pool, arena, scratch, stream, seconds=ROW_BANDWIDTH_S),
        "cpu": measure_cpu(cpu, pool, b, seconds=ROW_BANDWIDTH_S),
        "both": sum(measure_overlapped(cpu, pool, arena, scratch, stream, b, seconds=ROW_BANDWIDTH_S)),
    }
    del scratch
    torch.cuda.empty_cache()
    return now


def bound_terms(h2d: float, cpu_b: float, bw: dict) -> dict[str, float]:
    """Seconds per token of each term of the bound (module docstring) for `h2d` PCIe and `cpu_b` CPU bytes per
    token, over capacities `bw` (bytes/s: pcie, cpu, both). The shared bus moves at least what either path alone
    was seen to move."""
    bus = max(bw["both"], bw["pcie"], bw["cpu"])
    return {"pcie": h2d / bw["pcie"], "cpu": cpu_b / bw["cpu"], "host_memory": (h2d + cpu_b) / bus}


def snapshot(backend) -> dict:
    if isinstance(backend, ExpertCacheBackend):
        s = backend.planner.stats()
        counters = {k: int(v.sum()) for k, v in s.items()}
        counters["driven_steps"] = backend.driven_steps
        counters["stream_flags"] = backend.stream_flags
        counters.update({f"driver_{k}": v for k, v in backend.driver_seconds.items()})
        return counters
    if isinstance(backend, StaticLayers):
        return {"bytes_cpu": backend.bytes_cpu}
    return {}


def run_format(fmt: ExpertFormat, args: argparse.Namespace, cfg: ModelConfig, log) -> tuple[list[dict], dict]:
    """Every row of the bench with the experts in `fmt`: (the rows, the format's bandwidths measured at the start
    and its expert size). The pool, its pinned registration and the model are freed when this returns."""
    device = torch.device("cuda")
    layers = cfg.moe_layers
    t0 = time.perf_counter()
    pool = ExpertPool.random(
        len(layers),
        cfg.num_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        moe_layers=layers,
        format=fmt.name,
        block=(fmt.block_rows, fmt.block_cols),
    )
    arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
    _pinned = PinnedRegion(pool.ptr, pool.nbytes, keep=pool)  # registered while this format's rows run
    per_layer = cfg.num_experts * pool.expert_stride
    assert pool.expert_offset(1, 0) == per_layer, "the views below assume [layer][expert] at expert_stride"
    log(f"{fmt.name} pool: {pool.nbytes / 1e9:.1f} GB built and pinned in {time.perf_counter() - t0:.0f} s")
    cpu = CpuExperts(pool)
    scratch = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
    # Best of a few runs each: the box is shared, and a bound must use the most the box was seen to do.
    best = lambda measure: max(measure() for _ in range(args.bandwidth_runs))
    # The lambdas bind `b` and `scratch` as defaults: each runs within its iteration; `scratch` is deleted below.
    b_pcie = best(lambda s=scratch: measure_pcie(pool, arena, s, torch.cuda.Stream()))
    b_cpu = {b: best(lambda b=b: measure_cpu(cpu, pool, b)) for b in (1, 2, 4, 8, 16)}
    b_both = {
        b: best(lambda b=b, s=scratch: sum(measure_overlapped(cpu, pool, arena, s, torch.cuda.Stream(), b)))
        for b in b_cpu
    }
    del scratch
    log(
        f"{fmt.name}: B_pcie {b_pcie / 1e9:.1f} GB/s; B_cpu "
        + ", ".join(f"b={b}: {v / 1e9:.1f} GB/s" for b, v in b_cpu.items())
        + "; B_both "
        + ", ".join(f"b={b}: {v / 1e9:.1f} GB/s" for b, v in b_both.items())
    )

    model = init_dummy_weights(
        cfg, ExpertCacheBackend("cpu", pool, device, 0, cpu_threads=None), device, torch.bfloat16
    )
    rows = []
    for batch in args.batch:
        total = args.warmup + args.steps + 8
        tables = synthetic_tables(len(layers), cfg.num_experts, cfg.num_experts_per_tok, total, batch=batch, seed=batch)
        # Tokens per routed expert of a layer step, the b of B_cpu(b) and B_both(b) in the bound.
        per_expert = statistics.mean(
            ids.size / np.unique(ids).size for table in tables for ids in table.reshape(total, -1)
        )
        b_near = min(b_cpu, key=lambda b: abs(b - per_expert))
        for backend_name in args.backends:
            for budget in args.budgets if backend_name not in ("fused", "cpu") else [0.0]:
                engine_cfg = EngineConfig(
                    device="cuda",
                    dtype="bfloat16",
                    moe_backend="fused" if backend_name == "fused" else "cpu",
                    max_num_seqs=batch,
                    max_model_len=1024,
                    kv_cache_gb=0.5,
                    gpu_memory_gb=budget,
                )
                model.attach_experts(FusedExperts())  # the last row's backend goes before this one's is built
                gc.collect()
                torch.cuda.empty_cache()
                gpu_arena = None
                if backend_name == "fused":
                    gpu_arena = arena[: len(layers) * per_layer].to(device)
                    inner = FusedExperts()
                    fused_layers = gpu_arena.view(len(layers), cfg.num_experts, -1)
                    layout = fmt.layout(cfg.hidden_size, cfg.moe_intermediate_size)
                    for li, layer in enumerate(layers):
                        if fmt.quantized:
                            inner.load_layer_quantized(layer, layout, fused_layers[li])
                        else:
                            inner.load_layer(
                                layer, *expert_views(fused_layers[li], cfg.hidden_size, cfg.moe_intermediate_size)
                            )
                    del fused_layers
                elif backend_name == "static":
                    # No prefill layer buffers: llama.cpp's placement keeps whole layers, nothing else.
                    static_cfg = dataclasses.replace(engine_cfg, prefill_strategy="fill")
                    slots, _ = plan_expert_slots(static_cfg, cfg, torch.bfloat16, pool.expert_stride, "offload")
                    n_layers = min(len(layers), slots // cfg.num_experts)
                    gpu_arena = arena[: n_layers * per_layer].to(device) if n_layers else None
                    inner = StaticLayers(pool, gpu_arena, n_layers, cpu)
                else:
                    slots, buffers = plan_expert_slots(
                        engine_cfg, cfg, torch.bfloat16, pool.expert_stride, backend_name
                    )
                    inner = ExpertCacheBackend(
                        backend_name,
                        pool,
                        device,
                        slots,
                        pcie_bytes_per_s=b_pcie,
                        cpu_bytes_per_s=b_cpu,
                        layer_buffers=buffers,
                        cpu_threads=args.cpu_threads or None,
                        policy=args.policy,
                    )
                model.attach_experts(inner)
                clock = install_trace(model, tables, "synthetic")
                torch.cuda.reset_peak_memory_stats()
                t_row = time.perf_counter()
                engine = LLMEngine(model, cfg, engine_cfg, tokenizer=None)
                log(
                    f"{fmt.name} {backend_name} b={batch} {budget} GB: engine ready (graphs captured) in "
                    f"{time.perf_counter() - t_row:.0f} s"
                )
                outside = None
                if args.profile:
                    outside = profile_steps(engine, inner, batch, log)
                    engine = LLMEngine(model, cfg, engine_cfg, tokenizer=None)
                if args.cprofile:
                    cprofile_steps(engine, batch, log)
                    engine = LLMEngine(model, cfg, engine_cfg, tokenizer=None)
                built_peak = torch.cuda.max_memory_allocated()
                bw_before = bandwidths_now(cpu, pool, arena, device, b_near)
                torch.cuda.reset_peak_memory_stats()  # the bandwidth runs' scratch is not the backend's
                times, before = run_decode(engine, clock, inner, batch, args.warmup, args.steps)
                after = snapshot(inner)
                peak_gb = max(built_peak, torch.cuda.max_memory_allocated()) / 1e9
                bw_after = bandwidths_now(cpu, pool, arena, device, b_near)
                row_bw = {k: max(bw_before[k], bw_after[k]) for k in bw_before}
                tokens = batch * args.steps
                step_s = statistics.median(times)
                h2d = (after.get("bytes_h2d", 0) - before.get("bytes_h2d", 0)) / tokens
                cpu_b = (after.get("bytes_cpu", 0) - before.get("bytes_cpu", 0)) / tokens
                hits = after.get("hits", 0) - before.get("hits", 0)
                lookups = hits + sum(after.get(k, 0) - before.get(k, 0) for k in ("fills", "cpu_runs"))
                # Per step; the paths overlap, and share the host memory bus (see the module docstring).
                terms = bound_terms(h2d, cpu_b, row_bw)
                paths_s = max(terms["pcie"], terms["cpu"]) * batch
                bound_s = max(terms.values()) * batch
                start_bw = {"pcie": b_pcie, "cpu": b_cpu[b_near], "both": b_both[b_near]}
                start_s = max(bound_terms(h2d, cpu_b, start_bw).values()) * batch
                row = {
                    "format": fmt.name,
                    "backend": backend_name,
                    "budget_gb": budget,
                    "batch": batch,
                    "tok_per_s": round(batch / step_s, 2),
                    "step_ms": round(step_s * 1e3, 2),
                    "hit_rate": round(hits / lookups, 3) if lookups else None,
                    "pcie_mb_per_tok": round(h2d / 1e6, 1),
                    "cpu_mb_per_tok": round(cpu_b / 1e6, 1),
                    "bound_ms": round(bound_s * 1e3, 2),
                    "achieved_over_bound": round(bound_s / step_s, 2) if bound_s else None,
                    "bound_by": max(terms, key=terms.get) if bound_s else None,
                    "achieved_over_paths_bound": round(paths_s / step_s, 2) if paths_s else None,
                    "achieved_over_start_bound": round(start_s / step_s, 2) if start_s else None,
                    "row_gbps": {k: round(v / 1e9, 1) for k, v in row_bw.items()},
                    "peak_gpu_gb": round(peak_gb, 2),
                }
                if outside is not None:
                    row["outside_share"] = round(outside, 3)
                if isinstance(inner, ExpertCacheBackend):  # what the miss paths ran at, as the backend measured
                    bw = inner.stats()["bandwidth"]
                    row["measured_gbps"] = {path: bw[path]["measured_gbps"] for path in ("pcie", "cpu")}
                    steps = after["driven_steps"] - before["driven_steps"]
                    if steps:  # where the driver thread's time went, ms per step (mean of the measured steps)
                        row["driver_ms"] = {
                            k: round(1e3 * (after[f"driver_{k}"] - before[f"driver_{k}"]) / steps, 2)
                            for k in inner.driver_seconds
                        }
                        flags = after["stream_flags"] - before["stream_flags"]
                        row["stream_flags_per_step"] = round(flags / steps, 1)
                        # Host overhead: the step less the device's spans (the driver's wait: kernels, and the
                        # handshake's latencies, so this is a lower bound), the CPU experts and the exposed fills.
                        busy = sum(row["driver_ms"][k] for k in ("wait", "cpu", "fill_wait"))
                        row["host_overhead_share"] = round(max(0.0, 1.0 - busy / row["step_ms"]), 3)
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                del engine, inner, gpu_arena
    model.attach_experts(FusedExperts())  # the pool, its pinned registration and the model go on return
    figures = {
        "b_pcie_gbps": round(b_pcie / 1e9, 1),
        "b_cpu_gbps": {b: round(v / 1e9, 1) for b, v in b_cpu.items()},
        "b_both_gbps": {b: round(v / 1e9, 1) for b, v in b_both.items()},
        "expert_nbytes": pool.expert_nbytes,
    }
    return rows, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--budgets", type=float, nargs="+", default=[16, 24, 32])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--backends", nargs="+", default=["fused", "static", "offload", "cpu", "hybrid"])
    ap.add_argument(
        "--bandwidth-runs",
        type=int,
        default=BANDWIDTH_RUNS,
        help="runs of each bandwidth measured at the start of a format, the best taken (1 for a quick look)",
    )
    ap.add_argument(
        "--format",
        nargs="+",
        default=["bf16"],
        choices=list(FORMATS),
        help="expert formats to run every row in (bf16; fp8: 128 x 128 block scales; nvfp4; mxfp4: e8m0 per 32)",
    )
    ap.add_argument(
        "--policy",
        default=EngineConfig.expert_cache_policy,
        choices=EXPERT_CACHE_POLICIES,
        help="slot replacement policy of the expert cache (default: ft serve's)",
    )
    ap.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="threads of the expert cache's host kernels (0: ft serve's default, all CPUs but one on CUDA)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the torch profiler's top ops (CPU and GPU time) of 4 decode steps per row, to stderr, "
        "and add the share of the step outside kernels, copies and CPU expert work (outside_share)",
    )
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="print Python's profile (cProfile, by own time) of 8 decode steps per row, to stderr",
    )
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(json.loads(preset_config_path(args.preset).read_text()), source=args.preset)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)

    rows, header = [], {}
    for name in args.format:
        fmt = format_named(*FORMATS[name])
        format_rows, header[fmt.name] = run_format(fmt, args, cfg, log)
        rows += format_rows
        gc.collect()  # the format's pool (and its pinned registration) goes before the next one's is built
        torch.cuda.empty_cache()
    key = lambda r: (r["format"], r["budget_gb"], r["batch"])
    static = {key(r): r["tok_per_s"] for r in rows if r["backend"] == "static"}
    bf16 = {(r["backend"], r["budget_gb"], r["batch"]): r["tok_per_s"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        if r["backend"] == "hybrid" and key(r) in static:
            r["vs_static"] = round(r["tok_per_s"] / static[key(r)], 2)
        base = bf16.get((r["backend"], r["budget_gb"], r["batch"]))
        if r["format"] != "bf16" and base:
            r["vs_bf16"] = round(r["tok_per_s"] / base, 2)
    print(
        json.dumps(
            {
                "bench": "moe_backends",
                "model": args.preset,
                "formats": header,
                "trace": "synthetic skew=0.45 reuse=0.35 window=16",
                "policy": args.policy,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
