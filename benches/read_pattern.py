"""How fast the GPU reads one MoE layer's 4-bit gate/up weights at batch 1 in different orders: the ceiling for a
decode kernel that reads them in that order (`fused_moe_fp4_mma`), without its decode and dots.

    python benches/read_pattern.py [--experts 8] [--iters 200]

The bytes: Qwen3-30B-A3B's gate/up in NVFP4 words (2 x 768 rows of 1 KB: 2048 e2m1 columns) for `--experts`
distinct experts of 128 slots, as at batch 1 (8 routed experts, 12.6 MB; the block scales left out). Every kernel
sums every int32 word once (the sum is checked against torch's, so no load can be dropped) with the fp4_mma gate/up
grid: one program of 2 warps per expert and 16 rows (96 per expert). Orders:
  - `steps`: what fp4_mma reads, 8 K steps of 128 columns (64 bytes) in each of the 16 rows a step, one step ahead:
    each step 16 pieces of 128 bytes 1 KB apart (the two warps' halves side by side);
  - `steps_all`: the same pieces, all 8 steps' loads issued before the first sum;
  - `rows`: the same 16 KB a program, 2 whole rows (2 KB contiguous) a step, one step ahead;
  - `rows_all`: the program's 16 KB in one load (contiguous 8 KB of gate rows, 8 KB of up rows).
Prints the median microseconds (CUDA events over a CUDA graph of `--iters` launches) and GB/s per order, and a JSON
line. A plain copy of the same bytes by torch (`copy`) is the memory system's rate for reference.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from gpu_timing import graph_us

ROWS, WORDS = 2 * 768, 256  # gate/up rows per expert, int32 words per row (2048 e2m1 columns)


@triton.jit
def _read_kernel(w_ptr, slots_ptr, out_ptr, stride_e, ORDER: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """out[program] = the sum of the program's 16 rows (int32 words; wrapping): 8 gate rows, the same 8 up rows of
    slot slots[pid_m], in the order ORDER (0 steps, 1 steps_all, 2 rows, 3 rows_all)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = w_ptr + tl.load(slots_ptr + pid_m).to(tl.int64) * stride_e
    r = tl.arange(0, 16)
    row = pid_n * 8 + r % 8 + (r // 8) * (ROWS // 2)
    acc = tl.zeros([16, 32], dtype=tl.int32)
    if ORDER == 0 or ORDER == 1:
        c = tl.arange(0, 32)
        ptrs = base + row[:, None] * WORDS + c[None, :]
        if ORDER == 0:
            for step in range(WORDS // 32):
                acc += tl.load(ptrs + step * 32)
        else:
            for step in tl.static_range(WORDS // 32):
                acc += tl.load(ptrs + step * 32)
    else:
        r2 = tl.arange(0, 2)
        c = tl.arange(0, WORDS)
        if ORDER == 2:
            acc2 = tl.zeros([2, WORDS], dtype=tl.int32)
            for step in range(8):
                rows = pid_n * 8 + (2 * step + r2) % 8 + ((2 * step + r2) // 8) * (ROWS // 2)
                acc2 += tl.load(base + rows[:, None] * WORDS + c[None, :])
            acc += tl.sum(tl.reshape(acc2, [16, 32]), axis=0)[None, :] * (r[:, None] == 0)
        else:
            acc += tl.sum(tl.reshape(tl.load(base + row[:, None] * WORDS + c[None, :]), [16, 8, 32]), axis=1)
    tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_n, tl.sum(tl.sum(acc, axis=1), axis=0))


ORDERS = {"steps": 0, "steps_all": 1, "rows": 2, "rows_all": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    slots = torch.randint(-(2**31), 2**31 - 1, (128, ROWS * WORDS), generator=gen, dtype=torch.int32).cuda()
    chosen = torch.randperm(128, generator=gen)[: args.experts].cuda()
    nbytes = args.experts * ROWS * WORDS * 4
    want = slots[chosen].sum(dtype=torch.int64).item()
    out = torch.empty(args.experts * ROWS // 16, dtype=torch.int32, device="cuda")
    records = []
    for name, order in ORDERS.items():

        def call(order=order):
            _read_kernel[(args.experts, ROWS // 16)](
                slots, chosen, out, slots.stride(0), ORDER=order, ROWS=ROWS, WORDS=WORDS, num_warps=2
            )

        call()
        got = out.sum(dtype=torch.int64).item()
        # the kernels sum in int32 (wrapping): equal modulo 2^32
        if (got - want) % 2**32:
            raise SystemExit(f"read_pattern: order {name} summed {got}, expected {want} (mod 2^32)")
        us = graph_us(call, 5, calls=args.iters)
        records.append({"bench": "read_pattern", "order": name, "us": round(us, 2), "gbps": round(nbytes / us / 1e3)})
    dst = torch.empty_like(slots[chosen])
    src = slots[chosen]
    us = graph_us(lambda: dst.copy_(src), 5, calls=args.iters)
    records.append({"bench": "read_pattern", "order": "copy", "us": round(us, 2), "gbps": round(2 * nbytes / us / 1e3)})
    for r in records:
        print(f"read_pattern {r['order']:>9}: {r['us']:7.2f} us, {r['gbps']:5d} GB/s ({nbytes / 1e6:.1f} MB)")
    print(json.dumps(records))


if __name__ == "__main__":
    main()
