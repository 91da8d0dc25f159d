"""The KV host tier's copy costs on this box, and the crossover they give against prefill costs.

Builds a KV cache of a model's real KV shape (`--model`: a preset such as qwen3-30b-a3b, a directory, or demo) on
the device, and the host tier beside it (`freetoken.engine.kv_host.HostKVTier`, pinned on CUDA), then times the
tier's own copies, both ways, for runs of 1 to `--max-run` contiguous blocks (best of `--repeats`). Prints the
start-up measurement the engine uses (H2D rate, fixed cost t0), the measured table, and the crossover
`t0 / (g - c)` (`kv_host.CopyCost`) for each marginal prefill cost g: `--prefill-us-per-token`, or what a running
server measured (`--server`: its /v1/stats `kv_host.prefill_us_per_token`). Ends with a JSON line.

    # on the GPU box (seconds; no weights are loaded)
    PYTHONPATH=$PWD/python python benches/kv_host.py --model qwen3-30b-a3b --device cuda
    # on the CPU (the tier is a second buffer)
    PYTHONPATH=$PWD/python python benches/kv_host.py --model demo --device cpu --max-run 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import httpx
import torch

from freetoken.cli.serve import resolve_model_dir
from freetoken.config import ModelConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.kv_host import CopyCost, HostKVTier


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset, model directory or demo (the KV shape)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (--kv-block-size)")
    ap.add_argument("--max-run", type=int, default=512, help="longest run timed, in blocks")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-us-per-token", type=float, nargs="*", default=[5.0, 20.0, 50.0, 200.0])
    ap.add_argument("--server", default=None, help="read the marginal prefill cost from this server's /v1/stats")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dir(resolve_model_dir(args.model, dummy_weights=True))
    dtype = getattr(torch, args.dtype)
    kv = KVCache(
        cfg.num_kv_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        args.max_run,
        args.block_size,
        dtype,
        torch.device(args.device),
    )
    tier = HostKVTier(kv, args.max_run)
    start = tier.cost.stats()
    print(
        f"{args.model}: {kv.bytes_per_block / 1e6:.3f} MB per block of {args.block_size} tokens "
        f"({len(kv.layers)} layers); start-up measurement: H2D {start['h2d_gbps']} GB/s, t0 "
        f"{start['copy_fixed_us']} us",
        file=sys.stderr,
    )
    rows = []
    runs = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, args.max_run} & set(range(1, args.max_run + 1)))
    print(f"{'blocks':>7} {'tokens':>7} {'H2D ms':>9} {'H2D GB/s':>9} {'D2H ms':>9} {'D2H GB/s':>9}", file=sys.stderr)
    for n in runs:
        h2d, d2h = tier.copy_seconds(n, True, args.repeats), tier.copy_seconds(n, False, args.repeats)
        nbytes = n * kv.bytes_per_block
        rows.append({"blocks": n, "tokens": n * args.block_size, "h2d_s": h2d, "d2h_s": d2h, "bytes": nbytes})
        print(
            f"{n:>7} {n * args.block_size:>7} {h2d * 1e3:>9.3f} {nbytes / h2d / 1e9:>9.2f} {d2h * 1e3:>9.3f} "
            f"{nbytes / d2h / 1e9:>9.2f}",
            file=sys.stderr,
        )
    costs = list(args.prefill_us_per_token)
    if args.server:
        stats = httpx.get(args.server.rstrip("/") + "/v1/stats", timeout=30).json().get("kv_host") or {}
        if stats.get("prefill_us_per_token"):
            costs = [stats["prefill_us_per_token"]]
            print(f"server {args.server}: kv_host {json.dumps(stats)}", file=sys.stderr)
    crossovers = {}
    for g in costs:
        cost = CopyCost(tier.cost.bytes_per_token, tier.cost.h2d_bytes_per_s, tier.cost.fixed_s)
        cost.add_prefill(1000, g * 1e-3)  # one sample: g seconds per token
        crossover = cost.crossover_tokens
        crossovers[g] = None if crossover is None or math.isinf(crossover) else round(crossover, 1)
        print(f"marginal prefill {g} us/token -> promote from {crossovers[g]} tokens", file=sys.stderr)
    print(
        json.dumps({"bench": "kv_host", "model": args.model, "startup": start, "runs": rows, "crossover": crossovers})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
