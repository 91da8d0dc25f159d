"""Prefill through the expert cache at a consumer-GPU budget, on the real Qwen3-30B-A3B config (dummy weights).

Part 1, long prompts (512, 2k, 8k, 32k tokens; chunks of 8192): time per chunk with whole-layer streaming, its
copies overlapped with compute (two layer buffers) and not (one), and with `auto`; beside the transfer bound (all
expert bytes over the measured PCIe bandwidth; and the bytes the run streamed, which skips resident experts) and
the GPU compute time (the same chunks with every expert resident: `fused`, 58 GB on the GPU).
Part 2, short extends (16, 64, 256 tokens) after an 8192-token prefix and 16 decode steps that warm the cache:
the extend's time with each strategy (stream, fill, cpu, hybrid, auto). The extends and the decode steps are
routed by a synthetic trace (`freetoken._core.synthetic_trace`, Zipf skew 0.45 across a step's tokens), because
random routers route almost uniformly; the long prompts use the model's own (random) router, which makes no
difference to streaming (every expert of every layer crosses anyway).

    python benches/prefill.py [--budget 24] [--prompts 512 2048 8192 32768] [--extends 16 64 256]

Prints one line per row and a final JSON line. Needs CUDA and ~60 GB of host RAM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from freetoken._core import CpuExperts, ExpertPool, read_trace, synthetic_trace
from freetoken.bench.bandwidth import measure_cpu, measure_pcie
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.models.attention import AttentionMetadata
from freetoken.models.loader import init_dummy_weights
from freetoken.models.presets import preset_config_path
from freetoken.moe.budget import plan_expert_slots
from freetoken.moe.compute import expert_views
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from freetoken.moe.pinned import pin_host_memory

CHUNK = 8192


class Routed:
    """Wraps a backend; replaces the router's top-k ids by `ids[pool layer]` while `ids` is set and shapes match."""

    def __init__(self, inner, moe_layers: list[int]):
        self.inner = inner
        self.pool_layer = {layer: i for i, layer in enumerate(moe_layers)}
        self.ids: np.ndarray | None = None  # [layers, T, k]

    def begin_step(self, num_tokens, num_prefill_tokens, top_k):
        self.inner.begin_step(num_tokens, num_prefill_tokens, top_k)

    def forward(self, layer, hidden, topk_ids, topk_weights):
        if self.ids is not None and self.ids.shape[1:] == tuple(topk_ids.shape):
            topk_ids = torch.from_numpy(self.ids[self.pool_layer[layer]]).to(hidden.device)
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)


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


