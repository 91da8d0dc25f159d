"""Prefill through the expert cache at a consumer-GPU budget, on the real Qwen3-30B-A3B config (dummy weights).

Part 1, long prompts (512, 2k, 8k, 32k tokens; chunks of `--chunk`, 8192): time per chunk with whole-layer
streaming, its copies overlapped with compute (two layer buffers) and not (one), and with `auto`; beside the
transfer bound (all expert bytes over the measured PCIe bandwidth; and the bytes the run streamed, which skips
resident experts) and the GPU compute time (the same chunks with every expert resident: `fused`, 58 GB on the GPU).
The model's own (random) router routes them, which makes no difference to streaming (every expert of every layer
crosses anyway).
Part 2, short extends (16 ... 4096 tokens) after an 8192-token prefix and 16 decode steps that warm the cache: each
fixed strategy (stream, fill, cpu, hybrid) and `auto`, each on a fresh backend that prefilled the same prefix.
Routing replays the synthetic trace (`freetoken.moe.routing_replay`, as `ft serve --replay-routing synthetic`:
Zipf skew 0.45, reuse 0.35 within 16 tokens), from its first row for every strategy, because random routers route
almost uniformly. Per extend length every strategy, `auto` included, runs `--warmup` extends (kernels; `auto` measures
its candidates on them), then `--repeats` timed ones (median; each repeat's time is in the row): the same count for
all, so every strategy's timed extends replay the same trace rows after the same number of extends, whose fills
change what the slots hold (16-token extends under `hybrid`: 0.28 s at 9 % hits in the fixed run after one warm-up
extend, 0.44 s at 0 % hits and 40 % more fills inside `auto`'s run after six). `--limit cpu=256` skips a fixed
strategy past that length. The table gives each strategy's time, auto's time and choices, and auto over the best
fixed strategy run (target: <= 1.05).
The backends get the bandwidths `ft serve` would (`ft bench bw`'s planner figures: copies and CPU kernels measured
running together, `planner_figures`).

    python benches/prefill.py [--budget 24] [--prompts 512 2048 8192 32768] [--extends 16 64 256 1024 4096]
    python benches/prefill.py --parts extend     # part 2 alone
    python benches/prefill.py --parts extend --limit cpu=256 fill=256 hybrid=1024   # ~3 min on the H200 box

Prints one line per row, a table of the extends, and a final JSON line. Needs CUDA and ~60 GB of host RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from freetoken._core import CpuExperts, ExpertPool
from freetoken.bench.bandwidth import measure_overlapped, measure_pcie, planner_figures
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.models.attention import AttentionMetadata
from freetoken.models.loader import init_dummy_weights
from freetoken.models.presets import preset_config_path
from freetoken.moe.budget import activation_reserve_nbytes, plan_expert_slots
from freetoken.moe.compute import expert_views
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from freetoken.moe.pinned import PinnedRegion
from freetoken.moe.profile import BATCHES
from freetoken.moe.routing_replay import install_trace, synthetic_tables

CHUNK = 8192
DECODE_STEPS = 16  # decode steps between the prefix and the extends (they warm the slot cache)
TRACE_TOKENS = 16384  # rows of the replayed trace (it wraps past them)
FIXED = ("stream", "fill", "cpu", "hybrid")


def run_chunk(model, kv: KVCache, tokens: list[int], start: int, prefill: bool = True) -> float:
    """Seconds to run `tokens` at positions [start, start + len) of one sequence (its blocks 0, 1, ...)."""
    n = len(tokens)
    blocks = list(range(kv.blocks_for(start + n)))
    meta = AttentionMetadata.build([n], [start + n], [blocks], kv.block_size, kv.layers[0][0].device)
    ids = torch.tensor(tokens, device=kv.layers[0][0].device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.experts.begin_step(n, n if prefill else 0, model.config.num_experts_per_tok)
    hidden = model(ids, meta, kv.layers)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill(model, kv: KVCache, length: int, seed: int = 0, chunk: int = CHUNK) -> list[float]:
    """Per-chunk seconds of a `length`-token prompt prefilled in chunks of `chunk` tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 100_000, length).tolist()
    return [run_chunk(model, kv, tokens[s : s + chunk], s) for s in range(0, length, chunk)]


