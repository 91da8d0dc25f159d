"""GPU grouped-kernel time per MoE layer call: quantized slots (`fused_moe_quant`: FP8 128x128, NVFP4, MXFP4)
against the bf16 slot kernel (`fused_moe`, the baseline), at Qwen3-30B-A3B's expert shapes (H 2048, I 768, top-8).

    python benches/quant_moe.py [--slots 128] [--batch 1 4 16 64 512] [--iters 50] [--profile] [--sweep]
                                [--kernels auto mma gemv fp4_mma fp4_mma:GU/DOWN[/OPTION..]] [--byte-loads]
                                [--packed-slots]

Each row: microseconds per call (CUDA events, median; the call includes `align_pairs` and the k-sum), the same
replayed from a CUDA graph of 20 calls (`graph_us`: no host launch gaps, as the engine's decode graphs run it),
speed against bf16's call at that batch, the expert bytes the call reads (distinct slots routed to x the format's
expert_nbytes) per second, and the time per weight byte relative to bf16. --profile adds each kernel's own
microseconds and their span per call, from the first kernel's start to the last one's end (torch profiler over a
CUDA graph replay: `_gate_up_quant_kernel`, `_down_quant_kernel` and bf16's `_gate_up_kernel`, `_down_kernel`), and
the span's time per weight byte against bf16's (`kernel_time_per_byte_vs_bf16`, the issue's 1.3x target). The span
counts the gap between the kernels once and their overlap once: fp4_mma's down kernel, a programmatic dependent
launch of gate/up, starts before gate/up ends, so its own time includes its wait. --sweep also times, per format
and batch, each 4-bit scale mode (`fused_moe_quant.SCALE_MODES`, one row each, with its kernels' microseconds
under --profile) and the (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) configs one step from the default
(`neighbours`), and prints the fastest, to retune `fused_moe_quant.SCALE_MODE` and `LAUNCH_CONFIGS` (about a
minute at --batch 1 4 16). --byte-loads runs the 4-bit kernels with `fused_moe_quant.WORD_LOADS` off (block scales
read by byte and activations by 16-bit element inside each K step, as before), to time the word loads. Slots are
`SLOT_ALIGN` bytes apart, as the pool's and the slot cache's are; --packed-slots puts them expert_nbytes apart (the
bench before: NVFP4's 2654220 bytes are not 16-divisible, so Triton's launch cannot prove the weights' loads
aligned and they go by byte, ~1.7x the instructions of the aligned build in
`benches/quant_moe_sass.py --unaligned-stride`).
--kernels picks the quantized kernels timed, a row each: `auto` (what `fused_moe_quant` runs when left to choose, as
the server does), `mma` (the tensor-core kernels), `gemv` (`fused_moe_gemv`'s CUDA-core kernels, any batch, at
their `GEMV_CONFIGS`: `benches/gemv_grid.py` times those kernels' configs) and `fp4_mma` (`fused_moe_fp4_mma`,
NVFP4 / MXFP4), or `fp4_mma:GU/DOWN` at other (gate/up, down) `Fp4MmaConfig`s, each K_UNITS,WARPS,PREFETCH,
MAX_REGISTERS[,UNROLL[,SPLIT]] (e.g. `fp4_mma:4,2,1,128,1/4,1,1,80,0,3`, batch 1's), and options
(`FP4_MMA_OPTIONS`: `/nopdl`: the down kernel launched after gate/up, not as its dependent; `/contiguous`: the
warps' K slices contiguous, not interleaved). Plain `fp4_mma` runs the configs the
call's batch gets (`fused_moe_fp4_mma.default_configs`). --sweep candidates are
checked against the default config's output (`sweep_max_diff`, of the largest output) and ranked by the kernels'
own microseconds under --profile (the call's are launch-bound), else by the call's.
Prints one line per row and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gpu_timing import capture, graph_us

from freetoken.kernels import fused_moe_fp4_mma as fp4_mma_module
from freetoken.kernels import fused_moe_quant as fused_moe_quant_module
from freetoken.kernels.fused_moe import fused_moe
from freetoken.kernels.fused_moe_gemv import GEMV_CONFIGS
from freetoken.kernels.fused_moe_quant import SCALE_MODES, default_kernel, fused_moe_quant, launch_config
from freetoken.quant import BF16, MXFP4, NVFP4, fp8_block
from freetoken.quant import reference as ref

HIDDEN, INTER, TOP_K = 2048, 768, 8
# the values of each (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) field that --sweep tries, one field at a time
# (FP8 clamps K to its scale block's 128)
SWEEP_AXES = ((16, 32, 64), (128, 256), (4, 8), (3, 4, 5))
# bytes between slots: rust/freetoken-core/src/pool EXPERT_ALIGN, the pool's and the slot cache's expert stride
SLOT_ALIGN = 256


def neighbours(config: tuple[int, ...], axes: tuple[tuple[int, ...], ...] = SWEEP_AXES) -> list[tuple[int, ...]]:
    """The configs of `axes` that differ from `config` in one field: a few compiles per format and M tile where the
    whole grid took minutes."""
    out = []
    for i, values in enumerate(axes):
        out += [config[:i] + (v,) + config[i + 1 :] for v in values if v != config[i]]
    return out


def slots_of(fmt, num_slots: int, packed: bool = False) -> torch.Tensor:
    """[S, expert_nbytes rounded up to SLOT_ALIGN] uint8 on the GPU (a view of [S, expert_nbytes] when `packed`):
    one reference-quantized random expert repeated (speed does not depend on the values)."""
    layout = fmt.layout(HIDDEN, INTER)
    gen = torch.Generator().manual_seed(0)
    gate, up, down = (
        torch.randn(r, c, generator=gen) * 0.02 for r, c in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    )
    if fmt.quantized:
        one = ref.pack_expert(layout, *(ref.quantize_matrix(fmt, w) for w in (gate, up, down)))
    else:
        one = torch.cat([gate, up, down.reshape(-1, HIDDEN)]).to(torch.bfloat16).reshape(-1).view(torch.uint8)
    stride = one.numel() if packed else -(-one.numel() // SLOT_ALIGN) * SLOT_ALIGN
    slots = torch.zeros(num_slots, stride, dtype=torch.uint8, device="cuda")
    slots[:, : one.numel()] = one.cuda()
    return slots[:, : one.numel()]


def routing(batch: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [batch, HIDDEN] bf16, ids [batch, TOP_K] int64, weights [batch, TOP_K] bf16) on the GPU, seeded by
    `batch`: TOP_K distinct random slots per token, softmax routing weights, N(0, 1) activations."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.stack([torch.randperm(num_slots, generator=gen)[:TOP_K] for _ in range(batch)]).cuda()
    weights = torch.softmax(torch.randn(batch, TOP_K, generator=gen), -1).to(torch.bfloat16).cuda()
    x = torch.randn(batch, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    return x, ids, weights


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


def kernel_us(fn, names: tuple[str, ...], iters: int) -> tuple[dict[str, float], float]:
    """(mean device microseconds per call of each kernel in `names`, over `iters` calls of `fn` replayed from a CUDA
    graph (`capture`; torch profiler); the median per call from the start of its first kernel (`names[0]`) to the
    end of its last, its span): what the kernels take together, the gap between them included, and
    counted once where they overlap (the fp4_mma down kernel launched as a programmatic dependent of gate/up: its
    own time then includes its wait)."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(fn, iters)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    found = {e.key: e.device_time_total / iters for e in prof.key_averages() if e.key in names}
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.name in names and e.device_type.name == "CUDA"
    )
    spans, start, end = [], None, 0.0
    for t0, t1, name in kernels:  # a call's kernels run in order: each names[0] starts a call
        if name == names[0]:
            if start is not None:
                spans.append(end - start)
            start = t0
        end = max(end, t1)
    if start is not None:
        spans.append(end - start)
    per_kernel = {name: round(found.get(name, 0.0), 2) for name in names}
    return per_kernel, round(statistics.median(spans), 2) if spans else 0.0


