"""Each gemv kernel's time over a grid of launch configs (`fused_moe_gemv`), to choose `GEMV_CONFIGS` per kernel.

    python benches/gemv_grid.py [--kernel gemv|fp4_mma] [--formats fp8 nvfp4 mxfp4] [--batch 1 4] [--iters 50]
                                [--jobs 16] [--configs N,K,WARPS,PREFETCH ...] [--repeat 1] [--contiguous-slices]

Every `GemvConfig` of `GRID_AXES` (or those given by --configs) is timed, and each kernel's own microseconds (torch
profiler over a CUDA graph of --iters calls, the median of --repeat runs) rank it alone: the two kernels read matrices
of different shapes (gate/up [2 I, H], down [H, I]) and need not share a config. Slots, routing and activations are
`quant_moe.py`'s (Qwen3-30B-A3B shapes, 128 slots `SLOT_ALIGN` apart, distinct random experts per token). Each config's
output is checked against the default config's. The configs compile first in `--jobs` processes (Triton's on-disk
cache), then are timed one by one in this process. --kernel fp4_mma times `fused_moe_fp4_mma`'s configs instead
(K_UNITS,WARPS,PREFETCH,MAX_REGISTERS; --contiguous-slices: with its warps' K slices contiguous, not interleaved), its
down kernel launched after gate/up rather than as its programmatic dependent, so that each kernel's time is its own
(`benches/quant_moe.py --profile` times the two together). Prints one line per format, batch and kernel (the best
config, its microseconds, the default's) and a final JSON line with every timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

import torch
from quant_moe import HIDDEN, INTER, kernel_us, routing, slots_of

from freetoken.kernels import fused_moe_fp4_mma
from freetoken.kernels.fused_moe_fp4_mma import FP4_MMA_CONFIGS, fits
from freetoken.kernels.fused_moe_gemv import GEMV_CONFIGS, gemv_k_step
from freetoken.kernels.fused_moe_quant import fused_moe_quant
from freetoken.quant import MXFP4, NVFP4, fp8_block

FORMATS = {"fp8": fp8_block(), "nvfp4": NVFP4, "mxfp4": MXFP4}
# (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, prefetch depth)
GRID_AXES = ((4, 8, 16), (256, 512, 1024), (1, 2, 4), (1, 2))
NAMES = ("_gate_up_gemv_kernel", "_down_gemv_kernel")
# --kernel fp4_mma (`fused_moe_fp4_mma.Fp4MmaConfig`): (K step / 32 columns, num_warps: K slices, prefetch depth,
# registers per thread: 0 ptxas's choice)
FP4_MMA_AXES = ((4, 8), (1, 2, 4, 8), (0, 1, 2), (0, 128, 168))
FP4_MMA_NAMES = ("_gate_up_fp4_mma_kernel", "_down_fp4_mma_kernel")


def inputs(fmt, batch: int):
    """(x, slots, layout, ids, weights) as `quant_moe.py` builds them for `batch` tokens on 128 slots."""
    x, ids, weights = routing(batch, 128)
    return x, slots_of(fmt, 128), fmt.layout(HIDDEN, INTER), ids, weights


def median_kernel_us(fn, names: tuple[str, ...], iters: int, repeat: int) -> dict[str, float]:
    """Each of `names`' microseconds per call of `fn`: the median of `repeat` profiles of `iters` calls."""
    runs = [kernel_us(fn, names, iters)[0] for _ in range(repeat)]
    return {kernel: statistics.median(run[kernel] for run in runs) for kernel in names}


def run(kernel: str, args, config) -> torch.Tensor:
    """`fused_moe_quant` on `args` (x, slots, layout, ids, weights) through `kernel`'s kernels, both at `config`
    (None: their defaults)."""
    configs = None if config is None else (config, config)
    if kernel == "fp4_mma":
        # a config that does not split one matrix's columns into whole steps: that kernel at its default
        if config is not None:
            configs = tuple(
                c if fits(c, n) else d for c, n, d in zip(configs, (HIDDEN, INTER), FP4_MMA_CONFIGS, strict=True)
            )
        return fused_moe_quant(*args, kernel=kernel, fp4_mma_configs=configs)
    return fused_moe_quant(*args, kernel=kernel, gemv_configs=configs)


