"""GPU grouped-kernel time per MoE layer call: quantized slots (`fused_moe_quant`: FP8 128x128, NVFP4, MXFP4)
against the bf16 slot kernel (`fused_moe`, the baseline), at Qwen3-30B-A3B's expert shapes (H 2048, I 768, top-8).

    python benches/quant_moe.py [--slots 128] [--batch 1 4 16 64] [--iters 50]

Each row: microseconds per call (CUDA events, median), the expert bytes the call reads (distinct slots routed to x
the format's expert_nbytes) per second, and the time per weight byte relative to bf16 (the issue's target: within
1.3x). Prints one line per (format, batch) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from freetoken.kernels.fused_moe import fused_moe
from freetoken.kernels.fused_moe_quant import fused_moe_quant
from freetoken.quant import BF16, MXFP4, NVFP4, fp8_block
from freetoken.quant import reference as ref

HIDDEN, INTER, TOP_K = 2048, 768, 8


def slots_of(fmt, num_slots: int) -> torch.Tensor:
    """[S, expert_nbytes] uint8 on the GPU: one reference-quantized random expert repeated (speed does not depend
    on the values)."""
    layout = fmt.layout(HIDDEN, INTER)
    gen = torch.Generator().manual_seed(0)
    gate, up, down = (
        torch.randn(r, c, generator=gen) * 0.02 for r, c in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    )
    if fmt.quantized:
        one = ref.pack_expert(layout, *(ref.quantize_matrix(fmt, w) for w in (gate, up, down)))
    else:
        one = torch.cat([gate, up, down.reshape(-1, HIDDEN)]).to(torch.bfloat16).reshape(-1).view(torch.uint8)
    return one.cuda().repeat(num_slots, 1)


def time_call(fn, iters: int) -> float:
    """Median microseconds of `fn()` over `iters` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    records = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.stack([torch.randperm(args.slots, generator=gen)[:TOP_K] for _ in range(batch)]).cuda()
        weights = torch.softmax(torch.randn(batch, TOP_K, generator=gen), -1).to(torch.bfloat16).cuda()
        x = torch.randn(batch, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        distinct = int(ids.unique().numel())
        base_us_per_byte = None
        for fmt in (BF16, fp8_block(), NVFP4, MXFP4):
            layout = fmt.layout(HIDDEN, INTER)
            slots = slots_of(fmt, args.slots)
            if fmt.quantized:
                us = time_call(
                    lambda x=x, s=slots, lay=layout, i=ids, w=weights: fused_moe_quant(x, s, lay, i, w), args.iters
                )
            else:
                words = slots.view(torch.bfloat16)
                gate_up, down = (
                    words[:, : 2 * INTER * HIDDEN].view(-1, 2 * INTER, HIDDEN),
                    words[:, 2 * INTER * HIDDEN :].view(-1, HIDDEN, INTER),
                )
                us = time_call(lambda x=x, gu=gate_up, d=down, i=ids, w=weights: fused_moe(x, gu, d, i, w), args.iters)
            nbytes = distinct * layout.expert_nbytes
            us_per_byte = us / nbytes
            base_us_per_byte = base_us_per_byte or us_per_byte
            record = {
                "bench": "quant_moe",
                "format": fmt.name,
                "batch": batch,
                "us_per_call": round(us, 2),
                "expert_gbps": round(nbytes / us / 1e3, 2),
                "time_per_byte_vs_bf16": round(us_per_byte / base_us_per_byte, 3),
            }
            records.append(record)
            print(
                f"quant_moe {fmt.name:>9} batch {batch:>3}: {us:8.1f} us per call, "
                f"{record['expert_gbps']:7.1f} GB/s of "
                f"expert bytes, time per byte {record['time_per_byte_vs_bf16']:.2f}x bf16's"
            )
    print(json.dumps(records))


if __name__ == "__main__":
    main()
