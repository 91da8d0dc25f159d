"""What it costs a grouped MoE layer's down kernel to wait for its gate/up kernel, three ways, on programs shaped
as `fused_moe_fp4_mma`'s at batch 1 (gate/up: 8 tiles x 96 programs of 2 warps; down: 8 x 128 of 1 warp):

  - `sequential`: down launched after gate/up, in stream order;
  - `pdl`: down a programmatic dependent launch of gate/up (`griddepcontrol.launch_dependents` at gate/up's start,
    `griddepcontrol.wait` in down), as `fused_moe_fp4_mma.PROGRAMMATIC_LAUNCH`;
  - `counters`: one launch of both, the down programs after the gate/up ones; each gate/up program adds 1 to its
    tile's counter (release) when done, and a down program spins on its tile's counter (acquire) until the tile's
    96 have; the tile's last down program zeroes the counters for the next call.

Each gate/up program busy-waits --work-us (clock64, at the clock --ghz), each down program only stores a word (one
launch has one num_warps, so under `counters` the down programs run 2 warps, not 1). The figure is the time per
call from CUDA-graph replays (`gpu_timing.graph_us`), and, against gate/up alone, what the dependency adds: the
wait's latency plus down's launch and its programs' own time.

    python benches/dependency_gap.py [--work-us 6] [--ghz 1.98] [--iters 50]

Prints one line per variant and a final JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from gpu_timing import graph_us

TILES, GATE_UP_PER_TILE, DOWN_PER_TILE = 8, 96, 128

_CLOCK = tl.constexpr("mov.u64 $0, %clock64;")
_LAUNCH_DEPENDENTS = tl.constexpr("griddepcontrol.launch_dependents; // $0")
_WAIT_PRIMARY = tl.constexpr("griddepcontrol.wait; // $0")


@triton.jit
def _spin(cycles):
    """Busy-wait `cycles` SM clock cycles (int64)."""
    t0 = tl.inline_asm_elementwise(_CLOCK, "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < cycles:
        t = tl.inline_asm_elementwise(_CLOCK, "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gate_up(out_ptr, cycles, PDL: tl.constexpr):
    """A gate/up program: busy `cycles`, then one store."""
    if PDL:
        tl.inline_asm_elementwise(_LAUNCH_DEPENDENTS, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    _spin(cycles)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1)


@triton.jit
def _down(out_ptr, PDL: tl.constexpr):
    """A down program: (PDL: waits for gate/up) one store."""
    if PDL:
        tl.inline_asm_elementwise(_WAIT_PRIMARY, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 2)


@triton.jit
def _both(out_ptr, count_ptr, done_ptr, cycles, GATE_UP: tl.constexpr, DOWN: tl.constexpr):
    """Gate/up and down programs in one grid (axis 1: GATE_UP gate/up programs of tile axis 0, then DOWN down
    programs), the down ones waiting on the tile's counter."""
    tile = tl.program_id(0)
    j = tl.program_id(1)
    if j < GATE_UP:
        _spin(cycles)
        tl.store(out_ptr + tile * (GATE_UP + DOWN) + j, 1)
        tl.atomic_add(count_ptr + tile, 1, sem="release", scope="gpu")
    else:
        seen = tl.atomic_add(count_ptr + tile, 0, sem="acquire", scope="gpu")
        while seen < GATE_UP:
            seen = tl.atomic_add(count_ptr + tile, 0, sem="acquire", scope="gpu")
        tl.store(out_ptr + tile * (GATE_UP + DOWN) + j, 2)
        if tl.atomic_add(done_ptr + tile, 1, sem="relaxed", scope="gpu") == DOWN - 1:
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(done_ptr + tile, 0, sem="relaxed", scope="gpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-us", type=float, default=6.0, help="each gate/up program's busy time")
    parser.add_argument("--ghz", type=float, default=1.98, help="SM clock the busy time is counted at")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    cycles = int(args.work_us * args.ghz * 1e3)
    dev = torch.device("cuda")
    gate_up_out = torch.zeros(TILES * GATE_UP_PER_TILE, dtype=torch.int32, device=dev)
    down_out = torch.zeros(TILES * DOWN_PER_TILE, dtype=torch.int32, device=dev)
    both_out = torch.zeros(TILES * (GATE_UP_PER_TILE + DOWN_PER_TILE), dtype=torch.int32, device=dev)
    count = torch.zeros(TILES, dtype=torch.int32, device=dev)
    done = torch.zeros(TILES, dtype=torch.int32, device=dev)

    def gate_up_only():
        _gate_up[(TILES, GATE_UP_PER_TILE)](gate_up_out, cycles, PDL=False, num_warps=2)

    def sequential():
        gate_up_only()
        _down[(TILES, DOWN_PER_TILE)](down_out, PDL=False, num_warps=1)

    def pdl():
        _gate_up[(TILES, GATE_UP_PER_TILE)](gate_up_out, cycles, PDL=True, num_warps=2)
        _down[(TILES, DOWN_PER_TILE)](down_out, PDL=True, num_warps=1, launch_pdl=True)

    def counters():
        grid = (TILES, GATE_UP_PER_TILE + DOWN_PER_TILE)
        _both[grid](both_out, count, done, cycles, GATE_UP=GATE_UP_PER_TILE, DOWN=DOWN_PER_TILE, num_warps=2)

    records = []
    base = None
    for name, fn in (("gate_up_only", gate_up_only), ("sequential", sequential), ("pdl", pdl), ("counters", counters)):
        us = graph_us(fn, args.iters)
        base = base if base is not None else us
        torch.cuda.synchronize()
        ok = bool((count == 0).all() and (done == 0).all())
        records.append({"bench": "dependency_gap", "variant": name, "us_per_call": round(us, 2),
                        "added_us": round(us - base, 2), "counters_reset": ok})  # fmt: skip
        print(f"dependency_gap {name:>12}: {us:7.2f} us per call, {us - base:+6.2f} us over gate/up alone")
    print(json.dumps(records))


if __name__ == "__main__":
    main()