def configs_of(kernel: str, fmt) -> list[tuple[int, ...]]:
    """The grid of `kernel` for `fmt`; gemv's without configs whose K steps (`gemv_k_step`) repeat another's (FP8's
    cap)."""
    if kernel == "fp4_mma":
        return list(itertools.product(*FP4_MMA_AXES))
    seen, out = set(), []
    for n, k, w, p in itertools.product(*GRID_AXES):
        key = (n, gemv_k_step(fmt, k, HIDDEN), gemv_k_step(fmt, k, INTER), w, p)
        if key not in seen:
            seen.add(key)
            out.append((n, k, w, p))
    return out


def _compile(job: tuple[str, str, int, list[tuple[int, ...]], bool]) -> list[str]:
    """Run each config once (compiles it into Triton's cache); the errors, as text."""
    kernel, name, batch, configs, fused_moe_fp4_mma.INTERLEAVED_SLICES = job
    fused_moe_fp4_mma.PROGRAMMATIC_LAUNCH = False  # as `main` times them
    args = inputs(FORMATS[name], batch)
    errors = []
    for config in configs:
        try:
            run(kernel, args, config)
        except Exception as e:  # out of resources: reported, then skipped in the timing
            errors.append(f"{name} {config}: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="gemv", choices=["gemv", "fp4_mma"])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="N,K,WARPS,PREFETCH",
        help="time these configs instead of the grid (fp4_mma: K_UNITS,WARPS,PREFETCH,MAX_REGISTERS)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="profile each config this many times (median)")
    parser.add_argument(
        "--contiguous-slices", action="store_true", help="fp4_mma: each warp's K slice contiguous, not interleaved"
    )
    args = parser.parse_args()
    fused_moe_fp4_mma.INTERLEAVED_SLICES = not args.contiguous_slices
    # each kernel is timed alone: a down kernel launched early would count its wait for gate/up as its own time
    fused_moe_fp4_mma.PROGRAMMATIC_LAUNCH = False
    chosen = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else None
    jobs = []
    split = max(1, args.jobs // (len(args.formats) * len(args.batch)))
    for name, batch in itertools.product(args.formats, args.batch):
        configs = chosen or configs_of(args.kernel, FORMATS[name])
        jobs += [(args.kernel, name, batch, configs[i::split], not args.contiguous_slices) for i in range(split)]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        for errors in pool.map(_compile, jobs):
            for line in errors:
                print(f"gemv_grid: {line}")
    names = FP4_MMA_NAMES if args.kernel == "fp4_mma" else NAMES
    records = []
    for name in args.formats:
        fmt = FORMATS[name]
        for batch in args.batch:
            data = inputs(fmt, batch)
            default = FP4_MMA_CONFIGS if args.kernel == "fp4_mma" else GEMV_CONFIGS[fmt.weight_bits]

            def call(config, data=data):
                return run(args.kernel, data, config)

            reference = call(None).float()
            timings = []
            for config in chosen or configs_of(args.kernel, fmt):
                try:
                    diff = ((call(config).float() - reference).abs().max() / reference.abs().max()).item()
                    us = median_kernel_us(lambda c=config: call(c), names, args.iters, args.repeat)
                except Exception:  # reported by the compile pass
                    continue
                timings.append({"config": list(config), "us": us, "max_diff": round(diff, 5)})
                if diff > 2e-2:
                    print(f"gemv_grid {name} batch {batch}: config {config} changed the output by {diff:.3g}")
            base = median_kernel_us(lambda: call(None), names, args.iters, args.repeat)
            for i, (kernel, kernel_default) in enumerate(zip(names, default, strict=True)):
                num_in = (HIDDEN, INTER)[i]
                own = [t for t in timings if args.kernel != "fp4_mma" or fits(tuple(t["config"]), num_in)]
                best = min(own, key=lambda t: t["us"][kernel])
                print(
                    f"gemv_grid {name:>9} batch {batch:>3} {kernel:>25}: best {tuple(best['config'])} "
                    f"{best['us'][kernel]:.2f} us, default {kernel_default} {base[kernel]:.2f} us"
                )
            records.append({"format": fmt.name, "batch": batch, "default_us": base, "timings": timings})
    print(json.dumps(records))


if __name__ == "__main__":
    main()