def counters(backend: ExpertCacheBackend) -> dict[str, float]:
    """Cumulative planner counters summed over layers, streamed bytes, and steps by prefill strategy."""
    stats = {name: float(v.sum()) for name, v in backend.planner.stats().items()}
    prefill_stats = backend.stats()["prefill"]
    stats["bytes_streamed"] = float(prefill_stats["bytes_streamed"])
    stats.update({name: float(v) for name, v in prefill_stats["steps_by_strategy"].items()})
    return stats


def profile_extend(model, kv: KVCache, n: int, start: int, log) -> None:
    """The torch profiler's top ops (by host and by device time) of one `n`-token extend, logged."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_chunk(model, kv, list(range(1, n + 1)), start)
    for key in ("self_cpu_time_total", "self_cuda_time_total"):
        log(prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=40))


def extend_table(rows: list[dict], extends: list[int]) -> Table:
    """Per extend length: each fixed strategy's median seconds, auto's and its choices, auto over the best."""
    table = Table(title="extends after an 8192-token prefix (median s)")
    for column in ("extend", *FIXED, "auto", "auto chose", "best", "auto/best"):
        table.add_column(column, justify="right")
    for n in extends:
        got = {r["strategy"]: r for r in rows if r["part"] == "extend" and r["extend"] == n}
        fixed = {s: got[s]["extend_s"] for s in FIXED if s in got}
        auto = got.get("auto")
        best = min(fixed, key=fixed.get) if fixed else None
        table.add_row(
            str(n),
            *(f"{fixed[s]:.4f}" if s in fixed else "-" for s in FIXED),
            f"{auto['extend_s']:.4f}" if auto else "-",
            ",".join(auto["chosen"]) if auto else "-",
            best or "-",
            f"{auto['auto_over_best']:.3f}" if auto and best else "-",
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--budget", type=float, default=24.0)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--extends", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3, help="extends timed per row (median)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=6,
        help="untimed extends per length before the timed ones, for every strategy (auto measures its candidates on "
        "them)",
    )
    ap.add_argument(
        "--limit",
        nargs="*",
        default=[],
        metavar="STRATEGY=TOKENS",
        help="run a fixed strategy only at extends up to TOKENS (e.g. cpu=256: it is compute-bound past that)",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=CHUNK,
        help="part 1's chunk tokens (ft serve's --max-prefill-tokens; the agent-trace runs use 32768)",
    )
    ap.add_argument("--parts", nargs="+", default=["prompt", "extend"], choices=["prompt", "extend"])
    ap.add_argument(
        "--profile",
        action="store_true",
        help="log the torch profiler's top ops of one 64-token extend per strategy, to stderr",
    )
    args = ap.parse_args()
    try:
        limits = {name: int(n) for name, n in (item.split("=") for item in args.limit)}
    except ValueError:
        ap.error(f"--limit takes STRATEGY=TOKENS, got {args.limit}")
    if set(limits) - set(FIXED):
        ap.error(f"--limit: strategies are {', '.join(FIXED)}")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    cfg = ModelConfig.from_dict(json.loads(preset_config_path(args.preset).read_text()), source=args.preset)
    device = torch.device("cuda")
    layers = cfg.moe_layers
    k = cfg.num_experts_per_tok

    t0 = time.perf_counter()
    pool = ExpertPool.random(
        len(layers), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_layers=layers
    )
    arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
    _pinned = PinnedRegion(pool.ptr, pool.nbytes, keep=pool)  # registered while main runs
    log(f"pool: {pool.nbytes / 1e9:.1f} GB built and pinned in {time.perf_counter() - t0:.0f} s")
    cpu = CpuExperts(pool)
    scratch = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
    b_pcie = measure_pcie(pool, arena, scratch, torch.cuda.Stream())
    # What the backends get: the profile's figures (`ft bench bw`), copies and CPU kernels measured together.
    planner_pcie, planner_cpu = planner_figures(
        {b: measure_overlapped(cpu, pool, arena, scratch, torch.cuda.Stream(), b) for b in BATCHES}
    )
    del scratch, cpu
    all_bytes = len(layers) * cfg.num_experts * pool.expert_nbytes
    bound_all = all_bytes / b_pcie
    log(
        f"B_pcie {b_pcie / 1e9:.1f} GB/s alone (all experts: {bound_all:.3f} s); planner figures: B_pcie "
        f"{planner_pcie / 1e9:.1f}, B_cpu " + ", ".join(f"b={b}: {v / 1e9:.1f}" for b, v in planner_cpu.items())
    )

    max_len = max(args.prompts + [CHUNK + DECODE_STEPS + max(args.extends)])
    engine_cfg = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        gpu_memory_gb=args.budget,
        max_model_len=max_len,
        kv_cache_tokens=max_len,
        kv_cache_gb=8.0,
        max_num_seqs=1,
        max_prefill_tokens=max(args.chunk, CHUNK),  # the activation reserve (and so the slots) ft serve would plan
    )
    host_only = ExpertCacheBackend("cpu", pool, device, 0)  # holds no device memory: attached between rows
    model = init_dummy_weights(cfg, host_only, device, torch.bfloat16)
    kv = KVCache(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len // 16 + 2, 16, torch.bfloat16, device
    )
    rows = []

    def emit(row):
        rows.append(row)
        print(" ".join(f"{key}={v}" for key, v in row.items()), flush=True)

    # The GPU compute time: every expert resident.
    compute = {}
    if "prompt" not in args.parts:
        args.prompts = []
    if args.prompts:
        gpu_arena = arena.to(device)
        fused = FusedExperts()
        per_layer = gpu_arena.view(len(layers), cfg.num_experts, -1)
        for li, layer in enumerate(layers):
            fused.load_layer(layer, *expert_views(per_layer[li], cfg.hidden_size, cfg.moe_intermediate_size))
        model.attach_experts(fused)
        prefill(model, kv, CHUNK)  # compiles the kernels
        for length in args.prompts:
            times = prefill(model, kv, length, chunk=args.chunk)
            compute[length] = times
            emit(
                {
                    "part": "prompt",
                    "prompt": length,
                    "strategy": "fused",
                    "overlap": None,
                    "total_s": round(sum(times), 3),
                    "chunk_s": round(max(times), 3),
                }
            )
        model.attach_experts(host_only)
        del fused, gpu_arena, per_layer
        torch.cuda.empty_cache()

    def cache_backend(strategy: str, overlap: bool) -> ExpertCacheBackend:
        ecfg = EngineConfig(**{**engine_cfg.__dict__, "prefill_strategy": strategy, "no_prefill_overlap": not overlap})
        slots, buffers = plan_expert_slots(ecfg, cfg, torch.bfloat16, pool.expert_stride, "hybrid")
        return ExpertCacheBackend(
            "hybrid",
            pool,
            device,
            slots,
            pcie_bytes_per_s=planner_pcie,
            cpu_bytes_per_s=planner_cpu,
            layer_buffers=buffers,
            prefill_strategy=strategy,
        )

    for strategy, overlap in (("stream", True), ("stream", False), ("auto", True)) if args.prompts else ():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend = cache_backend(strategy, overlap)
        model.attach_experts(backend)
        prefill(model, kv, 512)  # warm-up: kernels at these shapes
        for length in args.prompts:
            before = backend.stats()["prefill"]["bytes_streamed"]
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = prefill(model, kv, length, chunk=args.chunk)
            streamed = backend.stats()["prefill"]["bytes_streamed"] - before
            full = times[: length // args.chunk] or times  # whole chunks (or the one short one)
            chunk_s = statistics.median(full)
            gpu_s = statistics.median(compute[length][: len(full)])
            emit(
                {
                    "part": "prompt",
                    "prompt": length,
                    "strategy": strategy,
                    "overlap": overlap,
                    "total_s": round(sum(times), 3),
                    "chunk_s": round(chunk_s, 3),
                    "bound_s": round(bound_all, 3),
                    "streamed_bound_s": round(streamed / len(times) / b_pcie, 3),
                    "compute_s": round(gpu_s, 3),
                    "over_max_bound_compute": round(chunk_s / max(bound_all, gpu_s), 3),
                    "steps_by_strategy": backend.stats()["prefill"]["steps_by_strategy"],
                    "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                    # What the chunks allocated above the weights, KV, slots and buffers (the budget reserves
                    # freetoken.moe.budget.activation_reserve_nbytes for it).
                    "activation_peak_gb": round((torch.cuda.max_memory_allocated() - resident) / 1e9, 2),
                    "activation_reserve_gb": round(activation_reserve_nbytes(engine_cfg, cfg, torch.bfloat16) / 1e9, 2),
                }
            )
        model.attach_experts(host_only)
        del backend

    # Part 2: short extends after a long prefix, the cache warmed by decode steps; routing replayed from a trace.
    if "extend" in args.parts:
        clock = install_trace(
            model, synthetic_tables(len(layers), cfg.num_experts, k, TRACE_TOKENS, seed=1), "synthetic"
        )
        start = CHUNK + DECODE_STEPS
        for strategy in (*FIXED, "auto"):
            torch.cuda.empty_cache()
            backend = cache_backend("auto", True)
            model.attach_experts(backend)
            clock.zero_()  # every strategy replays the same routing
            prefill(model, kv, CHUNK)  # the prefix, streamed
            for step in range(DECODE_STEPS):
                run_chunk(model, kv, [7], CHUNK + step, prefill=False)
            backend.prefill_strategy = strategy
            for n in args.extends:
                if n > limits.get(strategy, n):
                    continue
                tokens = list(range(1, n + 1))
                for _ in range(args.warmup):
                    run_chunk(model, kv, tokens, start)
                times, picks = [], []
                before = counters(backend)
                for _ in range(args.repeats):
                    times.append(run_chunk(model, kv, tokens, start))
                    picks.append(backend.strategy)
                after = counters(backend)
                per = {key: (after[key] - before[key]) / args.repeats for key in after}
                lookups = per["hits"] + per["fills"] + per["cpu_runs"]
                emit(
                    {
                        "part": "extend",
                        "prefix": CHUNK,
                        "extend": n,
                        "strategy": strategy,
                        "chosen": sorted(set(picks), key=picks.index),
                        "extend_s": round(statistics.median(times), 4),
                        "times": [round(t, 4) for t in times],
                        "hit_rate": round(per["hits"] / lookups, 3) if lookups else None,
                        "pcie_gb": round((per["bytes_h2d"] + per["bytes_streamed"]) / 1e9, 3),
                        "cpu_gb": round(per["bytes_cpu"] / 1e9, 3),
                        "evictions": round(per["evictions"]),
                    }
                )
                if args.profile and n == 64:
                    profile_extend(model, kv, n, start, log)
            if strategy == "auto":
                log(f"auto's measured / predicted scales: {backend.calibration.stats()}")
            model.attach_experts(host_only)
            del backend

    for n in args.extends:
        got = {r["strategy"]: r for r in rows if r["part"] == "extend" and r["extend"] == n}
        fixed = {s: got[s]["extend_s"] for s in FIXED if s in got}
        if "auto" in got and fixed:
            best = min(fixed, key=fixed.get)
            got["auto"].update(best_fixed=best, auto_over_best=round(got["auto"]["extend_s"] / fixed[best], 3))
    if "extend" in args.parts:
        Console(no_color="NO_COLOR" in os.environ, width=140).print(extend_table(rows, args.extends))
    print(
        json.dumps(
            {
                "bench": "prefill",
                "model": args.preset,
                "budget_gb": args.budget,
                "b_pcie_gbps": round(b_pcie / 1e9, 1),
                "all_experts_bound_s": round(bound_all, 3),
                "planner_pcie_gbps": round(planner_pcie / 1e9, 1),
                "planner_cpu_gbps": {b: round(v / 1e9, 1) for b, v in planner_cpu.items()},
                "trace": "synthetic skew=0.45 reuse=0.35 window=16 (prefix, decode warm-up, extends)",
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