def time_row(args, fmt, kernel: str, batch: int, x, slots, layout, ids, weights) -> dict:
    """One row: `kernel`'s ("bf16", "mma" or "gemv") microseconds per call at its default config, under --sweep its
    neighbours' and scale modes', under --profile its kernels' own microseconds."""
    names: tuple[str, ...]
    configs: list = [None]
    modes = list(SCALE_MODES) if args.sweep and kernel == "mma" and fmt.weight_bits == 4 else []
    restore: dict = {}  # fp4_mma module settings a row's options changed, put back at its end
    if kernel == "bf16":
        names = ("_gate_up_kernel", "_down_kernel")
        words = slots.view(torch.bfloat16)
        gate_up, down = (
            words[:, : 2 * INTER * HIDDEN].view(-1, 2 * INTER, HIDDEN),
            words[:, 2 * INTER * HIDDEN :].view(-1, HIDDEN, INTER),
        )

        def call(config, mode=None):
            return fused_moe(x, gate_up, down, ids, weights)
    elif kernel == "mma":
        names = ("_gate_up_quant_kernel", "_down_quant_kernel")
        default = launch_config(fmt, batch * TOP_K)
        configs += neighbours(default) if args.sweep else []

        def call(config, mode=None):
            return fused_moe_quant(x, slots, layout, ids, weights, config=config, scale_mode=mode, kernel="mma")
    elif kernel.startswith("fp4_mma"):
        names = ("_gate_up_fp4_mma_kernel", "_down_fp4_mma_kernel")
        default, settings = fp4_variant(kernel)
        restore.update((name, getattr(fp4_mma_module, name)) for name in settings)
        for name, value in settings.items():
            setattr(fp4_mma_module, name, value)

        def call(config, mode=None):
            return fused_moe_quant(x, slots, layout, ids, weights, kernel="fp4_mma", fp4_mma_configs=default)
    else:
        names = ("_gate_up_gemv_kernel", "_down_gemv_kernel")
        default = GEMV_CONFIGS[fmt.weight_bits]

        def call(config, mode=None):
            return fused_moe_quant(x, slots, layout, ids, weights, kernel="gemv")

    us = time_call(lambda: call(None), args.iters)
    graph = graph_us(lambda: call(None), args.iters)
    timed = []
    sweep = configs if len(configs) > 1 else []
    default_out = call(None).float() if sweep else None
    worst = 0.0  # each sweep candidate's output against the default's: a config must not change the result
    for config in sweep:
        try:
            if config is not None:
                worst = max(worst, ((call(config).float() - default_out).abs().max() / default_out.abs().max()).item())
            if args.profile:  # rank by the kernels' own time: the call's is launch-bound
                score = sum(kernel_us(lambda c=config: call(c), names, args.iters)[0].values())
            else:
                score = us if config is None else time_call(lambda c=config: call(c), args.iters)
            timed.append((score, config))
        except Exception as e:  # a sweep candidate the format cannot tile (FP8 blocks) or out of resources
            print(f"quant_moe {fmt.name:>9} {kernel} batch {batch:>3}: config {config} failed: {type(e).__name__}: {e}")
    record: dict = {
        "bench": "quant_moe",
        "format": fmt.name,
        "kernel": kernel,
        "batch": batch,
        "us_per_call": round(us, 2),
        "graph_us_per_call": round(graph, 2),
    }
    if kernel != "bf16":
        record["config"] = default
    if len(timed) > 1:
        best_us, best = min(timed, key=lambda t: t[0])
        key = "best_kernel_us" if args.profile else "best_us_per_call"
        record["best_config"], record[key] = best or default, round(best_us, 2)
        record["sweep"] = [[list(c or default), round(t, 2)] for t, c in timed]
        # bf16 outputs of float32 sums in other orders: a rounding step (2^-8 relative) at most; a wrong result is O(1)
        record["sweep_max_diff"] = round(worst, 5)
        if worst > 2e-2:
            print(
                f"quant_moe {fmt.name:>9} {kernel} batch {batch:>3}: a sweep config changed the output by {worst:.3g}"
            )
    for mode in modes:  # each 4-bit scale mode at the default config, side by side
        mode_us = time_call(lambda m=mode: call(None, m), args.iters)
        line = f"quant_moe {fmt.name:>9} batch {batch:>3}: scale mode {mode:>4}: {mode_us:8.1f} us per call"
        record.setdefault("scale_modes", {})[mode] = {"us_per_call": round(mode_us, 2)}
        if args.profile:
            mode_kernels = kernel_us(lambda m=mode: call(None, m), names, args.iters)[0]
            record["scale_modes"][mode]["kernel_us"] = mode_kernels
            line += f"; kernels {mode_kernels}"
        print(line)
    if args.profile:
        record["kernel_us"], record["kernel_span_us"] = kernel_us(lambda: call(None), names, args.iters)
    for name, value in restore.items():
        setattr(fp4_mma_module, name, value)
    return record