def prefill(model, kv: KVCache, length: int, seed: int = 0) -> list[float]:
    """Per-chunk seconds of a `length`-token prompt prefilled in chunks of `CHUNK`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 100_000, length).tolist()
    return [run_chunk(model, kv, tokens[s : s + CHUNK], s) for s in range(0, length, CHUNK)]


def counters(backend: ExpertCacheBackend) -> dict[str, float]:
    """Cumulative planner counters summed over layers, streamed bytes, and steps by prefill strategy."""
    stats = {name: float(v.sum()) for name, v in backend.planner.stats().items()}
    prefill_stats = backend.stats()["prefill"]
    stats["bytes_streamed"] = float(prefill_stats["bytes_streamed"])
    stats.update({name: float(v) for name, v in prefill_stats["steps_by_strategy"].items()})
    return stats


def profile_extend(model, kv: KVCache, routed: Routed, ids: np.ndarray, start: int, log) -> None:
    """The torch profiler's top ops (by host and by device time) of one extend, logged."""
    from torch.profiler import ProfilerActivity, profile

    routed.ids = ids
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_chunk(model, kv, list(range(1, ids.shape[1] + 1)), start)
    for key in ("self_cpu_time_total", "self_cuda_time_total"):
        log(prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--budget", type=float, default=24.0)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--extends", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="extends timed per row (median)")
    ap.add_argument("--parts", nargs="+", default=["prompt", "extend"], choices=["prompt", "extend"])
    ap.add_argument("--profile", action="store_true",
                    help="log the torch profiler's top ops of one 64-token extend per strategy, to stderr")
    args = ap.parse_args()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = ModelConfig.from_dict(json.loads(preset_config_path(args.preset).read_text()), source=args.preset)
    device = torch.device("cuda")
    layers = cfg.moe_layers
    k = cfg.num_experts_per_tok

    t0 = time.perf_counter()
    pool = ExpertPool.random(len(layers), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_layers=layers)
    arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
    pin_host_memory(pool.ptr, pool.nbytes)
    log(f"pool: {pool.nbytes / 1e9:.1f} GB built and pinned in {time.perf_counter() - t0:.0f} s")
    cpu = CpuExperts(pool)
    scratch = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
    b_pcie = measure_pcie(pool, arena, scratch, torch.cuda.Stream())
    b_cpu = {b: measure_cpu(cpu, pool, b) for b in (1, 2, 4, 8, 16)}
    del scratch, cpu
    all_bytes = len(layers) * cfg.num_experts * pool.expert_nbytes
    bound_all = all_bytes / b_pcie
    log(f"B_pcie {b_pcie / 1e9:.1f} GB/s (all experts: {bound_all:.3f} s); B_cpu "
        + ", ".join(f"b={b}: {v / 1e9:.1f}" for b, v in b_cpu.items()))

    max_len = max(args.prompts + [CHUNK + max(args.extends)])
    engine_cfg = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_gb=args.budget, max_model_len=max_len,
                              kv_cache_tokens=max_len, kv_cache_gb=8.0, max_num_seqs=1)
    host_only = ExpertCacheBackend("cpu", pool, device, 0)  # holds no device memory: attached between rows
    model = init_dummy_weights(cfg, host_only, device, torch.bfloat16)
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len // 16 + 2, 16,
                 torch.bfloat16, device)
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
            times = prefill(model, kv, length)
            compute[length] = times
            emit({"part": "prompt", "prompt": length, "strategy": "fused", "overlap": None,
                  "total_s": round(sum(times), 3), "chunk_s": round(max(times), 3)})
        model.attach_experts(host_only)
        del fused, gpu_arena, per_layer
        torch.cuda.empty_cache()

    def cache_backend(strategy: str, overlap: bool) -> ExpertCacheBackend:
        ecfg = EngineConfig(**{**engine_cfg.__dict__, "prefill_strategy": strategy, "no_prefill_overlap": not overlap})
        slots, buffers = plan_expert_slots(ecfg, cfg, torch.bfloat16, pool.expert_stride, "hybrid")
        return ExpertCacheBackend("hybrid", pool, device, slots, pcie_bytes_per_s=b_pcie, cpu_bytes_per_s=b_cpu,
                                  layer_buffers=buffers, prefill_strategy=strategy)

    for strategy, overlap in (("stream", True), ("stream", False), ("auto", True)) if args.prompts else ():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend = cache_backend(strategy, overlap)
        model.attach_experts(backend)
        prefill(model, kv, 512)  # warm-up: kernels at these shapes
        for length in args.prompts:
            before = backend.stats()["prefill"]["bytes_streamed"]
            times = prefill(model, kv, length)
            streamed = backend.stats()["prefill"]["bytes_streamed"] - before
            full = times[: length // CHUNK] or times  # whole chunks (or the one short one)
            chunk_s = statistics.median(full)
            gpu_s = statistics.median(compute[length][: len(full)])
            emit({
                "part": "prompt", "prompt": length, "strategy": strategy, "overlap": overlap,
                "total_s": round(sum(times), 3), "chunk_s": round(chunk_s, 3),
                "bound_s": round(bound_all, 3), "streamed_bound_s": round(streamed / len(times) / b_pcie, 3),
                "compute_s": round(gpu_s, 3), "over_max_bound_compute": round(chunk_s / max(bound_all, gpu_s), 3),
                "steps_by_strategy": backend.stats()["prefill"]["steps_by_strategy"],
                "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            })
        model.attach_experts(host_only)
        del backend

    # Part 2: short extends after a long prefix, the cache warmed by decode steps.
    with tempfile.TemporaryDirectory() as tmp:
        def trace_ids(batch: int, steps: int, seed: int) -> list[np.ndarray]:
            path = Path(tmp) / f"t{batch}-{seed}.fttrace"
            synthetic_trace(path, len(layers), cfg.num_experts, k, steps, batch=batch, seed=seed)
            by_step: dict[int, list] = {}
            for s, layer, ids in read_trace(path)["records"]:
                by_step.setdefault(s, [None] * len(layers))[layer] = ids.astype(np.int64)
            return [np.stack(by_step[s]) for s in sorted(by_step)]

        decode_ids = trace_ids(1, 16, seed=1)
        for strategy in ("stream", "fill", "cpu", "hybrid", "auto") if "extend" in args.parts else ():
            torch.cuda.empty_cache()
            backend = cache_backend("auto", True)
            routed = Routed(backend, layers)
            model.attach_experts(routed)
            prefill(model, kv, CHUNK)  # the prefix, streamed
            for step, ids in enumerate(decode_ids):  # decode steps warm the cache
                routed.ids = ids
                run_chunk(model, kv, [7], CHUNK + step, prefill=False)
            backend.prefill_strategy = strategy
            for n in args.extends:
                times = []
                before = counters(backend)
                for rep in range(args.repeats):
                    routed.ids = trace_ids(n, 1, seed=100 + 10 * n + rep)[0]
                    times.append(run_chunk(model, kv, list(range(1, n + 1)), CHUNK + len(decode_ids)))
                after = counters(backend)
                per = {key: (after[key] - before[key]) / args.repeats for key in after}
                chosen = [name for name in ("stream", "fill", "cpu", "hybrid") if per[name] > 0]
                lookups = per["hits"] + per["fills"] + per["cpu_runs"]
                emit({"part": "extend", "prefix": CHUNK, "extend": n, "strategy": strategy, "chosen": chosen,
                      "extend_s": round(statistics.median(times), 4),
                      "hit_rate": round(per["hits"] / lookups, 3) if lookups else None,
                      "pcie_gb": round((per["bytes_h2d"] + per["bytes_streamed"]) / 1e9, 3),
                      "cpu_gb": round(per["bytes_cpu"] / 1e9, 3)})
                if args.profile and n == 64:
                    profile_extend(model, kv, routed, trace_ids(n, 1, seed=7)[0], CHUNK + len(decode_ids), log)
            routed.ids = None
            model.attach_experts(host_only)
            del backend, routed

    stream = {r["extend"]: r["extend_s"] for r in rows if r["part"] == "extend" and r["strategy"] == "stream"}
    for r in rows:
        if r["part"] == "extend" and r["extend"] in stream:
            r["stream_over_this"] = round(stream[r["extend"]] / r["extend_s"], 2)
    print(json.dumps({"bench": "prefill", "model": args.preset, "budget_gb": args.budget,
                      "b_pcie_gbps": round(b_pcie / 1e9, 1), "all_experts_bound_s": round(bound_all, 3),
                      "trace": "synthetic skew=0.45 (extends, decode warm-up)", "rows": rows}))


if __name__ == "__main__":
    main()
