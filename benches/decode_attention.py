"""Decode attention over the paged KV cache: the single-pass kernel against split-K, at long contexts.

The real Qwen3-30B-A3B attention shape by default (32 query heads, 4 KV heads, head_dim 128, bf16, 48 layers, KV
blocks of 16 tokens). Each (batch, context) times one CUDA graph of `--layers` launches, one per layer over that
layer's own cache (cycling over as many as fit in memory), so the K/V bytes come from HBM as in a decode step, not
from L2. Every sequence is at the context length; the block tables are `--max-model-len` wide, as the captured
decode graphs' are (split-K's partitions past the context exit at once). Each variant is checked against the
single pass before timing.

    python benches/decode_attention.py [--batch 1 8] [--context 1024 4096 16384 32768 65536] [--partition 256 512 1024]

Prints a table (µs per layer, ms per step of all layers, speed-up over the single pass) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gpu_timing import graph_us

from freetoken.kernels.paged_attention import PARTITION_SIZE, paged_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--partition", type=int, nargs="+", default=sorted({256, PARTITION_SIZE, 1024}))
    parser.add_argument("--max-model-len", type=int, default=0, help="block-table width in tokens (0: max context)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention.py needs a CUDA device")
    device, dtype, bs = torch.device("cuda"), torch.bfloat16, args.block_size
    max_len = args.max_model_len or max(args.context)
    width = -(-max_len // bs)
    slots = max(args.batch) * width * bs
    layer_bytes = 2 * slots * args.kv_heads * args.head_dim * 2
    # As many layers' own caches as fit in 60% of free memory (all of them at the defaults: 48 GiB); the launches
    # cycle over them. A layer's cache that large is far beyond L2 (50 MiB on an H200), so reads still hit HBM.
    num_caches = max(1, min(args.layers, int(0.6 * torch.cuda.mem_get_info()[0] // layer_bytes)))
    print(f"allocating {num_caches} layers of K/V cache ({num_caches * layer_bytes / 2**30:.1f} GiB)", file=sys.stderr)
    caches = []
    for _ in range(num_caches):
        k = torch.empty(slots, args.kv_heads, args.head_dim, dtype=dtype, device=device).normal_()
        v = torch.empty_like(k).normal_()
        caches.append((k, v))
    gen = torch.Generator(device="cpu").manual_seed(0)
    variants: list[int | None] = [None, *args.partition]
    names = ["single", *(f"split{p}" for p in args.partition)]
    rows = []
    header = f"{'batch':>5} {'context':>7} " + " ".join(f"{n + ' us/layer':>16} {'ms/step':>8}" for n in names)
    print(header)
    for batch in args.batch:
        perm = torch.randperm(slots // bs, generator=gen)[: batch * width].view(batch, width)
        tables = perm.to(device, torch.int32)
        q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(device, dtype)
        scale = args.head_dim**-0.5
        for ctx in args.context:
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            k0, v0 = caches[0]
            base = paged_decode_attention(q, k0, v0, tables, lens, bs, scale, None).float()
            row = {"batch": batch, "context": ctx}
            for name, part in zip(names, variants, strict=True):
                got = paged_decode_attention(q, k0, v0, tables, lens, bs, scale, part).float()
                err = (got - base).abs().max().item()
                if err > 2e-2:
                    sys.exit(f"{name} differs from the single pass by {err} at batch {batch}, context {ctx}")

                def step(part=part, q=q, tables=tables, lens=lens, scale=scale):  # bound now: graph_us replays it
                    for layer in range(args.layers):
                        k, v = caches[layer % num_caches]
                        paged_decode_attention(q, k, v, tables, lens, bs, scale, part)

                row[name] = graph_us(step, args.replays, calls=1) / 1e3  # ms per step (all layers)
            rows.append(row)
            print(
                f"{batch:>5} {ctx:>7} "
                + " ".join(f"{row[n] * 1000 / args.layers:>16.1f} {row[n]:>8.2f}" for n in names),
                flush=True,
            )
    best = {}
    for row in rows:
        split = min((n for n in names[1:]), key=lambda n: row[n])
        best[f"b{row['batch']}_c{row['context']}"] = {"best": split, "speedup": round(row["single"] / row[split], 2)}
        print(
            f"batch {row['batch']} context {row['context']}: best {split}, "
            f"{row['single'] / row[split]:.2f}x the single pass",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "decode_attention",
                "layers": args.layers,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "max_model_len": max_len,
                "ms_per_step": rows,
                "best": best,
            }
        )
    )


if __name__ == "__main__":
    main()
