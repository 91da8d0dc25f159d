"""The chunked gated delta rule's Triton kernels (`freetoken.kernels.gated_delta`) at Qwen3.5-35B-A3B's heads (16 key
heads, 32 value heads, 128 dims, bfloat16 inputs): milliseconds per span of one layer by span length, per kernel
(torch profiler) and in all, for the shipped launch (`LAUNCH`) and, with `--sweep`, each variant that changes one
kernel's (num_warps, num_stages, BLOCK_V); beside the torch form at the shortest length as a check of the output.

    python benches/gated_delta.py [--lengths 2048 8192 32768] [--sweep]

Needs CUDA. Prints one line per (launch, length) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken.kernels import gated_delta as gd

HEADS_K, HEADS_V, DIM = 16, 32, 128
SWEEP = {
    "prepare": [(4, 1, 0), (8, 2, 0), (16, 1, 0)],
    "state": [(4, 1, 16), (8, 1, 32), (8, 1, 16), (4, 2, 32)],
    "output": [(4, 1, 32), (8, 1, 32), (8, 1, 128), (4, 1, 64)],
}


def inputs(length: int):
    """Random q, k, v (bfloat16), g, beta and a state, as the layer feeds the kernels."""
    q, k = (torch.randn(length, HEADS_K, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(length, HEADS_V, DIM, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(length, HEADS_V, device="cuda") * 2
    beta = torch.rand(length, HEADS_V, device="cuda").to(torch.bfloat16)
    return q, k, v, g, beta, torch.randn(HEADS_V, DIM, DIM, device="cuda")


def time_span(length: int, repeats: int) -> dict[str, float]:
    """Mean milliseconds per call of each kernel over `repeats` calls (after one warm-up call)."""
    args = inputs(length)
    gd.chunk_gated_delta_rule(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            gd.chunk_gated_delta_rule(*args)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        for part in ("prepare", "state", "output"):
            if f"_chunk_{part}_kernel" in event.key:
                out[part] = round(event.self_device_time_total / repeats / 1e3, 3)
    out["total"] = round(sum(out.values()), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also each one-kernel variant of the launch")
    args = ap.parse_args()
    torch.manual_seed(0)
    q, k, v, g, beta, state = inputs(min(args.lengths))
    want, want_state = gd.chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
    got = gd.chunk_gated_delta_rule(q, k, v, g, beta, state)
    check = {
        "max_abs_out": float((got.float() - want.float()).abs().max()),
        "max_abs_state": float((state - want_state).abs().max()),
    }
    print(f"against the torch form at {min(args.lengths)} tokens: {check}", flush=True)
    shipped = dict(gd.LAUNCH)
    variants = [("shipped", shipped)]
    if args.sweep:
        for part, launches in SWEEP.items():
            variants += [
                (f"{part}={launch}", {**shipped, part: launch}) for launch in launches if launch != shipped[part]
            ]
    rows = []
    for name, launch in variants:
        gd.LAUNCH.update(launch)
        for length in args.lengths:
            try:
                row = {"launch": name, "tokens": length, **time_span(length, args.repeats)}
            except Exception as exc:  # a variant that does not compile (shared memory) is reported, not fatal
                row = {"launch": name, "tokens": length, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            rows.append(row)
            print(" ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    gd.LAUNCH.update(shipped)
    print(json.dumps({"check": check, "rows": rows}))


if __name__ == "__main__":
    main()
