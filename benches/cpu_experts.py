"""The host expert kernel at a decode step's cadence: time per `CpuExperts.forward` call of a few experts.

In a hybrid decode step the CPU runs the 1-3 experts per MoE layer that q* sends it, one call per layer, a span
of GPU work (~0.25-1 ms) apart; `ft bench bw` measures 8 experts per call back to back. This bench measures what
a layer step sees: per call, `--experts` experts of one layer (walking the whole pool, so weights come from DRAM),
`--batch` tokens routed to each, calls back to back (gap 0) or a busy-waited `--gap-us` apart, for each worker
count (`--threads`, callers included) and idle spin (`--spin-us`: how long workers poll before they park,
`CpuExperts.idle_spin_us`). Shape: the real Qwen3-30B-A3B experts (H 2048, I 768, bf16) unless told.

    python benches/cpu_experts.py [--threads 16 15 14] [--experts 1 2 3 8] [--gap-us 0 500] [--spin-us 0 2000]

`--format` adds the quantized formats (fp8_block with 128x128 blocks, nvfp4, mxfp4), each on its own random pool of
the same shape, through the same `CpuExperts` (its quantized kernels). Every row also gives GB/s per thread and the
host read bandwidth of that pool on as many threads (a torch sum over the arena, `measure_host_read`), so a run
gives kernel / read directly:

    python benches/cpu_experts.py --format bf16 fp8_block nvfp4 mxfp4 --threads 1 16 --experts 8 \
        --gap-us 0 --spin-us 0 --layers 4

Prints one line per setting (median and p90 microseconds per call, GB/s of expert bytes (weights and scales) at the
median) and a final JSON line. Runs on any machine; the figures mean something on the deployment box.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

from freetoken._core import CpuExperts, ExpertPool
from freetoken.bench.bandwidth import measure_host_read

FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")


def time_calls(
    cpu: CpuExperts, pool: ExpertPool, experts: int, batch: int, gap_s: float, seconds: float
) -> list[float]:
    """Seconds per call of `experts` experts at `batch` tokens each, calls `gap_s` apart, for about `seconds`."""
    gen = np.random.default_rng(experts)
    hidden = gen.standard_normal((batch, pool.hidden_size), dtype=np.float32)
    out = np.zeros_like(hidden)
    ids = np.zeros((batch, experts), dtype=np.int64)
    weights = np.full((batch, experts), 1.0 / experts, dtype=np.float32)
    times: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(times) < 20:
        layer, group = i % pool.num_layers, i // pool.num_layers
        chosen = (np.arange(experts, dtype=np.int64) + group * experts) % pool.num_experts
        ids[:] = chosen
        t0 = time.perf_counter()
        cpu.forward(layer, hidden, ids, weights, chosen, out)
        t1 = time.perf_counter()
        if i >= 4:  # the first calls wake the workers and fault in the scratch
            times.append(t1 - t0)
        while time.perf_counter() - t1 < gap_s:
            pass
        i += 1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpus = len(os.sched_getaffinity(0))
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({cpus, max(1, cpus - 1), max(1, cpus - 2)}))
    ap.add_argument("--experts", type=int, nargs="+", default=[1, 2, 3, 8])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gap-us", type=float, nargs="+", default=[0.0, 500.0])
    ap.add_argument("--spin-us", type=float, nargs="+", default=[0.0, 2000.0])
    ap.add_argument("--seconds", type=float, default=0.3, help="per setting")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--num-experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--format", nargs="+", choices=FORMATS, default=["bf16"], help="expert formats to time")
    args = ap.parse_args()
    for name, bad in (
        ("--threads", min(args.threads) < 1),
        ("--experts", min(args.experts) < 1),
        ("--batch", args.batch < 1),
        ("--seconds", args.seconds <= 0),
    ):
        if bad:
            ap.error(f"{name} must be positive")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    rows = []
    isa = None
    for fmt in args.format:
        t0 = time.perf_counter()
        block = (128, 128) if fmt == "fp8_block" else (0, 0)
        pool = ExpertPool.random(args.layers, args.num_experts, args.hidden, args.intermediate, format=fmt, block=block)
        log(f"{fmt} pool: {pool.nbytes / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s; {cpus} CPUs")
        for threads in args.threads:
            read_gbps = measure_host_read(pool, threads) / 1e9
            common = {"format": fmt, "threads": threads, "batch": args.batch, "read_gbps": round(read_gbps, 1)}
            cpu = CpuExperts(pool, num_threads=threads)
            isa = cpu.isa
            for spin in args.spin_us:
                cpu.idle_spin_us = spin
                for gap in args.gap_us:
                    for experts in args.experts:
                        times = time_calls(cpu, pool, experts, args.batch, gap / 1e6, args.seconds)
                        med = statistics.median(times)
                        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                        timing = {
                            "spin_us": spin,
                            "gap_us": gap,
                            "experts": experts,
                            "median_us": round(med * 1e6, 1),
                            "p90_us": round(p90 * 1e6, 1),
                            "calls": len(times),
                        }
                        rows.append(_row(common, timing, experts * pool.expert_nbytes / med / 1e9, threads, read_gbps))
            cpu.idle_spin_us = 0.0
            del cpu  # its workers park and exit before the next count's start
            gc.collect()
        del pool
        gc.collect()
    print(json.dumps({"bench": "cpu_experts", "isa": isa, "rows": rows}))


def _row(common: dict, timing: dict, gbps: float, threads: int, read_gbps: float) -> dict:
    """One printed row: the setting, GB/s of expert bytes in all and per thread, and the share of the read rate."""
    row = {
        **common,
        **timing,
        "gbps": round(gbps, 2),
        "gbps_per_thread": round(gbps / threads, 2),
        "pct_of_read": round(100 * gbps / read_gbps, 1),
    }
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return row


if __name__ == "__main__":
    main()