# `fp4_mma:GU/DOWN/OPTION..` options: the `fused_moe_fp4_mma` module settings each one changes for that row
FP4_MMA_OPTIONS = {"nopdl": ("PROGRAMMATIC_LAUNCH", False), "contiguous": ("INTERLEAVED_SLICES", False)}


def fp4_variant(kernel: str):
    """("fp4_mma" or "fp4_mma:GU/DOWN[/OPTION..]", GU and DOWN `Fp4MmaConfig`s as K_UNITS,WARPS,PREFETCH,MAX_REGISTERS
    [,UNROLL[,SPLIT]], options from FP4_MMA_OPTIONS) -> (the (gate/up, down) configs or None: the defaults,
    {module setting: value}).

    Raises:
        ValueError: an option FP4_MMA_OPTIONS does not name."""
    if kernel == "fp4_mma":
        return None, {}
    parts = kernel.split(":", 1)[1].split("/")
    configs = tuple(tuple(int(v) for v in part.split(",")) for part in parts[:2])
    unknown = [o for o in parts[2:] if o not in FP4_MMA_OPTIONS]
    if unknown:
        raise ValueError(f"{kernel}: unknown options {unknown}; options are {', '.join(FP4_MMA_OPTIONS)}")
    return configs, dict(FP4_MMA_OPTIONS[o] for o in parts[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also each kernel's microseconds (torch profiler)")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the scale modes and neighbouring launch configs"
    )
    parser.add_argument(
        "--byte-loads",
        action="store_true",
        help="the 4-bit kernels' previous loads (scales by byte, activations by 16-bit element) instead of words",
    )
    parser.add_argument("--packed-slots", action="store_true", help="slots expert_nbytes apart, not SLOT_ALIGN")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        help="auto, mma, gemv, fp4_mma, or fp4_mma:GU/DOWN[/OPTION..]: fp4_mma at these (gate/up, down) configs "
        "(K_UNITS,WARPS,PREFETCH,MAX_REGISTERS[,UNROLL[,SPLIT]] each) and options: nopdl (the down kernel launched "
        "after gate/up, not as its dependent), contiguous (the warps' K slices contiguous)",
    )
    args = parser.parse_args()
    if args.byte_loads:
        fused_moe_quant_module.WORD_LOADS = False
    records = []
    for batch in args.batch:
        x, ids, weights = routing(batch, args.slots)
        distinct = int(ids.unique().numel())
        base_us_per_byte = base_us = base_span_us_per_byte = base_graph_us_per_byte = None
        for fmt in (BF16, fp8_block(), NVFP4, MXFP4):
            layout = fmt.layout(HIDDEN, INTER)
            slots = slots_of(fmt, args.slots, args.packed_slots)
            for kernel in args.kernels if fmt.quantized else ["bf16"]:
                if kernel.startswith("fp4_mma") and fmt.weight_bits != 4:
                    continue  # the 4-bit formats' kernels
                if kernel == "auto":
                    kernel = default_kernel(layout, slots, batch * TOP_K, x)
                record = time_row(args, fmt, kernel, batch, x, slots, layout, ids, weights)
                nbytes = distinct * layout.expert_nbytes
                us = record["us_per_call"]
                base_us_per_byte = base_us_per_byte or us / nbytes
                base_us = base_us or us
                record["speed_vs_bf16"] = round(base_us / us, 3)
                record["expert_gbps"] = round(nbytes / us / 1e3, 2)
                record["time_per_byte_vs_bf16"] = round(us / nbytes / base_us_per_byte, 3)
                graph = record["graph_us_per_call"]
                base_graph_us_per_byte = base_graph_us_per_byte or graph / nbytes
                record["graph_time_per_byte_vs_bf16"] = round(graph / nbytes / base_graph_us_per_byte, 3)
                if args.profile:
                    span = record["kernel_span_us"]
                    base_span_us_per_byte = base_span_us_per_byte or span / nbytes
                    record["kernel_time_per_byte_vs_bf16"] = round(span / nbytes / base_span_us_per_byte, 3)
                records.append(record)
                print(
                    f"quant_moe {fmt.name:>9} {kernel:>4} batch {batch:>3}: {us:8.1f} us per call, "
                    f"{record['speed_vs_bf16']:.2f}x bf16's speed, {record['expert_gbps']:7.1f} GB/s of expert "
                    f"bytes, time per byte {record['time_per_byte_vs_bf16']:.2f}x bf16's; graph {graph:.1f} us per "
                    f"call, {record['graph_time_per_byte_vs_bf16']:.2f}x bf16's per byte"
                    + (
                        f"; kernels {record['kernel_us']}, span {record['kernel_span_us']} us, kernel time per byte "
                        f"{record['kernel_time_per_byte_vs_bf16']:.2f}x bf16's"
                        if args.profile
                        else ""
                    )
                    + (
                        f"; best {record['best_config']} at "
                        f"{record.get('best_kernel_us', record.get('best_us_per_call')):.1f} us"
                        if "best_config" in record
                        else ""
                    )
                )
    print(json.dumps(records))


if __name__ == "__main__":
    main()
